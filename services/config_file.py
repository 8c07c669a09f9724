"""`dsde check-config FILE`: a Serve config file checked as `serve deploy FILE` would meet it, in a second.

`serve deploy` checks Serve's own schema, and a DSDE application's `args` fail in build_app, quickly. A deployment's
`user_config` reaches our code only in the replica's reconfigure(), after the replica has loaded its models: a bad
policy there costs three replica starts (each loading the models) before the application shows DEPLOY_FAILED. This
check reads the file without a cluster and names the application and the field of the first problem.

With a cluster to ask (`--address`), `unplaced` also tells whether each application's actors can be placed on the
nodes it has: a replica whose placement no node set can hold waits for it (placement_timeout_s, or forever without a
placement group) instead of failing at deploy time.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

import yaml

from dsde_core.errors import ConfigError
from services.config import ROLES, PolicyConfig, ServiceConfig, autoscaling_config

IMPORT_PATH = "services.app:build_app"  # a DSDE Serve application; others are Serve's to check
DEPLOYMENT = "DSDEServer"  # the application's one deployment (services.ingress)


@dataclass(frozen=True)
class CheckedApp:
    name: str
    route_prefix: str | None
    config: ServiceConfig | None  # None: not a DSDE Serve application, left to Serve
    policy: PolicyConfig | None = None  # the user_config that applies (the deployment's over the args'); None: none
    autoscaling: dict[str, Any] | None = None  # the autoscaling_config that applies; None: a fixed replica count
    num_replicas: int = 1  # without autoscaling
    notes: tuple[str, ...] = ()  # what deserves a look but deploys

    def describe(self) -> str:
        if self.config is None:
            return f"application {self.name!r}: not DSDE Serve (not checked beyond Serve's schema)"
        cfg = self.config
        policy = self.policy.describe() if self.policy else cfg.policy
        return (f"application {self.name!r} at {self.route_prefix or '/'}: serves {cfg.served_name!r} "
                f"(target {cfg.target}, draft {cfg.draft or 'none'}, {cfg.dtype}, {cfg.max_batch_size} slots), "
                f"policy {policy}, {self.replicas()}")

    def replicas(self) -> str:
        a = self.autoscaling
        if a is None:
            return f"{self.num_replicas} replica{'s' * (self.num_replicas != 1)}"
        return (f"autoscaling from {a.get('min_replicas', 1)} to {a.get('max_replicas', 1)} replicas at "
                f"{a['target_ongoing_requests']:g} ongoing requests each")

    def placement(self) -> str | None:
        """Where the actors go, in a line, when the config says anything about it (custom resources, a group)."""
        cfg = self.config
        if cfg is None or not (cfg.placement_strategy or any(getattr(cfg, f"{r}_resources") for r in ROLES)):
            return None
        roles = [*cfg.model_roles(), "controller"]
        wants = ", ".join(f"{role} {_resources(cfg.resources(role))}" for role in roles)
        group = f"one {cfg.placement_strategy} placement group per replica" if cfg.placement_strategy else \
            "no placement group"
        return f"placement: {group}; {wants}"

    def ceiling_note(self) -> str | None:
        """PolicyConfig.ceiling_note of the user_config that applies (or the args' policy) against the args' max_sl."""
        if self.config is None:
            return None
        return (self.policy or PolicyConfig(policy=self.config.policy)).ceiling_note(self.config.max_sl)


def check_config_file(path: str | Path) -> list[CheckedApp]:
    """Every application of a Serve config file, checked; ConfigError naming the file, application and field."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("applications"), list):
        raise ConfigError(f"{path}: not a Serve config file (a mapping with a list of `applications`)")
    _check_serve_schema(path, doc)
    return [_check_app(path, app) for app in doc["applications"]]


def _check_serve_schema(path: Path, doc: dict[str, Any]) -> None:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(doc)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"{path}: Serve's schema: {problems}") from None


def _check_app(path: Path, app: dict[str, Any]) -> CheckedApp:
    name = app.get("name", "default")
    if app.get("import_path") != IMPORT_PATH:
        return CheckedApp(name, app.get("route_prefix"), None)
    where = f"{path}: application {name!r}"
    args = dict(app.get("args") or {})
    app_user_config = args.pop("user_config", None)
    app_autoscaling = args.pop("autoscaling_config", None)
    try:
        config = ServiceConfig.from_args(args)
    except ConfigError as e:
        raise ConfigError(f"{where}: args: {e}") from None
    policy = _policy(f"{where}: args.user_config", app_user_config)
    max_ongoing = config.max_ongoing_requests
    autoscaling = _autoscaling(f"{where}: args", config, app_autoscaling, max_ongoing)
    num_replicas, notes = 1, []
    for deployment in app.get("deployments") or []:
        if deployment.get("name") != DEPLOYMENT:
            raise ConfigError(f"{where}: deployments: no deployment named {deployment.get('name')!r} in the "
                              f"application (it has {DEPLOYMENT!r})")
        if "user_config" in deployment:  # the deployment's replaces the args' (Serve's override)
            policy = _policy(f"{where}: deployments[{DEPLOYMENT}].user_config", deployment["user_config"])
        max_ongoing = deployment.get("max_ongoing_requests", max_ongoing)
        if isinstance(given := deployment.get("autoscaling_config"), dict):  # likewise, whole: Serve's defaults
            if "target_ongoing_requests" not in given:
                serve_default = _serve_default_target()
                notes.append(f"deployments[{DEPLOYMENT}].autoscaling_config has no target_ongoing_requests: Serve's "
                             f"default {serve_default:g} applies, so a replica of {config.max_batch_size} KV slots "
                             f"scales up with {serve_default:g} requests (max_batch_size is the usual target: "
                             f"docs/scaling.md)")
                given = {**given, "target_ongoing_requests": serve_default}
            autoscaling = _autoscaling(f"{where}: deployments[{DEPLOYMENT}]", config, given, max_ongoing)
        elif isinstance(deployment.get("num_replicas"), int):
            autoscaling, num_replicas = None, deployment["num_replicas"]
    return CheckedApp(name, app.get("route_prefix"), config, policy, autoscaling, num_replicas, tuple(notes))


def _serve_default_target() -> float:
    from ray.serve.config import AutoscalingConfig

    return float(AutoscalingConfig.model_fields["target_ongoing_requests"].default)


def _autoscaling(where: str, config: ServiceConfig, given: Any, max_ongoing: int) -> dict[str, Any] | None:
    if given is None:
        return None
    try:
        return autoscaling_config(config, given, max_ongoing)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}", "autoscaling_config") from None


def _policy(where: str, user_config: Any) -> PolicyConfig | None:
    if user_config is None:
        return None
    if not isinstance(user_config, dict):
        raise ConfigError(f"{where}: a mapping (policy, params, cap, max_sl), got {user_config!r}")
    try:
        return PolicyConfig.from_dict(user_config)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


# ---- placement on a running cluster ----------------------------------------------------------------------------
Resources = dict[str, float]


def _resources(wants: Resources) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in wants.items()) + "}" if wants else "{} (nothing)"


def _fits(wants: Resources, node: Resources) -> bool:
    return all(node.get(k, 0.0) >= v - 1e-9 for k, v in wants.items())


def _short(wants: Resources, nodes: list[Resources]) -> str:
    """Why no node holds `wants`: the first resource no node has enough of, with the most one has."""
    for name, amount in wants.items():
        most = max((node.get(name, 0.0) for node in nodes), default=0.0)
        if most < amount - 1e-9:
            return f"{name} {amount:g} ({f'the most any node has is {most:g}' if most else 'no node has it'})"
    lacks = [f"node {i} lacks " + ", ".join(f"{k} {v:g}" for k, v in wants.items() if not _fits({k: v}, node))
             for i, node in enumerate(nodes)]
    return f"{_resources(wants)} on one node, and each lacks some ({'; '.join(lacks)})"


def _missing(role: str, wants: Resources, nodes: list[Resources]) -> str:
    return f"the {role} asks for {_short(wants, nodes)}"


def unplaced(config: ServiceConfig, nodes: list[Resources]) -> list[str]:
    """What keeps a replica's actors off a cluster whose alive nodes have these total resources: one line per role at
    fault, naming the role and the resource, or the strategy that no set of nodes satisfies; [] when one replica's
    actors can be placed (free resources may be fewer: other replicas and applications use some)."""
    bundles = config.bundles()
    loose = [role for role in ROLES if role not in bundles and (role != "draft" or config.draft is not None)]
    problems = [_missing(role, config.resources(role), nodes) for role in loose
                if not any(_fits(config.resources(role), n) for n in nodes)]
    problems += [_missing(role, wants, nodes) for role, wants in bundles.items()
                 if not any(_fits(wants, n) for n in nodes)]
    if problems or not bundles:
        return problems
    if _assign(list(bundles.values()), nodes, config.placement_strategy or "PACK") is None:
        roles = " and ".join(bundles)
        if config.placement_strategy == "STRICT_PACK":
            total: Resources = {}
            for wants in bundles.values():
                for k, v in wants.items():
                    total[k] = total.get(k, 0.0) + v
            return [f"placement_strategy STRICT_PACK puts the {roles} on one node: no node has "
                    f"{_short(total, nodes)}"]
        return [f"placement_strategy {config.placement_strategy} puts the {roles} on "
                f"{'different nodes' if config.placement_strategy == 'STRICT_SPREAD' else 'nodes'}, and no "
                f"{len(bundles)} nodes of the cluster hold them: "
                + "; ".join(f"the {role} ({_resources(wants)}) fits only on node(s) "
                            f"{', '.join(str(i) for i, n in enumerate(nodes) if _fits(wants, n)) or 'none'}"
                            for role, wants in bundles.items())]
    return []


def _assign(bundles: list[Resources], nodes: list[Resources], strategy: str) -> tuple[int, ...] | None:
    """A node index per bundle that holds them all under `strategy` (STRICT_SPREAD: all different; STRICT_PACK: all
    one), or None. A brute-force search: a replica has at most three bundles."""
    for choice in product(range(len(nodes)), repeat=len(bundles)):
        if strategy == "STRICT_SPREAD" and len(set(choice)) < len(choice):
            continue
        if strategy == "STRICT_PACK" and len(set(choice)) > 1:
            continue
        left = [dict(n) for n in nodes]
        ok = True
        for i, wants in zip(choice, bundles, strict=True):
            if not _fits(wants, left[i]):
                ok = False
                break
            for k, v in wants.items():
                left[i][k] = left[i].get(k, 0.0) - v
        if ok:
            return choice
    return None


def cluster_nodes(address: str) -> list[Resources]:
    """The total resources of each alive node of the Ray cluster at `address`: a dashboard URL (http://HOST:8265,
    what `serve deploy -a` takes) through Ray's state API, else a GCS address (HOST:6379, auto) as a short-lived
    driver. ConfigError when it cannot be reached."""
    try:
        if address.startswith(("http://", "https://")):
            from ray.util.state import list_nodes

            return [dict(n.resources_total) for n in list_nodes(address=address, filters=[("state", "=", "ALIVE")],
                                                                  raise_on_missing_output=False, timeout=30)]
        import ray

        ray.init(address=address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
        try:
            return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
        finally:
            ray.shutdown()
    except Exception as e:  # noqa: BLE001 - any failure to reach the cluster is one line for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot reach the Ray cluster at {address}: {first}") from None
