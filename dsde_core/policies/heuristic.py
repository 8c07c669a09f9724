"""transformers' "heuristic" assistant-token schedule, per sequence.

    k <- k + 2          if every drafted token was accepted
    k <- max(1, k - 1)  otherwise

transformers (AssistedCandidateGenerator, num_assistant_tokens_schedule="heuristic") started from
num_assistant_tokens = 5 when it made this schedule the default; later releases default to 20 with the
"constant" schedule. We start at 5, the same k DSDE's warm-up starts from. transformers has no upper bound
(its max_new_tokens ends the growth); an engine needs one, so k is also limited to `max_k` (default 20,
DSDE's max_sl), and a step that proposed nothing (max_k = 0 from the engine) leaves k unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsde_core.errors import ConfigError
from dsde_core.policies.base import PerRequestPolicy, Plan, SeqInfo, StepFeedback


@dataclass(frozen=True)
class HeuristicConfig:
    initial_k: int = 5
    max_k: int = 20
    increase: int = 2
    decrease: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.initial_k <= self.max_k:
            raise ConfigError(f"heuristic: need 1 <= initial_k <= max_k, got {self.initial_k}, {self.max_k}")
        if self.increase < 0 or self.decrease < 0:
            raise ConfigError(f"heuristic: increase, decrease must be >= 0: {self.increase}, {self.decrease}")


@dataclass
class _State:
    k: int


class HeuristicPolicy(PerRequestPolicy[_State]):
    name = "heuristic"
    bound_field = "max_k"

    def __init__(self, config: HeuristicConfig | None = None) -> None:
        super().__init__()
        self.config = config or HeuristicConfig()

    def _new_state(self, seq: SeqInfo) -> _State:
        return _State(k=self.config.initial_k)

    def _propose(self, state: _State, seq: SeqInfo) -> Plan:
        return Plan(k=state.k)

    def _update(self, state: _State, fb: StepFeedback) -> None:
        if fb.proposed == 0:
            return
        if fb.all_accepted:
            state.k = min(state.k + self.config.increase, self.config.max_k)
        else:
            state.k = max(1, state.k - self.config.decrease)

    def _stats(self, state: _State) -> dict[str, float]:
        return {"k": float(state.k)}
