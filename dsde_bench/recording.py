"""A transparent policy wrapper that records, per step, what a few sequences were planned, proposed and accepted,
their KLDs and the policy's own internals (DSDE: wvir, scale_factor, sl_hat, cap) for the SL-over-time plots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dsde_core.cost import StepCosts
from dsde_core.policies import Plan, SeqInfo, SpeculationPolicy, StepFeedback


class RecordingPolicy(SpeculationPolicy):
    """Delegates every call to `inner`; keeps the per-step series of the first `watch` requests it sees."""

    def __init__(self, inner: SpeculationPolicy, watch: int = 3) -> None:
        self.inner = inner
        self.name = inner.name
        self.watch = watch
        self.series: dict[str, list[dict[str, Any]]] = {}
        self.step = 0

    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        for s in seqs:
            if s.req_id not in self.series and len(self.series) < self.watch:
                self.series[s.req_id] = []
        return self.inner.plan(seqs, costs, waiting)

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        self.inner.observe(feedback)
        for fb in feedback:
            rows = self.series.get(fb.req_id)
            if rows is None:
                continue
            row: dict[str, Any] = {"step": self.step, "planned": fb.planned, "proposed": fb.proposed,
                                   "accepted": fb.accepted, "kld": [round(v, 5) for v in fb.kld]}
            if fb.kld:
                row["kld_mean"] = sum(fb.kld) / len(fb.kld)
            row.update({k: v for k, v in self.inner.stats(fb.req_id).items() if k not in row})
            rows.append(row)
        self.step += 1

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)

    def num_tracked(self) -> int:
        return self.inner.num_tracked()

    def stats(self, req_id: str) -> dict[str, float]:
        return self.inner.stats(req_id)

    def cappable(self, req_id: str) -> bool:
        return self.inner.cappable(req_id)
