"""The arithmetic of a benchmark cell and of the serving figures, on hand-made records."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dsde_bench.metrics import (
    RequestRecord,
    StepSample,
    StreamRecord,
    add_speedups,
    add_static_opt,
    percentile,
    serve_metrics,
    static_k,
    std,
    summarize,
)
from dsde_core.request import RequestStats


def _req(pid: str, out: int, sls: list[int], accs: list[int], e2e: float, ttft: float = 0.1,
         itl: float | None = 0.01) -> RequestRecord:
    return RequestRecord(pid, 10, out, steps=len(sls), drafted=sum(sls), accepted=sum(accs), sl=sls, e2e_s=e2e,
                         ttft_s=ttft, itl_s=itl)


def test_summarize_pools_over_requests() -> None:
    a = _req("a", out=10, sls=[4, 4, 2], accs=[4, 2, 1], e2e=2.0)  # 3 steps, 10 drafted, 7 accepted
    b = _req("b", out=6, sls=[3, 3, 0], accs=[3, 0, 0], e2e=4.0)  # 3 steps, 6 drafted, 3 accepted
    steps = [StepSample(2, [4, 3], 0.4, 0.2), StepSample(2, [4, 3], 0.4, 0.2), StepSample(2, [2], 0.2, 0.2)]
    m = summarize([a, b], steps, wall_s=4.0)
    assert m.requests == 2 and m.output_tokens == 16
    assert m.mean_e2e_s == pytest.approx(3.0)
    assert m.p50_e2e_s == pytest.approx(3.0)
    assert m.output_tok_s == pytest.approx(16 / 4.0)
    assert m.acceptance_rate == pytest.approx(10 / 16)
    assert m.mean_accepted_length == pytest.approx((10 + 6) / 6)
    assert m.target_fwd_per_tok == pytest.approx(6 / 16)
    assert m.draft_fwd_per_tok == pytest.approx(16 / 16)
    assert m.target_calls_per_tok == pytest.approx(3 / 16)
    assert m.draft_calls_per_tok == pytest.approx((4 + 4 + 2) / 16)
    sls = [4, 4, 2, 3, 3, 0]
    assert m.sl_mean == pytest.approx(np.mean(sls))
    assert m.sl_std == pytest.approx(np.std(sls))
    assert m.mean_ttft_s == pytest.approx(0.1)


def test_target_only_cell() -> None:
    reqs = [_req("a", out=5, sls=[0] * 5, accs=[0] * 5, e2e=1.0)]
    m = summarize(reqs, None, 1.0)
    assert m.acceptance_rate == 0.0
    assert m.target_fwd_per_tok == 1.0 and m.mean_accepted_length == 1.0 and m.draft_fwd_per_tok == 0.0
    assert m.target_calls_per_tok is None and m.sl_mean == 0.0 and m.sl_std == 0.0


def test_from_stats_matches_request_stats() -> None:
    st = RequestStats(arrival=1.0)
    st.record_step(4, 3)
    st.record_step(2, 0)
    st.first_token, st.finish, st.token_times = 1.5, 3.0, [1.5, 1.5, 2.0, 3.0]
    r = RequestRecord.from_stats("p", 7, 5, st, "length")
    assert (r.steps, r.drafted, r.accepted, r.sl) == (2, 6, 3, [4, 2])
    assert r.e2e_s == pytest.approx(2.0) and r.ttft_s == pytest.approx(0.5) and r.itl_s == pytest.approx(0.5)
    m = summarize([r], None, 2.0)
    assert m.mean_accepted_length == pytest.approx(st.mean_accepted_length)
    assert m.acceptance_rate == pytest.approx(st.acceptance_rate)


def test_summarize_needs_requests() -> None:
    with pytest.raises(ValueError):
        summarize([], None, 1.0)


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    xs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_and_std_edge_cases() -> None:
    assert math.isnan(percentile([], 50)) and math.isnan(std([]))
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _cell(w: str, pol: str, e2e: float, tps: float, bs: int = 1, t: float = 0.0) -> dict:
    return {"kind": "engine", "workload": w, "temperature": t, "batch": bs, "policy": pol, "label": pol,
            "metrics": {"mean_e2e_s": e2e, "output_tok_s": tps, "speedup": None, "throughput_ratio": None}}


def test_speedups_are_within_the_group() -> None:
    cells = [_cell("code", "off", 4.0, 10.0), _cell("code", "dsde", 2.0, 20.0), _cell("code", "dsde", 1.0, 80.0, bs=4),
             _cell("code", "off", 2.0, 40.0, bs=4), _cell("chat", "dsde", 1.0, 1.0)]
    add_speedups(cells)
    assert cells[1]["metrics"]["speedup"] == pytest.approx(2.0)
    assert cells[1]["metrics"]["throughput_ratio"] == pytest.approx(2.0)
    assert cells[2]["metrics"]["speedup"] == pytest.approx(2.0)
    assert cells[2]["metrics"]["throughput_ratio"] == pytest.approx(2.0)
    assert cells[4]["metrics"]["speedup"] is None  # no target-only baseline for chat


def test_static_opt_picks_the_lowest_latency_static_k() -> None:
    cells = [_cell("code", "static:1", 3.0, 1), _cell("code", "static:4", 2.0, 1), _cell("code", "static:8", 2.5, 1),
             _cell("code", "dsde", 1.0, 1), _cell("code", "static:2", 9.0, 1, bs=4), _cell("code", "static:3", 8.0, 1,
                                                                                          bs=4)]
    added = add_static_opt(cells)
    by_batch = {c["batch"]: c for c in added}
    assert by_batch[1]["static_opt_k"] == 4 and by_batch[1]["metrics"]["mean_e2e_s"] == 2.0
    assert by_batch[4]["static_opt_k"] == 3
    assert all(c["policy"] == "static-opt" for c in added) and len(cells) == 8
    assert static_k("static:6") == 6 and static_k("dsde") is None and static_k("static-opt") is None


def test_step_sample_calls() -> None:
    s = StepSample(3, [5, 2], 0.1, 0.2)
    assert s.draft_calls == 5 and s.target_tokens == 3 + 7
    assert StepSample(2, [], 0.0, 0.1).draft_calls == 0


def test_serve_metrics_names_and_values() -> None:
    recs = [
        StreamRecord(start=0.0, chunk_times=[0.5, 0.7, 1.0], output_tokens=5, prompt_tokens=10),  # ttft .5 e2el 1
        StreamRecord(start=1.0, chunk_times=[1.2, 2.0], output_tokens=3, prompt_tokens=20),  # ttft .2 e2el 1
        StreamRecord(start=0.0, chunk_times=[], output_tokens=0, ok=False, error="HTTP 500"),
    ]
    m = serve_metrics(recs, duration_s=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_output_tokens"] == 8 and m["total_input_tokens"] == 30
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(19.0)
    assert m["mean_ttft_ms"] == pytest.approx(350.0)
    assert m["median_ttft_ms"] == pytest.approx(350.0)
    assert m["mean_e2el_ms"] == pytest.approx(1000.0)
    itls = [200.0, 300.0, 800.0]
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itls))
    assert m["p99_itl_ms"] == pytest.approx(np.percentile(itls, 99))
    assert m["p90_e2el_ms"] == pytest.approx(1000.0)
    tpots = [(1.0 - 0.5) / 4 * 1000, (1.0 - 0.2) / 2 * 1000]
    assert m["mean_tpot_ms"] == pytest.approx(np.mean(tpots))
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{name}_ms" in m
