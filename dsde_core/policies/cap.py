"""DSDE's adaptive SL cap: one long-SL sequence must not stall the batch.

The draft runs max_i k_i forward passes for the whole batch and verification pads to the longest k, so a
single sequence with a large k costs every other sequence time. Each step, over the batch's cappable
sequences C (DSDE: those past warm-up):
    SL_cap = ceil(mean_{i in C} SL_hat_i)        (the mean minimises sum_i (SL_hat_i - s)^2)
    k_i    = min(SL_hat_i, SL_cap)   for i in C;   other sequences (warm-up) are not capped.

SL_hat_i is the inner policy's k *before* the engine's per-sequence max_k: a sequence limited to k = 1 by
its remaining tokens does not drag the cap down for the others; its max_k is applied after the cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from dsde_core.cost import StepCosts
from dsde_core.policies.base import Plan, SeqInfo, SpeculationPolicy, StepFeedback, clamp_k

UNBOUNDED_K = 2**31 - 1
"""max_k handed to the inner policy so that it reports its own SL_hat."""


class CappedPolicy(SpeculationPolicy):
    """Wraps a policy; caps the k of its cappable sequences at ceil(mean k) over them."""

    def __init__(self, inner: SpeculationPolicy, name: str | None = None) -> None:
        self.inner = inner
        self.name = name or f"{inner.name}+cap"
        self.last_cap: int | None = None
        """SL_cap of the last plan; None when no sequence was cappable."""
        self.last_capped: frozenset[str] = frozenset()
        """req_ids whose k the cap lowered in the last plan."""

    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        raw = self.inner.plan([replace(s, max_k=UNBOUNDED_K) for s in seqs], costs, waiting)
        cappable = [self.inner.cappable(s.req_id) for s in seqs]
        wanted = [p.k for p, c in zip(raw, cappable, strict=True) if c]
        # SL_cap = ceil(mean SL_hat) over the cappable sequences, in integers: ceil(a / b) = -(-a // b).
        cap = -(-sum(wanted) // len(wanted)) if wanted else None
        plans, capped = [], set()
        for seq, p, c in zip(seqs, raw, cappable, strict=True):
            k = p.k
            if c and cap is not None and k > cap:
                k = cap
                capped.add(seq.req_id)
            plans.append(replace(p, k=clamp_k(k, seq.max_k)))
        self.last_cap = cap
        self.last_capped = frozenset(capped)
        return plans

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        self.inner.observe(feedback)

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)

    def num_tracked(self) -> int:
        return self.inner.num_tracked()

    @property
    def k_bound(self) -> int | None:
        return self.inner.k_bound

    def cappable(self, req_id: str) -> bool:
        return self.inner.cappable(req_id)

    def stats(self, req_id: str) -> dict[str, float]:
        out = dict(self.inner.stats(req_id))
        if self.last_cap is not None:
            out["cap"] = float(self.last_cap)
        out["capped"] = float(req_id in self.last_capped)
        return out
