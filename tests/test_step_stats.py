"""The step recorder with a fake clock: each StepRecord field, what it feeds the cost model, and the prefill chunks it
counts."""

from __future__ import annotations

from typing import Any

import pytest

from dsde_core.cost import OnlineCostModel
from dsde_core.request import RequestOutput
from dsde_core.scheduler import Batch
from dsde_core.step_stats import STEP_LOG_LEN, StepStats
from dsde_core.workers import Proposal, Verdict


class Ticks:
    """A clock that reads the given times in turn."""

    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


class Costs:
    """A cost model that records what it is fed."""

    def __init__(self) -> None:
        self.observed: list[tuple[Any, ...]] = []

    def observe(self, *args: Any) -> None:
        self.observed.append(args)


def _batch(pending: list[int], contexts: list[int], prefill: bool = False) -> Batch:
    return Batch(rows=[], chunks=[], pending=pending, contexts=contexts, prefill=prefill)


def _step(stats: StepStats, batch: Batch, proposals: dict[str, Proposal], verdicts: list[Verdict],
          emitted: list[RequestOutput], draft: tuple[int, int, int, bool] | None, target_chunks: int = 0) -> Any:
    stats.start()
    stats.planned()
    if draft is not None:
        stats.draft_call(*draft)
    stats.proposed()
    stats.verified(target_chunks)
    return stats.record(batch, proposals, verdicts, emitted)


def _proposal(n: int) -> Proposal:
    return Proposal(slot=0, tokens=[1] * n, dists=[])


def _verdict(k: int, accepted: int) -> Verdict:
    return Verdict(slot=0, tokens=[2] * (accepted + 1), accepted=accepted, kld=[0.1] * k)


def test_a_drafting_step_is_timed_by_phase_and_fed_to_the_cost_model() -> None:
    costs = Costs()
    stats = StepStats(costs, Ticks(10.0, 10.5, 10.8, 11.5, 12.0))  # start, planned, proposed, verified, record
    emitted = [RequestOutput("a", [2, 2, 2], ""), RequestOutput("b", [2], "", finished=True)]
    rec = _step(stats, _batch([1, 1, 4], [30, 41]), {"a": _proposal(3), "b": _proposal(1)},
                [_verdict(3, 2), _verdict(1, 0)], emitted, draft=(2, 0, 0, True))
    assert (rec.batch, rec.ks, rec.emitted, rec.prefill, rec.contexts) == (2, [3, 1], 4, False, [30, 41])
    assert (rec.draft_s, rec.target_s, rec.total_s) == pytest.approx((0.3, 0.7, 2.0))
    # verify tokens: 6 pending + 4 proposed; draft: 3 levels, 4 rows over them, no context tokens; longest context 41
    assert costs.observed == [(10, pytest.approx(0.7), 3, 4, pytest.approx(0.3), 0, 41)]
    assert list(stats.step_log) == [rec] and stats.prefill_chunks == {"target": 0, "draft": 0}


def test_a_draft_call_that_only_caught_up_is_one_forward_of_its_rows_and_its_context_is_priced_apart() -> None:
    costs = Costs()
    stats = StepStats(costs, Ticks(0.0, 0.1, 0.3, 0.6, 0.7))
    rec = _step(stats, _batch([1, 1, 1], [9, 9, 12]), {}, [_verdict(0, 0)] * 3, [], draft=(3, 25, 0, True))
    assert costs.observed == [(3, pytest.approx(0.3), 1, 3, pytest.approx(0.2), 25, 12)]
    assert rec.ks == [0, 0, 0] and rec.emitted == 0


def test_a_step_without_a_draft_call_feeds_no_draft_work() -> None:
    costs = Costs()
    stats = StepStats(costs, Ticks(0.0, 0.1, 0.1, 0.4, 0.5))
    rec = _step(stats, _batch([17], [17], prefill=True), {}, [_verdict(0, 0)], [], draft=None)
    assert costs.observed == [(17, pytest.approx(0.3), 0, 0, 0.0, 0, 17)]
    assert rec.prefill and rec.draft_s == 0.0


def test_prefill_chunks_are_counted_where_each_model_took_them() -> None:
    stats = StepStats(Costs(), Ticks(*[float(i) for i in range(15)]))
    rec = _step(stats, _batch([16], []), {}, [], [], draft=(1, 16, 1, True), target_chunks=1)  # chunks only
    assert rec.batch == 0 and rec.contexts == [] and rec.prefill  # a draft chunk is a prefill, rows or not
    assert stats.prefill_chunks == {"target": 1, "draft": 1}
    _step(stats, _batch([1], [5]), {}, [_verdict(0, 0)], [], draft=(2, 16, 1, False))  # the draft raised
    assert stats.prefill_chunks == {"target": 1, "draft": 1}
    rec = _step(stats, _batch([1], [5]), {}, [_verdict(0, 0)], [], draft=(2, 16, 1, False))
    assert rec.prefill  # fed, if not taken in: the step still sent a prompt's chunk
    assert len(stats.step_log) == 3


def test_the_default_cost_model_learns_from_every_step_and_the_log_keeps_the_newest() -> None:
    stats = StepStats(clock=Ticks(*[0.01 * i for i in range(5 * (STEP_LOG_LEN + 1))]))
    assert isinstance(stats.costs, OnlineCostModel)
    for i in range(STEP_LOG_LEN + 1):
        _step(stats, _batch([1], [10 + i]), {}, [_verdict(0, 0)], [], draft=None)
    assert stats.costs.observed == STEP_LOG_LEN + 1
    assert len(stats.step_log) == STEP_LOG_LEN and stats.step_log[0].contexts == [11]  # the first one dropped
