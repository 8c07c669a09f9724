"""AdaEDL: entropy-based early draft stopping with an adaptive threshold lambda, per sequence.

The draft proposes up to `max_k` tokens and stops after token t when its confidence lower bound
    conf_t = 1 - sqrt(gamma * H(q_t))          (gamma = 0.1, H in nats)
falls below lambda (Plan.min_confidence). A higher lambda stops earlier: shorter drafts, higher
acceptance. After each step, with a = accepted / proposed:
    lambda' = lambda + step  if a < target (0.9)     (too many rejections: draft less)
    lambda' = lambda - step  otherwise               (draft more)
    lambda <- 0.9 * lambda + 0.1 * lambda'           (i.e. lambda moves by 0.1 * step = 0.001)
clamped to [0, 1]; lambda_0 = 0.5. Stopping is per sequence (the authors' code stopped the whole batch
when any row triggered). `draft_confidence` is the stopping statistic the draft side evaluates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsde_core.errors import ConfigError
from dsde_core.policies.base import PerRequestPolicy, Plan, SeqInfo, StepFeedback
from dsde_core.signals import entropy

ADAEDL_GAMMA = 0.1


def draft_confidence(probs: Tensor, gamma: float = ADAEDL_GAMMA) -> Tensor:
    """1 - sqrt(gamma * H(q)) over the last dim: AdaEDL's lower bound on the acceptance probability."""
    return 1.0 - torch.sqrt(gamma * entropy(probs).clamp_min(0.0))


def entropy_confidence(h: float, gamma: float = ADAEDL_GAMMA) -> float:
    """The same statistic from an entropy the draft already computed: 1 - sqrt(gamma * H)."""
    return 1.0 - (gamma * max(h, 0.0)) ** 0.5


def should_stop(confidence: float, min_confidence: float | None) -> bool:
    """The draft stops after this token when its confidence is below the plan's min_confidence."""
    return min_confidence is not None and confidence < min_confidence


@dataclass(frozen=True)
class AdaEDLConfig:
    max_k: int = 10
    lambda_0: float = 0.5
    target_acceptance: float = 0.9
    step: float = 0.01
    smoothing: float = 0.9
    """lambda <- smoothing * lambda + (1 - smoothing) * lambda'."""

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ConfigError(f"adaedl: max_k must be >= 1, got {self.max_k}")
        if not 0.0 <= self.lambda_0 <= 1.0:
            raise ConfigError(f"adaedl: lambda_0 must be in [0, 1], got {self.lambda_0}")
        if not 0.0 <= self.target_acceptance <= 1.0:
            raise ConfigError(f"adaedl: target_acceptance must be in [0, 1], got {self.target_acceptance}")
        if self.step < 0:
            raise ConfigError(f"adaedl: step must be >= 0, got {self.step}")
        if not 0.0 <= self.smoothing <= 1.0:
            raise ConfigError(f"adaedl: smoothing must be in [0, 1], got {self.smoothing}")


@dataclass
class _State:
    lam: float
    last_acceptance: float | None = None


class AdaEDLPolicy(PerRequestPolicy[_State]):
    name = "adaedl"
    bound_field = "max_k"

    def __init__(self, config: AdaEDLConfig | None = None) -> None:
        super().__init__()
        self.config = config or AdaEDLConfig()

    def _new_state(self, seq: SeqInfo) -> _State:
        return _State(lam=self.config.lambda_0)

    def _propose(self, state: _State, seq: SeqInfo) -> Plan:
        return Plan(k=self.config.max_k, min_confidence=state.lam)

    def _update(self, state: _State, fb: StepFeedback) -> None:
        a = fb.acceptance
        if a is None:
            return
        cfg = self.config
        state.last_acceptance = a
        # Below target: raise lambda (stop earlier); at or above: lower it (draft further).
        lam_prime = state.lam + cfg.step if a < cfg.target_acceptance else state.lam - cfg.step
        lam = cfg.smoothing * state.lam + (1.0 - cfg.smoothing) * lam_prime
        state.lam = min(1.0, max(0.0, lam))

    def _stats(self, state: _State) -> dict[str, float]:
        out = {"lambda": state.lam}
        if state.last_acceptance is not None:
            out["acceptance"] = state.last_acceptance
        return out
