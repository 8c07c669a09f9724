"""Where the actors run: the draft host, the target host and the controller, each with its own resources.

The actors are owned by the process that creates them (the ingress replica): they live and die with it, so a
replica restart or an app deletion never leaves models behind. Each is created with max_restarts =
`actor_max_restarts` (and no task retries): Ray restarts a host that dies (it loads its model again), and the
engine rebuilds the host's state from the committed tokens (dsde_core.recovery). A host that has used up its
restarts stays dead; the replica's health check then fails and Serve replaces the replica with fresh actors.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from dsde_core.errors import ModelLoadError
from services.actors import DraftHost, ModelInfo, TargetHost
from services.config import PolicyConfig, ServiceConfig
from services.controller import Controller


@dataclass
class Actors:
    target: Any
    draft: Any | None
    controller: Any
    target_info: ModelInfo
    draft_info: ModelInfo | None
    names: dict[str, str] = field(default_factory=dict)  # role -> actor name (ray.get_actor(name, namespace))
    namespace: str = ""

    def all(self) -> list[Any]:
        return [a for a in (self.target, self.draft, self.controller) if a is not None]

    def named(self) -> dict[str, Any]:
        return {name: actor for name, actor in (("target", self.target), ("draft", self.draft),
                                                ("controller", self.controller)) if actor is not None}

    def kill(self) -> None:
        for actor in self.all():
            ray.kill(actor, no_restart=True)


def _resources(num_cpus: float, num_gpus: float, max_restarts: int, name: str,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    # no task retries: a call in flight when its actor dies fails, and the engine decides what to redo. Named (unique
    # per replica) so an operator, or a test, can find the actors: /admin/state lists the names.
    opts = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": max_restarts, "max_task_retries": 0,
            "name": name}
    if env:
        opts["runtime_env"] = {"env_vars": env}
    return opts


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
                  max_seq_len=cfg.max_seq_len, num_threads=cfg.num_threads)
    restarts, tag, env = cfg.actor_max_restarts, uuid.uuid4().hex[:8], model_env(cfg)
    names = {role: f"dsde-{role}-{tag}" for role in ("target", "draft", "controller")}
    target_host, draft_host = hosts
    target = ray.remote(target_host).options(
        **_resources(cfg.target_num_cpus, cfg.target_num_gpus, restarts, names["target"], env)).remote(
        cfg.target, **common)
    draft = None
    if cfg.draft is not None:
        draft = ray.remote(draft_host).options(
            **_resources(cfg.draft_num_cpus, cfg.draft_num_gpus, restarts, names["draft"], env)).remote(
            cfg.draft, top_k=cfg.draft_top_k, quant=cfg.draft_quant, window=cfg.draft_window, **common)
    else:
        del names["draft"]
    controller = ray.remote(Controller).options(
        **_resources(cfg.controller_num_cpus, 0, restarts, names["controller"])).remote(policy)
    try:
        target_info = _describe(target, "target", cfg.target)
        draft_info = _describe(draft, "draft", cfg.draft) if draft is not None else None
        ray.get(controller.ping.remote())
    except BaseException:
        for actor in (target, draft, controller):
            if actor is not None:
                ray.kill(actor, no_restart=True)
        raise
    return Actors(target, draft, controller, target_info, draft_info, names, ray.get_runtime_context().namespace)


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
