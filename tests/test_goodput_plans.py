"""benchmarks/goodput_plans.py: its log keeps every plan as the policy made it, without changing it, and its tail is
the plans once the batch has shrunk for good; bad arguments are CLI errors before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsde_bench.backend import tiny_backend
from dsde_bench.runner import run_cell, sampling_params
from dsde_core.policies import make_policy
from tests.bench_scripts import BENCHMARKS, script


@pytest.fixture
def plans():  # script() makes its siblings importable while it loads
    return script("goodput_plans")


def _run(policy):
    backend = tiny_backend(max_batch=2, max_seq_len=256, max_sl=4)
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 7)]
    return run_cell(backend.engine, policy, prompts, ["a", "b", "c"], sampling_params(3, 6, 0.0, 1, True), 2, watch=0)


def _done(run) -> list[tuple]:
    return sorted((r.prompt_id, r.output_tokens, r.steps, r.drafted, r.accepted) for r in run.records)


def test_the_log_keeps_every_plan_and_changes_nothing(plans) -> None:
    """static:2 plans the same whatever the timing: the logged run equals the bare one request by request."""
    log = plans.PlanLog(make_policy("static:2"))
    logged, bare = _run(log), _run(make_policy("static:2"))
    assert _done(logged) == _done(bare) and [r[1] for r in _done(bare)] == [6, 6, 6]
    assert [len(p.rows) for p in log.plans] == [s.batch for s in logged.steps]  # one plan a step
    assert all(r.k == min(2, r.max_k) for p in log.plans for r in p.rows)
    assert log.plans[0].open is None and str(log.plans[0]).startswith("batch 2, 0 waiting: ")


def test_goodputs_rows_carry_what_it_knew(plans) -> None:
    log = plans.PlanLog(make_policy("dsde-goodput"))
    _run(log)
    first = log.plans[0].rows[0]
    assert first.remaining == 6 and first.draft_lag > 0 and {"p_first", "pbar", "on"} <= set(first.stats)
    assert all(0 <= r.k <= r.max_k for p in log.plans for r in p.rows)
    assert isinstance(log.plans[0].open, bool) and "left 6, max_k" in str(log.plans[0]) and "pbar" in str(first)


def test_another_policys_stats_are_printed_whole(plans) -> None:
    row = plans.PlanRow("r", 5, 4, 2, 0, {"wvir": 0.5, "cap": 3.0})
    assert str(row) == "r: left 5, max_k 4, k 2, draft lag 0, cap 3.00 wvir 0.50"


def test_the_tail_starts_three_plans_before_the_batch_shrinks_for_good(plans) -> None:
    def record(batch: int):
        return plans.PlanRecord(0, None, [plans.PlanRow(str(i), 1, 1, 0, 0, {}) for i in range(batch)])

    log = [record(b) for b in (2, 4, 3, 4, 4, 4, 4, 3, 2, 1)]
    assert [len(p.rows) for p in plans.tail(log, 4)] == [4, 4, 4, 3, 2, 1]
    assert plans.tail(log, 8) == log  # never full: everything
    assert [len(p.rows) for p in plans.tail(log[:7], 4)] == [4, 4, 4]  # ends full: the last three


@pytest.mark.parametrize(("argv", "message"), [
    (["--policy", "nonsense"], "nonsense"),
    (["--batch", "0"], "--batch must be >= 1"),
])
def test_bad_arguments_fail_before_any_model_loads(argv: list[str], message: str) -> None:
    res = subprocess.run([sys.executable, str(BENCHMARKS / "goodput_plans.py"), *argv], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
