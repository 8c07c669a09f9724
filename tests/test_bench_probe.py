"""The machine probe of `dsde bench` (dsde_bench/probe.py): a timed fixed forward that leaves the engine as it was."""

from __future__ import annotations

import pytest

from dsde_bench.backend import tiny_backend
from dsde_bench.probe import PROBE_CONTEXT, machine_probe, probe_tokens
from dsde_bench.runner import drive
from dsde_core.config import SamplingParams
from dsde_core.policies import make_policy


@pytest.fixture(scope="module")
def backend():
    return tiny_backend(max_batch=2, max_seq_len=256, max_sl=4)


def test_the_probe_times_a_forward_and_leaves_the_engine_as_it_was(backend) -> None:
    engine = backend.engine
    drive(engine, [[5, 6, 7, 8]], ["warm"], [SamplingParams(max_tokens=6)], 1)  # the cost model has seen steps
    costs, log = engine.costs.estimate(2, 6), list(engine.step_log)
    ms = machine_probe(engine, forwards=3)
    assert ms is not None and ms > 0
    runner = engine.target.runner
    assert all(runner.length(s) == 0 for s in range(engine.config.max_batch_size))  # every slot left empty
    assert engine.costs.estimate(2, 6) == costs and list(engine.step_log) == log  # not a step: no cost sample, no log
    assert engine.free_slots == list(range(engine.config.max_batch_size - 1, -1, -1))


def _generate(engine) -> list[list[int]]:
    engine.set_policy(make_policy("static:2"))
    reqs = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in ([5, 6, 7, 8], [9, 10, 11])]
    while engine.has_unfinished():
        engine.step()
    return [list(r.output_ids) for r in reqs]


def test_greedy_output_is_the_same_with_a_probe_between_runs(backend) -> None:
    """The probe writes a free slot's cache; a request later given that slot must not see it."""
    first = _generate(backend.engine)
    assert machine_probe(backend.engine, forwards=2) is not None
    assert _generate(backend.engine) == first and all(len(o) == 12 for o in first)


def test_no_probe_when_off_or_while_requests_run(backend) -> None:
    engine = backend.engine
    assert machine_probe(engine, forwards=0) is None
    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    try:
        assert machine_probe(engine) is None  # a running request owns the engine: probing would disturb it
    finally:
        while engine.has_unfinished():
            engine.step()
    assert req.finished and machine_probe(engine, forwards=1) is not None


def test_probe_tokens_stay_inside_a_small_vocabulary() -> None:
    toks = probe_tokens(PROBE_CONTEXT, 96)
    assert len(toks) == PROBE_CONTEXT and max(toks) < 96 and len(set(toks)) > 1
