"""`dsde check-config FILE`: a Serve config file checked as `serve deploy FILE` would meet it, in a second.

`serve deploy` checks Serve's own schema, and a DSDE application's `args` fail in build_app, quickly. A deployment's
`user_config` reaches our code only in the replica's reconfigure(), after the replica has loaded its models: a bad
policy there costs three replica starts (each loading the models) before the application shows DEPLOY_FAILED. This
check reads the file without a cluster and names the application and the field of the first problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dsde_core.errors import ConfigError
from services.config import PolicyConfig, ServiceConfig

IMPORT_PATH = "services.app:build_app"  # a DSDE Serve application; others are Serve's to check
DEPLOYMENT = "DSDEServer"  # the application's one deployment (services.ingress)


@dataclass(frozen=True)
class CheckedApp:
    name: str
    route_prefix: str | None
    config: ServiceConfig | None  # None: not a DSDE Serve application, left to Serve
    policy: PolicyConfig | None = None  # the user_config that applies (the deployment's over the args'); None: none

    def describe(self) -> str:
        if self.config is None:
            return f"application {self.name!r}: not DSDE Serve (not checked beyond Serve's schema)"
        cfg = self.config
        policy = self.policy.describe() if self.policy else cfg.policy
        return (f"application {self.name!r} at {self.route_prefix or '/'}: serves {cfg.served_name!r} "
                f"(target {cfg.target}, draft {cfg.draft or 'none'}, {cfg.dtype}, {cfg.max_batch_size} slots), "
                f"policy {policy}")

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
    try:
        config = ServiceConfig.from_args(args)
    except ConfigError as e:
        raise ConfigError(f"{where}: args: {e}") from None
    policy = _policy(f"{where}: args.user_config", app_user_config)
    for deployment in app.get("deployments") or []:
        if deployment.get("name") != DEPLOYMENT:
            raise ConfigError(f"{where}: deployments: no deployment named {deployment.get('name')!r} in the "
                              f"application (it has {DEPLOYMENT!r})")
        if "user_config" in deployment:  # the deployment's replaces the args' (Serve's override)
            policy = _policy(f"{where}: deployments[{DEPLOYMENT}].user_config", deployment["user_config"])
    return CheckedApp(name, app.get("route_prefix"), config, policy)


def _policy(where: str, user_config: Any) -> PolicyConfig | None:
    if user_config is None:
        return None
    if not isinstance(user_config, dict):
        raise ConfigError(f"{where}: a mapping (policy, params, cap, max_sl), got {user_config!r}")
    try:
        return PolicyConfig.from_dict(user_config)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
