"""The one interface between the engine and every speculation-length policy.

Per engine step: `plan(seqs, costs)` with ALL running sequences -> one `Plan` each (same order); the engine drafts,
verifies and commits; then `observe(feedback)` with one `StepFeedback` per sequence that took part; when a
request ends (finished, failed, cancelled) the engine calls `release(req_id)`.

Contract every policy keeps:
- per-request state is created lazily on the first `plan` that names an unknown req_id;
- `observe` ignores req_ids it holds no state for (a request released before its feedback arrived must
  not come back to life);
- every returned k is in [0, seq.max_k];
- `release` drops all of a request's state, so `num_tracked()` returns to 0 once all requests end.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from dsde_core.cost import StepCosts
from dsde_core.errors import ConfigError
from dsde_core.policies.stopping import CONFIDENCE_AS_P, AcceptModel, DraftStop


@dataclass(frozen=True)
class SeqInfo:
    """What the engine tells the policy about one running sequence at plan time."""

    req_id: str
    temperature: float
    max_k: int
    """Hard ceiling from the engine (remaining tokens, cache room, per-request max); the plan's k <= max_k."""
    pending: int = 1
    """Tokens the target is fed for this sequence this step besides the drafts (1 when decoding; a prompt)."""
    remaining: int | None = None
    """Tokens the request may still generate (max_tokens less its output so far); None: unknown."""
    draft_lag: int = 0
    """Context tokens the draft must take in before this sequence drafts (its whole context when the draft's cache of
    it is empty: the engine defers a draft's prefill until the sequence drafts)."""

    def __post_init__(self) -> None:
        if self.max_k < 0:
            raise ConfigError(f"SeqInfo {self.req_id!r}: max_k must be >= 0, got {self.max_k}")
        if self.pending < 1:
            raise ConfigError(f"SeqInfo {self.req_id!r}: pending must be >= 1, got {self.pending}")
        if self.remaining is not None and self.remaining < 0:
            raise ConfigError(f"SeqInfo {self.req_id!r}: remaining must be >= 0, got {self.remaining}")
        if self.draft_lag < 0:
            raise ConfigError(f"SeqInfo {self.req_id!r}: draft_lag must be >= 0, got {self.draft_lag}")
        if not self.temperature >= 0:
            raise ConfigError(f"SeqInfo {self.req_id!r}: temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class Plan:
    """What one sequence does this step."""

    k: int
    """Number of draft tokens to propose (0 = a target-only step)."""
    min_confidence: float | None = None
    """AdaEDL: the draft stops after token t when 1 - sqrt(0.1 * H(q_t)) < min_confidence. None: never."""
    p_next: float | None = None
    """The cost-aware stop rule (stopping.py) applies to this row: the expected acceptance of a token not drafted
    yet. None: the row drafts k tokens (or stops by min_confidence)."""
    accept_model: AcceptModel = CONFIDENCE_AS_P
    """This row's acceptance model in the stop rule: p = sigmoid(a + s * logit(max(confidence, floor))), (a, s,
    floor)."""
    stop: DraftStop | None = None
    """The batch's stop rule; the same object in every plan of a step (None when no row uses it)."""
    worth: float = 1.0
    """What one of this row's output tokens is worth in the stop rule, against the batch's mean of 1."""

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"Plan.k must be >= 0, got {self.k}")
        if self.min_confidence is not None and not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"Plan.min_confidence must be in [0, 1] or None, got {self.min_confidence}")
        if self.p_next is not None and not 0.0 <= self.p_next <= 1.0:
            raise ValueError(f"Plan.p_next must be in [0, 1] or None, got {self.p_next}")
        if not (self.worth >= 0 and math.isfinite(self.worth)):
            raise ValueError(f"Plan.worth must be finite and >= 0, got {self.worth}")


@dataclass(frozen=True)
class StepFeedback:
    """What happened to one sequence in one step."""

    req_id: str
    planned: int
    """k that was planned."""
    proposed: int
    """Tokens the draft actually proposed (<= planned; AdaEDL may stop early)."""
    accepted: int
    """Accepted draft tokens (0..proposed)."""
    kld: tuple[float, ...] = ()
    """Per proposed position (len == proposed): sparse KLD at the signal temperature."""
    draft_entropy: tuple[float, ...] = ()
    """Per proposed position (len == proposed, or empty when not computed): the draft's entropy in nats."""
    draft_conf: tuple[float, ...] = ()
    """Per proposed position (len == proposed, or empty): the draft's probability of the token it proposed, at the
    signal temperature (the stop rule's confidence)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kld", tuple(float(v) for v in self.kld))
        object.__setattr__(self, "draft_entropy", tuple(float(v) for v in self.draft_entropy))
        object.__setattr__(self, "draft_conf", tuple(float(v) for v in self.draft_conf))
        if not 0 <= self.accepted <= self.proposed <= self.planned:
            raise ValueError(
                f"StepFeedback {self.req_id!r}: need 0 <= accepted <= proposed <= planned, "
                f"got accepted={self.accepted}, proposed={self.proposed}, planned={self.planned}"
            )
        if len(self.kld) != self.proposed:
            raise ValueError(
                f"StepFeedback {self.req_id!r}: one KLD per proposed position expected, "
                f"got {len(self.kld)} for proposed={self.proposed}"
            )
        for name in ("draft_entropy", "draft_conf"):
            values = getattr(self, name)
            if values and len(values) != self.proposed:
                raise ValueError(f"StepFeedback {self.req_id!r}: {name} has {len(values)} values "
                                 f"for proposed={self.proposed}")

    @property
    def all_accepted(self) -> bool:
        """Every proposed token was accepted, and there was at least one."""
        return self.proposed > 0 and self.accepted == self.proposed

    @property
    def acceptance(self) -> float | None:
        """accepted / proposed for this step; None when nothing was proposed."""
        return self.accepted / self.proposed if self.proposed > 0 else None


def clamp_k(k: int, max_k: int) -> int:
    """k limited to [0, max_k]."""
    return max(0, min(int(k), max_k))


class SpeculationPolicy(ABC):
    """Chooses k (and optionally an early-stop confidence) per sequence per step."""

    name: str = "policy"
    cost_aware: bool = False
    """Whether plan() uses the step costs (a simulator then replays it once per cost profile)."""
    pooled: bool = False
    """Whether it learns across requests (estimates pooled over sequences): a benchmark may warm it up first."""

    @abstractmethod
    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        """One Plan per seq, same order. Called once per engine step with ALL running sequences.
        costs: the engine's step-cost model at this batch size (cost-aware policies use it; others ignore it).
        waiting: requests queued for a slot (0: the batch only shrinks until new requests arrive)."""

    @abstractmethod
    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        """Update per-request state from the step that was just executed."""

    @abstractmethod
    def release(self, req_id: str) -> None:
        """The request ended: drop all of its state (a no-op for unknown ids)."""

    @abstractmethod
    def num_tracked(self) -> int:
        """How many requests have state."""

    def stats(self, req_id: str) -> dict[str, float]:
        """Current per-request internals for metrics and plots; empty when there are none."""
        return {}

    bound_field: str | None = None
    """The field of the policy's `config` that bounds every k it plans (StaticConfig.k, DSDEConfig.max_sl, ...)."""

    @property
    def k_bound(self) -> int | None:
        """The largest k plan() asks for (a static k, DSDE's MAX); None where only the engine bounds it."""
        return getattr(getattr(self, "config", None), self.bound_field) if self.bound_field else None

    def cappable(self, req_id: str) -> bool:
        """Whether the batch SL cap may apply to this request (DSDE: only after its warm-up)."""
        return True


S = TypeVar("S")


class PerRequestPolicy(SpeculationPolicy, Generic[S]):
    """The common shape: a dict of per-request state S, a k rule and an update rule.

    Subclasses give `_new_state(seq)`, `_propose(state, seq) -> Plan` (unclamped; the base clamps k to
    max_k) and `_update(state, fb)`.
    """

    def __init__(self) -> None:
        self._states: dict[str, S] = {}

    def _new_state(self, seq: SeqInfo) -> S:
        raise NotImplementedError

    def _propose(self, state: S, seq: SeqInfo) -> Plan:
        raise NotImplementedError

    def _update(self, state: S, fb: StepFeedback) -> None:
        raise NotImplementedError

    def _stats(self, state: S) -> dict[str, float]:
        return {}

    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        plans = []
        for seq in seqs:
            state = self._states.get(seq.req_id)
            if state is None:
                state = self._states[seq.req_id] = self._new_state(seq)
            p = self._propose(state, seq)
            plans.append(Plan(k=clamp_k(p.k, seq.max_k), min_confidence=p.min_confidence))
        return plans

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        for fb in feedback:
            state = self._states.get(fb.req_id)
            if state is not None:
                self._update(state, fb)

    def release(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def num_tracked(self) -> int:
        return len(self._states)

    def stats(self, req_id: str) -> dict[str, float]:
        state = self._states.get(req_id)
        return {} if state is None else self._stats(state)

    def _state_of(self, req_id: str) -> S | None:
        return self._states.get(req_id)

