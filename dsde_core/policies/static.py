"""Static k: the same speculation length every step; and Off: k = 0, target-only decoding.

Off runs through the same engine (plan -> propose 0 -> verify 1 position -> commit), so it is the
autoregressive baseline measured with identical batching and sampling code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsde_core.cost import StepCosts
from dsde_core.errors import ConfigError
from dsde_core.policies.base import Plan, SeqInfo, SpeculationPolicy, StepFeedback, clamp_k

DEFAULT_STATIC_K = 4


@dataclass(frozen=True)
class StaticConfig:
    k: int = DEFAULT_STATIC_K

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 0:
            raise ConfigError(f"static k must be an integer >= 0, got {self.k!r}")


class StaticPolicy(SpeculationPolicy):
    """k = config.k (limited by each sequence's max_k). Stateless: nothing is tracked per request."""

    bound_field = "k"

    def __init__(self, config: StaticConfig | int = DEFAULT_STATIC_K) -> None:
        self.config = config if isinstance(config, StaticConfig) else StaticConfig(k=config)
        self.name = f"static:{self.config.k}"

    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        return [Plan(k=clamp_k(self.config.k, s.max_k)) for s in seqs]

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        pass

    def release(self, req_id: str) -> None:
        pass

    def num_tracked(self) -> int:
        return 0

    def stats(self, req_id: str) -> dict[str, float]:
        return {"k": float(self.config.k)}


class OffPolicy(StaticPolicy):
    """k = 0 always: target-only decoding through the speculative engine."""

    def __init__(self) -> None:
        super().__init__(StaticConfig(k=0))
        self.name = "off"
