"""The scheduler on scripted requests: admission order and slots, cancellation, and the chunked-prefill split of the
step's budget for the target (schedule) and for the draft (split_draft)."""

from __future__ import annotations

import pytest

from dsde_core.config import EngineConfig, SamplingParams, SpeculationParams
from dsde_core.errors import ConfigError
from dsde_core.request import Request
from dsde_core.scheduler import Scheduler, pending, prefilling, share


def _req(i: int, prompt: int = 5, output: int = 0, synced_target: int = 0, chunked: bool = False,
         synced_draft: int = 0, draft_gap: int = 0) -> Request:
    """A request with a prompt of `prompt` tokens, `output` committed tokens, and what each cache holds of them."""
    r = Request(f"r{i}", list(range(prompt)), SamplingParams(max_tokens=50), SpeculationParams(), detok=None)
    r.output_ids = [7] * output
    r.synced_target, r.chunked, r.synced_draft, r.draft_gap = synced_target, chunked, synced_draft, draft_gap
    return r


def _decoding(i: int, tokens: int = 12) -> Request:
    """A decoding request: the target's cache holds every committed token but the last."""
    return _req(i, prompt=tokens - 2, output=2, synced_target=tokens - 1)


def _scheduler(batch: int = 2, chunk: int | None = 10) -> Scheduler:
    return Scheduler(EngineConfig(max_batch_size=batch, max_seq_len=256, prefill_chunk=chunk))


def test_share_takes_what_fits_and_the_rest_of_the_budget() -> None:
    assert share(6, 10) == (6, 4)
    assert share(12, 10) == (10, 0)
    assert share(3, 0) == (0, 0)
    assert share(500, None) == (500, None)


def test_pending_is_the_rest_of_a_prefill_or_one_token() -> None:
    fresh, chunked, decoding = _req(0, prompt=9), _req(1, prompt=9, synced_target=4, chunked=True), _decoding(2)
    assert [prefilling(r) for r in (fresh, chunked, decoding)] == [True, True, False]
    assert [pending(r) for r in (fresh, chunked, decoding)] == [9, 5, 1]


def test_admission_is_first_come_first_served_into_the_free_slots() -> None:
    s = _scheduler(batch=2)
    reqs = [_req(i) for i in range(4)]
    for r in reqs:
        s.add(r)
    assert s.requests == {r.req_id: r for r in reqs} and s.has_unfinished()
    first, second = s.admit_next(), s.admit_next()
    assert (first, second) == (reqs[0], reqs[1]) and (first.slot, second.slot) == (0, 1)
    assert s.running == reqs[:2] and list(s.waiting) == reqs[2:]
    assert s.admit_next() is None  # no free slot: the queue stays
    assert s.free(first) == 0 and first.slot is None and s.running == [second] and first.req_id not in s.requests
    third = s.admit_next()
    assert third is reqs[2] and third.slot == 0  # the freed slot
    assert s.free(_req(9)) is None  # a request that never ran had no slot
    s.free(second)
    s.free(third)
    assert s.admit_next() is reqs[3] and reqs[3].slot == 0 and s.free_slots == [1]


def test_an_id_in_use_is_refused() -> None:
    s = _scheduler()
    s.add(_req(0))
    with pytest.raises(ConfigError, match="already in use"):
        s.add(_req(0))
    assert len(s.waiting) == 1


def test_cancelled_requests_leave_the_queue_once_and_finished_ones_are_not_cancelled() -> None:
    s = _scheduler(batch=1)
    running, waiting, done = _req(0), _req(1), _req(2)
    for r in (running, waiting, done):
        s.add(r)
    s.admit_next()
    done.finish_reason = "length"
    assert s.cancel(running.req_id) and s.cancel(waiting.req_id)
    assert not s.cancel(done.req_id) and not s.cancel("nobody")
    assert sorted(r.req_id for r in s.take_cancelled()) == ["r0", "r1"]
    assert list(s.waiting) == [done] and s.take_cancelled() == []  # taken once
    s.cancel(waiting.req_id)
    s.free(waiting)  # ended before the step took its cancellation: nothing left to take
    assert s.take_cancelled() == [] and not s.cancelled


def test_the_targets_budget_runs_what_fits_chunks_the_first_over_it_and_defers_the_rest() -> None:
    s = _scheduler(chunk=10)
    dec0, fits, over, later, dec1 = _decoding(0), _req(1, prompt=6), _req(2, prompt=8), _req(3, prompt=3), _decoding(4)
    batch = s.schedule([dec0, fits, over, later, dec1])
    assert batch.rows == [dec0, fits, dec1]  # decoding rows are outside the budget; `later` waits a step
    assert batch.chunks == [(over, 4)]  # the budget's rest: 10 - 6
    assert batch.pending == [1, 6, 1, 4] and batch.contexts == [12, 6, 12]
    assert batch.prefill and batch.fed == [dec0, fits, dec1, over]


def test_a_chunked_prefill_takes_the_rest_when_it_fits() -> None:
    s = _scheduler(chunk=10)
    r = _req(0, prompt=25, synced_target=20, chunked=True)  # 5 left of its prompt
    batch = s.schedule([r])
    assert batch.rows == [r] and batch.chunks == [] and batch.pending == [5] and batch.prefill


def test_without_a_budget_every_prefill_runs_whole_and_decoding_is_no_prefill() -> None:
    s = _scheduler(chunk=None)
    rows = [_req(0, prompt=300), _decoding(1), _req(2, prompt=200)]
    batch = s.schedule(rows)
    assert batch.rows == rows and batch.chunks == [] and batch.pending == [300, 1, 200]
    assert not s.schedule([_decoding(3), _decoding(4)]).prefill


def test_the_drafts_prefills_share_the_budget_and_its_catch_ups_do_not() -> None:
    s = _scheduler(chunk=10)
    warm = _req(0, prompt=20, output=3, synced_draft=21)  # a catch-up from a warm cache: outside the budget
    fresh = _req(1, prompt=7)  # an empty draft cache: a prefill
    gap = _req(2, prompt=30, synced_draft=30, draft_gap=12)  # a prefill in chunks: over the budget's rest
    spent = _req(3, prompt=9)  # nothing left for it: waits a step
    empty = _req(4, prompt=1)  # a prefill of no context tokens (its one token is the draft's first query): fed
    out = s.split_draft([(warm, 2), (fresh, 6), (gap, 12), (spent, 8), (empty, 0)])
    assert out == [(warm, 2, 2), (fresh, 6, 6), (gap, 12, 4), (empty, 0, 0)]
    assert _scheduler(chunk=None).split_draft([(fresh, 600), (spent, 8)]) == [(fresh, 600, 600), (spent, 8, 8)]
