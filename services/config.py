"""The service's two configurations, validated at construction (ConfigError names the field and the range).

ServiceConfig: what the app is built with (the `args` of `serve deploy` / `build_app`): the models, the engine's
shape and where each actor runs (its resources, and optionally one placement group per replica over them:
docs/scaling.md). Changing it means new actors, i.e. reloading the models.

PolicyConfig: the deployment's `user_config`, applied live by `reconfigure()` without touching the models: the
policy spec and its parameters, the cap switch, a global ceiling on the speculation length.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from dsde_core.config import DTYPES, EngineConfig, is_device
from dsde_core.errors import ConfigError
from dsde_core.models.loader import DEFAULT_DRAFT, DEFAULT_TARGET
from dsde_core.policies import DEFAULT_POLICY, above_ceiling, ceiling_note, make_policy

ROLES = ("target", "draft", "controller")  # the actors a replica starts, in the order of its placement group's bundles
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement group strategies
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")  # set by *_num_cpus / *_num_gpus, not *_resources


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _from_dict(cls: type, data: dict[str, Any] | None, what: str) -> Any:
    """cls(**data), with a clear error for unknown keys and for a value of the wrong shape."""
    data = dict(data or {})
    types = {f.name: str(f.type) for f in fields(cls) if f.init}
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ConfigError(f"{what}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(types)}")
    try:
        return cls(**{name: _scalar(name, types[name], value, what) for name, value in data.items()})
    except TypeError as e:
        raise ConfigError(f"{what}: {e}") from None


def _scalar(name: str, annotation: str, value: Any, what: str) -> Any:
    """A string given to a field that takes none is read as YAML reads a scalar ('4', '0.5', 'true', 'null',
    '{c: 0.5}'): `serve run services.app:build_app max_batch_size=4` passes every argument as a string."""
    takes_str = re.search(r"\b(str|Any)\b", annotation.split("[")[0]) is not None
    if not isinstance(value, str) or takes_str:
        return value
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        parsed = value
    if isinstance(parsed, bool) and value.strip().lower() not in ("true", "false"):
        parsed = value  # YAML 1.1's yes/no/on/off: true and false only, as JSON and YAML 1.2
    if isinstance(parsed, str):
        raise ConfigError(f"{what}: {name} takes {annotation.replace(' | None', ' or null')}, got {value!r}")
    return parsed


@dataclass(frozen=True)
class ServiceConfig:
    """The app's build arguments. Resources are Ray logical resources per actor; 0 GPUs by default."""

    draft: str | None = DEFAULT_DRAFT  # None (or "none"): target-only serving
    target: str = DEFAULT_TARGET
    model_name: str | None = None  # the `model` clients send; default: the target's name
    dtype: str = "bfloat16"
    device: str = "auto"  # auto: cuda when the actor was given a GPU, else cpu
    backend: str = "auto"  # the models' runner: torch, llama.cpp, or auto (dsde_core.models.backends)
    draft_backend: str | None = None  # the draft's, where it differs from backend
    step: str = "eager"  # the torch runner's step: eager, or static (bucketed; CUDA graphs on a GPU): EngineConfig.step
    max_batch_size: int = 8
    max_seq_len: int = 2048
    max_sl: int = 20
    draft_top_k: int = 64
    draft_quant: str = "auto"  # the draft's weights: int8, none, or auto (int8 for bf16 on a CPU), as in-process
    draft_window: int | None = None  # the draft takes in only a prompt's last N tokens (EngineConfig); None: off
    prefill_chunk: int | None = 4096  # the most prompt tokens each model's prefills take in a step; None: no limit
    policy: str = DEFAULT_POLICY  # the initial policy; a user_config replaces it live
    num_threads: int | None = None  # torch and llama.cpp threads in each model actor; None: the machine's cores
    draft_num_cpus: float = 1.0
    draft_num_gpus: float = 0.0
    target_num_cpus: float = 1.0
    target_num_gpus: float = 0.0
    controller_num_cpus: float = 0.0
    # placement across nodes (docs/scaling.md): Ray custom resources each actor asks for besides its CPUs and GPUs
    # (e.g. {dsde_draft: 1}: only a node that advertises dsde_draft hosts the draft), and a placement strategy that
    # puts the replica's actors in one placement group (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD; null: no group, each
    # actor is placed by its own resources). The replica owns the group: it is removed with the replica
    draft_resources: dict[str, float] = field(default_factory=dict)
    target_resources: dict[str, float] = field(default_factory=dict)
    controller_resources: dict[str, float] = field(default_factory=dict)
    placement_strategy: str | None = None
    placement_timeout_s: float = 600.0  # a replica waits this long for its placement group (new nodes), then fails
    # failure behaviour and load (docs/failures.md)
    actor_max_restarts: int = 3  # Ray restarts a dead draft, target or controller actor this many times (-1: no limit)
    worker_wait_s: float = 60.0  # requests wait this long for a failed target to come back, then end with a 503
    max_queue: int = 64  # requests that may wait for a KV slot beyond the max_batch_size running ones; more get 429
    retry_after_s: int = 1  # the Retry-After header of a 429 or 503
    admit_wait_s: float = 0.02  # an idle engine waits this long after a first arrival, so that a burst starts together
    request_timeout_s: float | None = 600.0  # a request unfinished this long after arriving gets a 504 (None: never)
    graceful_shutdown_timeout_s: float = 30.0  # on shutdown or redeploy, running requests get this long to finish
    max_request_bytes: int = 1 << 20  # request bodies larger than this get 413
    api_key: str | None = field(default=None, repr=False)  # Bearer token on every endpoint but /health ($DSDE_API_KEY)
    # oneDNN's primitive caches in the model actors (entries; null: oneDNN's default, 1024). Each new input shape
    # (prefills vary) adds an entry with its buffers: at the default a host's memory grows for a long time before it
    # levels off (benchmarks/soak.py); 256 keeps it bounded at a small cost per step
    onednn_cache_capacity: int | None = 256

    def __post_init__(self) -> None:
        draft = self.draft
        if isinstance(draft, str) and draft.strip().lower() in ("", "none"):
            object.__setattr__(self, "draft", None)
        _check(isinstance(self.target, str) and bool(self.target),
               f"target must be a model source, got {self.target!r}")
        _check(self.model_name is None or (isinstance(self.model_name, str) and bool(self.model_name.strip())),
               f"model_name must be a non-empty string, got {self.model_name!r}")
        _check(self.device == "auto" or is_device(self.device),
               f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("draft_num_cpus", "draft_num_gpus", "target_num_cpus", "target_num_gpus", "controller_num_cpus"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and 0 <= value <= 1024,
                   f"{name} must be in [0, 1024], got {value!r}")
        self._check_placement()
        if self.device.startswith("cuda"):
            for role in ["target"] + ["draft"] * (self.draft is not None):
                _check(getattr(self, f"{role}_num_gpus") > 0,
                       f"device {self.device!r} needs {role}_num_gpus > 0 (dsde serve: --num-gpus): Ray shows a "
                       f"GPU only to an actor that asks for one")
        _check(isinstance(self.actor_max_restarts, int) and -1 <= self.actor_max_restarts <= 1000,
               f"actor_max_restarts must be an integer in [-1, 1000], got {self.actor_max_restarts!r}")
        _check(isinstance(self.max_queue, int) and 0 <= self.max_queue <= 1 << 20,
               f"max_queue must be an integer in [0, 2^20], got {self.max_queue!r}")
        _check(isinstance(self.admit_wait_s, (int, float)) and 0 <= self.admit_wait_s <= 1,
               f"admit_wait_s must be a number of seconds in [0, 1], got {self.admit_wait_s!r}")
        _check(isinstance(self.retry_after_s, int) and 0 <= self.retry_after_s <= 3600,
               f"retry_after_s must be an integer in [0, 3600], got {self.retry_after_s!r}")
        _check(self.request_timeout_s is None or (isinstance(self.request_timeout_s, (int, float))
                                                  and 0 < self.request_timeout_s <= 86400),
               f"request_timeout_s must be in (0, 86400] or null, got {self.request_timeout_s!r}")
        _check(isinstance(self.graceful_shutdown_timeout_s, (int, float)) and 0 <= self.graceful_shutdown_timeout_s
               <= 3600, f"graceful_shutdown_timeout_s must be in [0, 3600], got {self.graceful_shutdown_timeout_s!r}")
        _check(isinstance(self.max_request_bytes, int) and 1024 <= self.max_request_bytes <= 1 << 30,
               f"max_request_bytes must be an integer in [1024, 2^30], got {self.max_request_bytes!r}")
        _check(self.api_key is None or isinstance(self.api_key, str), "api_key must be a string")
        _check(self.onednn_cache_capacity is None or (isinstance(self.onednn_cache_capacity, int)
                                                      and 0 <= self.onednn_cache_capacity <= 1 << 16),
               f"onednn_cache_capacity must be an integer in [0, 65536] or null, got {self.onednn_cache_capacity!r}")
        if not self.api_key:
            object.__setattr__(self, "api_key", None)
        make_policy(self.policy)  # a bad spec fails at build time, not in the controller
        self.engine_config()  # the engine's own checks (batch, lengths, dtype, threads)

    def _check_placement(self) -> None:
        for role in ROLES:
            name = f"{role}_resources"
            value = {} if getattr(self, name) is None else getattr(self, name)  # null: none
            _check(isinstance(value, dict), f"{name} must be a mapping of Ray custom resources to amounts, "
                                            f"got {value!r}")
            for key, amount in value.items():
                _check(isinstance(key, str) and re.fullmatch(r"[\w.:/-]+", key) is not None,
                       f"{name}: a resource name is a non-empty string without spaces, got {key!r}")
                _check(key not in RAY_RESOURCES, f"{name}: {key!r} is not a custom resource (set {role}_num_cpus / "
                                                 f"{role}_num_gpus for CPUs and GPUs)")
                _check(isinstance(amount, (int, float)) and not isinstance(amount, bool) and 0 < amount <= 1e6,
                       f"{name}: {key} must be an amount in (0, 1e6], got {amount!r}")
            object.__setattr__(self, name, {k: float(v) for k, v in value.items()})
        strategy = self.placement_strategy
        if isinstance(strategy, str) and strategy.strip().lower() in ("", "none"):
            strategy = None
        _check(strategy is None or (isinstance(strategy, str) and strategy.strip().upper() in PLACEMENT_STRATEGIES),
               f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)} or null, got {strategy!r}")
        object.__setattr__(self, "placement_strategy", strategy and strategy.strip().upper())
        _check(isinstance(self.placement_timeout_s, (int, float)) and 0 < self.placement_timeout_s <= 86400,
               f"placement_timeout_s must be in (0, 86400], got {self.placement_timeout_s!r}")
        if self.placement_strategy is not None:
            for role in self.model_roles():
                _check(bool(self.resources(role)),
                       f"placement_strategy {self.placement_strategy} gives the {role} a bundle of the replica's "
                       f"placement group, but it asks for no resource ({role}_num_cpus 0, {role}_num_gpus 0, no "
                       f"{role}_resources): give it some")

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> ServiceConfig:
        return _from_dict(cls, args, "app args")

    def model_roles(self) -> tuple[str, ...]:
        """The model hosts this config starts: the target, and the draft unless it serves target-only."""
        return ("target",) if self.draft is None else ("target", "draft")

    def resources(self, role: str) -> dict[str, float]:
        """What the `role` actor asks Ray for by Ray's resource names (CPU, GPU, custom ones); no zero amounts."""
        gpus = 0.0 if role == "controller" else getattr(self, f"{role}_num_gpus")
        wants = {"CPU": getattr(self, f"{role}_num_cpus"), "GPU": gpus, **getattr(self, f"{role}_resources")}
        return {name: float(amount) for name, amount in wants.items() if amount}

    def bundles(self) -> dict[str, dict[str, float]]:
        """role -> its bundle in the replica's placement group, in bundle order (empty without placement_strategy).
        The draft and the target always have one; the controller only when it asks for a resource (a bundle cannot
        be empty): otherwise it is placed outside the group, as an actor that needs nothing."""
        if self.placement_strategy is None:
            return {}
        roles = [*self.model_roles(), *(["controller"] if self.resources("controller") else [])]
        return {role: self.resources(role) for role in ROLES if role in roles}

    @property
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        return os.path.basename(os.path.normpath(self.target)) or self.target

    @property
    def max_ongoing_requests(self) -> int:
        """Serve's max_ongoing_requests for a replica (services.app): every request the engine may hold
        (max_batch_size + max_queue; it answers more with 429 itself, quickly) plus headroom."""
        return self.max_batch_size + self.max_queue + 64

    def engine_config(self) -> EngineConfig:
        return EngineConfig(max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len, max_sl=self.max_sl,
                            draft_top_k=self.draft_top_k, dtype=self.dtype, draft_quant=self.draft_quant,
                            draft_window=self.draft_window, prefill_chunk=self.prefill_chunk,
                            device="cpu" if self.device == "auto" else self.device, num_threads=self.num_threads,
                            backend=self.backend, draft_backend=self.draft_backend, step=self.step,
                            worker_wait_s=self.worker_wait_s)

    @property
    def torch_dtype(self) -> Any:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class PolicyConfig:
    """The live part (`user_config`). Requests that arrive after a change use the new policy.

    policy: a spec for dsde_core.policies.make_policy ("dsde", "static:4", "off", ...).
    params: fields of that policy's config dataclass, e.g. {"c": 0.3, "min_spec": 3} for dsde, {"k": 3} for static.
    cap:    None keeps the spec's choice ("dsde" is capped, "dsde-nocap" is not); True/False forces the cap on/off.
    max_sl: ceiling on every request's speculation length (None: only the engine's max_sl).
    """

    policy: str = DEFAULT_POLICY
    params: dict[str, Any] = field(default_factory=dict)
    cap: bool | None = None
    max_sl: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.policy, str), f"user_config policy must be a string, got {self.policy!r}")
        _check(isinstance(self.params, dict), f"user_config params must be a mapping, got {self.params!r}")
        _check(self.cap is None or isinstance(self.cap, bool),
               f"user_config cap must be true or false, got {self.cap!r}")
        _check(self.max_sl is None or (isinstance(self.max_sl, int) and not isinstance(self.max_sl, bool)
                                       and 0 <= self.max_sl <= 64),
               f"user_config max_sl must be an integer in [0, 64], got {self.max_sl!r}")
        object.__setattr__(self, "params", dict(self.params))
        build_policy(self)  # validate now: a bad user_config fails the update, not a later request

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> PolicyConfig:
        return _from_dict(cls, data, "user_config")

    def ceiling_note(self, engine_max_sl: int) -> str | None:
        """A warning where this config asks for k above the engine's max_sl (the app arg), which lowers every such k
        without a word: its own max_sl, or (without one) its policy's bound (a static k, DSDE's MAX, params)."""
        if self.max_sl is None:
            return ceiling_note(build_policy(self), engine_max_sl)
        return above_ceiling(f"user_config max_sl {self.max_sl}", self.max_sl, engine_max_sl)

    def describe(self) -> str:
        text = self.policy.strip().lower()
        if self.params:
            text += "{" + ",".join(f"{k}={v}" for k, v in sorted(self.params.items())) + "}"
        if self.cap is not None:
            text += "+cap" if self.cap else "-cap"
        return text


def autoscaling_config(cfg: ServiceConfig, given: Any, max_ongoing_requests: int | None = None) -> dict[str, Any]:
    """Serve's autoscaling_config for this app: `given` (a mapping of Serve's AutoscalingConfig fields) checked by
    Serve's own model, with target_ongoing_requests defaulting to max_batch_size: a replica whose KV slots are all
    busy is at its target, and requests waiting for a slot push it over. ConfigError names the field at fault, and a
    target no replica can reach: a replica holds at most max_batch_size + max_queue requests (it answers more with
    429) and Serve sends it at most max_ongoing_requests."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig

    if isinstance(given, str):  # `serve run ... autoscaling_config='{max_replicas: 2}'`
        given = yaml.safe_load(given)
    if not isinstance(given, dict):
        raise ConfigError(f"autoscaling_config must be a mapping of Serve's AutoscalingConfig fields (min_replicas, "
                          f"max_replicas, target_ongoing_requests, ...), got {given!r}", "autoscaling_config")
    unknown = sorted(set(given) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ConfigError(f"autoscaling_config: unknown key(s) {', '.join(map(str, unknown))}; valid: "
                          f"{', '.join(AutoscalingConfig.model_fields)}", "autoscaling_config")
    config = {"target_ongoing_requests": cfg.max_batch_size, **given}
    try:
        AutoscalingConfig(**config)
    except ValidationError as e:
        problems = "; ".join(": ".join(filter(None, (".".join(map(str, err["loc"])), err["msg"])))
                             for err in e.errors())
        raise ConfigError(f"autoscaling_config: {problems}", "autoscaling_config") from None
    target = config["target_ongoing_requests"]
    limits = {"max_batch_size + max_queue": cfg.max_batch_size + cfg.max_queue}
    if max_ongoing_requests is not None:
        limits["max_ongoing_requests"] = max_ongoing_requests
    for name, limit in limits.items():
        if target is not None and target > limit:
            raise ConfigError(f"autoscaling_config: target_ongoing_requests {target:g} is above {name} ({limit}): no "
                              f"replica ever holds that many requests, so Serve would never scale up",
                              "autoscaling_config")
    return config


def build_policy(cfg: PolicyConfig) -> Any:
    """A fresh SpeculationPolicy for `cfg`: make_policy(spec), its config fields overridden, the cap on or off."""
    from dsde_core.policies import CappedPolicy

    policy = make_policy(cfg.policy)
    capped = isinstance(policy, CappedPolicy)
    base = policy.inner if capped else policy
    if cfg.params:
        base_cfg = getattr(base, "config", None)
        if base_cfg is None or type(base).__name__ == "OffPolicy":
            raise ConfigError(f"user_config: policy {cfg.policy!r} takes no params, got {sorted(cfg.params)}")
        known = {f.name for f in fields(base_cfg)} - {"variant"}
        unknown = sorted(set(cfg.params) - known)
        if unknown:
            raise ConfigError(f"user_config: policy {cfg.policy!r} has no parameter(s) {', '.join(unknown)}; "
                              f"valid: {', '.join(sorted(known))}")
        base = type(base)(type(base_cfg)(**{**_spec_fields(base_cfg), **cfg.params}))
    want_cap = capped if cfg.cap is None else cfg.cap
    policy = CappedPolicy(base) if want_cap else base
    policy.name = cfg.describe()
    return policy


def _spec_fields(cfg: Any) -> dict[str, Any]:
    """The fields a spec set (static's k, acceptance's threshold, dsde's variant), not ones derived in
    __post_init__ (default None): params then start from the spec, and derived values are derived again."""
    out = {}
    for f in fields(cfg):
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is not None and getattr(cfg, f.name) != default:
            out[f.name] = getattr(cfg, f.name)
    return out
