"""A transparent policy wrapper that records, per step, what a few sequences were planned, proposed and accepted,
their KLDs, the draft's confidence in each proposed token, the step costs the plan was given and the policy's own
internals (DSDE: wvir, scale_factor, sl_hat, cap; dsde-goodput: p_first, pbar, on, ...) for the SL-over-time plots
and for reading a cost-aware policy's choices after the fact."""

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
        self._costs: dict[str, float] = {}  # what the last plan was told a step costs

    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        for s in seqs:
            if s.req_id not in self.series and len(self.series) < self.watch:
                self.series[s.req_id] = []
        self._costs = {} if costs is None or not seqs else {  # D(1): one draft forward of one row; V(B): a
            "draft_1_s": round(costs.draft(1), 5), "verify_b_s": round(costs.verify(len(seqs)), 5)}  # target-only step
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
            if fb.draft_conf:
                row["conf"] = [round(v, 4) for v in fb.draft_conf]
            row.update(self._costs)
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
