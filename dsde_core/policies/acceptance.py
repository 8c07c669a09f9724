"""Acceptance-rate threshold (the per-sequence DynamicProposer proposed to vLLM, pull request 26495).

Per sequence, after every step that proposed something:
    a_bar = mean of the last `window` (10) step acceptance rates accepted/proposed (fewer while filling)
    k <- k + 1  if a_bar > threshold + band
    k <- k - 1  if a_bar < threshold - band      (band = 0.05: a dead band against oscillation)
    k in [min_k, max_k] = [2, 10]

Defaults: threshold 0.7 and initial k 5. The threshold sets where k settles (higher -> shorter drafts).
Where a draft token costs ~0.4 of a target step (the default pair on a CPU), the tokens-per-cost optimum at
per-token acceptance 0.8-0.9 is k = 2-4, where the step acceptance rate is ~0.7-0.8; 0.7 aims there. k starts
at 5 like DSDE's warm-up and the heuristic schedule.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dsde_core.errors import ConfigError
from dsde_core.policies.base import PerRequestPolicy, Plan, SeqInfo, StepFeedback

DEFAULT_ACCEPTANCE_THRESHOLD = 0.7


@dataclass(frozen=True)
class AcceptanceRateConfig:
    threshold: float = DEFAULT_ACCEPTANCE_THRESHOLD
    initial_k: int = 5
    window: int = 10
    band: float = 0.05
    min_k: int = 2
    max_k: int = 10

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"acceptance: threshold must be in [0, 1], got {self.threshold}")
        if not 0 <= self.min_k <= self.initial_k <= self.max_k:
            raise ConfigError(
                f"acceptance: need 0 <= min_k <= initial_k <= max_k, "
                f"got {self.min_k}, {self.initial_k}, {self.max_k}"
            )
        if self.window < 1:
            raise ConfigError(f"acceptance: window must be >= 1, got {self.window}")
        if self.band < 0:
            raise ConfigError(f"acceptance: band must be >= 0, got {self.band}")


@dataclass
class _State:
    k: int
    rates: deque[float] = field(default_factory=deque)


class AcceptanceRatePolicy(PerRequestPolicy[_State]):
    name = "acceptance"
    bound_field = "max_k"

    def __init__(self, config: AcceptanceRateConfig | None = None) -> None:
        super().__init__()
        self.config = config or AcceptanceRateConfig()

    def _new_state(self, seq: SeqInfo) -> _State:
        return _State(k=self.config.initial_k, rates=deque(maxlen=self.config.window))

    def _propose(self, state: _State, seq: SeqInfo) -> Plan:
        return Plan(k=state.k)

    def _update(self, state: _State, fb: StepFeedback) -> None:
        rate = fb.acceptance
        if rate is None:  # nothing proposed: no evidence
            return
        cfg = self.config
        state.rates.append(rate)
        mean = sum(state.rates) / len(state.rates)
        if mean > cfg.threshold + cfg.band:
            state.k = min(state.k + 1, cfg.max_k)
        elif mean < cfg.threshold - cfg.band:
            state.k = max(state.k - 1, cfg.min_k)

    def _stats(self, state: _State) -> dict[str, float]:
        out = {"k": float(state.k)}
        if state.rates:
            out["acceptance_mean"] = sum(state.rates) / len(state.rates)
        return out
