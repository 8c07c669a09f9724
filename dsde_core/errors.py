"""Errors that users of dsde_core see. Each names the problem and, where there is one, the fix."""


class DSDEError(Exception):
    """Base class of every error dsde_core raises on purpose."""


class ConfigError(DSDEError, ValueError):
    """A configuration or request parameter is out of range. `field`: the parameter or input at fault, where one is
    (a config or SamplingParams field; from Engine.validate "prompt", "logit_bias", "stop_token_ids" or the caller's
    name for max_tokens), for a server to name it."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ModelLoadError(DSDEError):
    """A model could not be loaded."""


class MissingPartError(ModelLoadError):
    """A part package of an embedded model is not installed."""


class HashMismatchError(ModelLoadError):
    """The joined file of an embedded model does not have the expected sha256."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one the runner implements."""


class VocabularyMismatchError(ModelLoadError):
    """Draft and target do not share a vocabulary."""


class WorkerUnavailable(DSDEError):
    """A worker (the draft, the target) or the policy host could not be reached: it died, is restarting, or came
    back without its state. The engine recovers instead of failing requests: without the draft it decodes
    target-only, without the target it waits (up to EngineConfig.worker_wait_s) and re-prefills, without the
    policy it plans k = 0; once the worker answers again, its per-request state is rebuilt from the committed
    tokens (dsde_core.recovery.RecoveryGuard)."""

    def __init__(self, role: str, message: str) -> None:
        super().__init__(f"the {role} is unavailable: {message}")
        self.role = role

    def __reduce__(self) -> tuple:  # picklable across processes with its two arguments
        return (type(self), (self.role, str(self).removeprefix(f"the {self.role} is unavailable: ")))


class WorkerStateLost(WorkerUnavailable):
    """The worker answered but holds no state for a slot the engine opened on it: it was restarted."""
