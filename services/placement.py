"""Where the actors run: the draft host, the target host and the controller, each with its own resources.

The actors are owned by the process that creates them (the ingress replica): they live and die with it, so a
replica restart or an app deletion never leaves models behind. Each is created with max_restarts =
`actor_max_restarts` (and no task retries): Ray restarts a host that dies (it loads its model again), and the
engine rebuilds the host's state from the committed tokens (dsde_core.recovery). A host that has used up its
restarts stays dead; the replica's health check then fails and Serve replaces the replica with fresh actors.

Each actor asks for its CPUs, GPUs and custom resources (`{role}_resources`: only a node that advertises them hosts
it). With `placement_strategy` the replica first reserves one placement group over them, a bundle per actor
(ServiceConfig.bundles), with that strategy (STRICT_SPREAD: draft and target on different nodes; STRICT_PACK: one
node), waits for it (placement_timeout_s) and starts each actor in its bundle. The group is the replica's: created by
it, removed with its actors, and removed by Ray when the replica's process dies. A bundle on a node that dies is
rescheduled by Ray on a node that has room; its actor restarts there (docs/scaling.md).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dsde_core.errors import DSDEError, ModelLoadError
from services.actors import DraftHost, ModelInfo, TargetHost
from services.config import PolicyConfig, ServiceConfig
from services.controller import Controller


class PlacementTimeout(DSDEError):
    """The replica's placement group was not placed within placement_timeout_s: no set of nodes has the resources."""


@dataclass
class Actors:
    target: Any
    draft: Any | None
    controller: Any
    target_info: ModelInfo
    draft_info: ModelInfo | None
    names: dict[str, str] = field(default_factory=dict)  # role -> actor name (ray.get_actor(name, namespace))
    namespace: str = ""
    group: PlacementGroup | None = None  # the replica's placement group (placement_strategy), or None
    strategy: str | None = None  # the group's
    bundle_index: dict[str, int] = field(default_factory=dict)  # role -> its bundle in `group`

    def all(self) -> list[Any]:
        return [a for a in (self.target, self.draft, self.controller) if a is not None]

    def named(self) -> dict[str, Any]:
        return {name: actor for name, actor in (("target", self.target), ("draft", self.draft),
                                                ("controller", self.controller)) if actor is not None}

    def kill(self) -> None:
        for actor in self.all():
            ray.kill(actor, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)

    def placement(self) -> dict[str, Any] | None:
        """The placement group's id, strategy and each role's bundle index (/admin/state); None without one."""
        if self.group is None:
            return None
        return {"group_id": self.group.id.hex(), "strategy": self.strategy, "bundles": dict(self.bundle_index)}


def _options(cfg: ServiceConfig, role: str, name: str, group: PlacementGroup | None, bundles: dict[str, int],
             env: dict[str, str] | None = None) -> dict[str, Any]:
    # no task retries: a call in flight when its actor dies fails, and the engine decides what to redo. Named (unique
    # per replica) so an operator, or a test, can find the actors: /admin/state lists the names.
    opts: dict[str, Any] = {"num_cpus": getattr(cfg, f"{role}_num_cpus"), "max_restarts": cfg.actor_max_restarts,
                            "max_task_retries": 0, "name": name}
    if role != "controller":
        opts["num_gpus"] = getattr(cfg, f"{role}_num_gpus")
    if custom := getattr(cfg, f"{role}_resources"):
        opts["resources"] = dict(custom)
    if env:
        opts["runtime_env"] = {"env_vars": env}
    if group is not None and role in bundles:  # its bundle holds exactly what it asks for (ServiceConfig.bundles)
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundles[role], placement_group_capture_child_tasks=False)
    return opts


def reserve(cfg: ServiceConfig, tag: str) -> tuple[PlacementGroup | None, dict[str, int]]:
    """The replica's placement group, placed (None without placement_strategy), and each role's bundle index. Waits
    placement_timeout_s for it (an autoscaler may be adding nodes); then removes it and raises PlacementTimeout."""
    wanted = cfg.bundles()
    if not wanted:
        return None, {}
    group = placement_group(list(wanted.values()), strategy=cfg.placement_strategy, name=f"dsde-{tag}")
    try:
        ray.get(group.ready(), timeout=cfg.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        asked = "; ".join(f"{role} {bundle}" for role, bundle in wanted.items())
        raise PlacementTimeout(f"the replica's placement group ({cfg.placement_strategy}: {asked}) was not placed "
                               f"within {cfg.placement_timeout_s:g}s (placement_timeout_s): no node set of the "
                               f"cluster has these resources free (dsde check-config --address checks a config "
                               f"against a cluster)") from None
    except BaseException:
        remove_placement_group(group)
        raise
    return group, {role: i for i, role in enumerate(wanted)}


def model_env(cfg: ServiceConfig) -> dict[str, str]:
    """Environment of the model hosts: the bound on oneDNN's primitive caches (read when the process starts)."""
    if cfg.onednn_cache_capacity is None:
        return {}
    cap = str(cfg.onednn_cache_capacity)
    return {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": cap, "LRU_CACHE_CAPACITY": cap}


def start_actors(cfg: ServiceConfig, policy: PolicyConfig,
                 hosts: tuple[type[TargetHost], type[DraftHost]] = (TargetHost, DraftHost)) -> Actors:
    """Create the three actors and wait until both models are loaded; ModelLoadError names what failed. `hosts`: the
    target and draft host classes (a benchmark passes subclasses that time their calls)."""
    common = dict(dtype=cfg.dtype, device=cfg.device, max_batch_size=cfg.max_batch_size,
                  max_seq_len=cfg.max_seq_len, num_threads=cfg.num_threads, step=cfg.step, max_query=cfg.max_sl + 1)
    tag, env = uuid.uuid4().hex[:8], model_env(cfg)
    names = {role: f"dsde-{role}-{tag}" for role in ("target", "draft", "controller")}
    target_host, draft_host = hosts
    group, bundles = reserve(cfg, tag)
    target = draft = controller = None
    try:
        target = ray.remote(target_host).options(
            **_options(cfg, "target", names["target"], group, bundles, env)).remote(
            cfg.target, backend=cfg.backend, **common)
        if cfg.draft is not None:
            draft = ray.remote(draft_host).options(
                **_options(cfg, "draft", names["draft"], group, bundles, env)).remote(
                cfg.draft, top_k=cfg.draft_top_k, quant=cfg.draft_quant, window=cfg.draft_window,
                backend=cfg.draft_backend or cfg.backend, **common)
        else:
            del names["draft"]
        controller = ray.remote(Controller).options(
            **_options(cfg, "controller", names["controller"], group, bundles)).remote(policy)
        target_info = _describe(target, "target", cfg.target)
        draft_info = _describe(draft, "draft", cfg.draft) if draft is not None else None
        ray.get(controller.ping.remote())
    except BaseException:
        for actor in (target, draft, controller):
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if group is not None:
            remove_placement_group(group)
        raise
    return Actors(target, draft, controller, target_info, draft_info, names, ray.get_runtime_context().namespace,
                  group, cfg.placement_strategy if group is not None else None, bundles)


def _describe(actor: Any, role: str, source: str) -> ModelInfo:
    try:
        return ray.get(actor.describe.remote())
    except ray.exceptions.RayActorError as e:
        raise ModelLoadError(f"the {role} actor could not load {source!r}: {_cause(e)}") from None


def _cause(e: Exception) -> str:
    """The innermost error message of an actor that died in its constructor."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception): ", line):
            return strip_exception_type(line)
    return lines[-1] if lines else type(e).__name__


def strip_exception_type(line: str) -> str:
    """'pkg.mod.SomeError: message' -> 'message' (a traceback's last line, for a user-facing error)."""
    return re.sub(r"^[\w.]+(Error|Exception): ", "", line.strip())
