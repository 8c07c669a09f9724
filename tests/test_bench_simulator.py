"""The trace-driven simulator against the real engine on a tiny random pair: the replay must predict target
forwards per output token within 5% of measured for every policy at temperature 0 (it is exact in fp32)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace

import pytest

from dsde_bench.backend import tiny_backend
from dsde_bench.metrics import summarize
from dsde_bench.runner import Warmup, run_cell, sampling_params
from dsde_bench.sim.costs import (
    CostModel,
    ProfileCosts,
    builtin_profile,
    fit_engine_steps,
    load_costs_file,
    parse_profile,
)
from dsde_bench.sim.simulator import DEFAULT_SIM_POLICIES, OraclePolicy, simulate, sweep
from dsde_bench.sim.trace import SeqTrace, Trace, record
from dsde_bench.sim.validate import validate
from dsde_core.errors import ConfigError
from tests.test_bench_runner import one_thread  # noqa: F401  (autouse: one torch thread for the tiny pair)

HORIZON = 8
TOKENS = 28
UNIT = CostModel("unit", 1.0, 0.0, 0.0, 0.0)


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 96 for j in range(5 + 3 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def backend():
    return tiny_backend(max_batch=4, max_seq_len=256, max_sl=HORIZON, noise=0.05)


@pytest.fixture(scope="module")
def trace(backend) -> Trace:
    b = backend
    return record(b.engine.target.runner, b.engine.draft.runner, _prompts(), ["p0", "p1", "p2"], TOKENS, HORIZON,
                  eos_ids=b.engine.eos_ids, top_k=b.engine.config.draft_top_k, workload="tiny")


def test_trace_is_the_targets_greedy_output(backend, trace: Trace) -> None:
    from dsde_core.config import SamplingParams
    from dsde_core.policies import make_policy

    engine = backend.engine
    engine.set_policy(make_policy("off"))
    reqs = [engine.add_request(p, SamplingParams(max_tokens=TOKENS)) for p in _prompts()]
    engine.run()
    for s, r in zip(trace.seqs, reqs, strict=True):
        assert r.output_ids == s.tokens[: s.output_len]  # the engine's greedy output is the trace's path
        assert len(s.tokens) == TOKENS and len(s.draft) == len(s.kld) == len(s.entropy) == len(s.top1) == TOKENS
        assert s.prompt == r.prompt_ids
        for i in range(TOKENS):
            assert len(s.draft[i]) == min(HORIZON, TOKENS - 1 - i) == len(s.kld[i]) == len(s.entropy[i]) \
                == len(s.top1[i])
            assert all(0 < c <= 1 for c in s.top1[i])
            assert all(v >= -1e-6 for v in s.kld[i])


@pytest.mark.parametrize("batch", [1, 3])
def test_replay_matches_the_engine(backend, trace: Trace, batch: int) -> None:
    policies = [p for p in DEFAULT_SIM_POLICIES if p != "oracle"]
    res = validate(backend, [trace], policies, [batch], print_fn=lambda s: None)
    for row in res["rows"]:
        assert row["rel_error"] <= 0.05, row
    assert res["ok"]


def test_replay_matches_the_engine_step_by_step(backend, trace: Trace) -> None:
    """Beyond the 5% target: per request, the same number of steps, drafted and accepted tokens as the engine."""
    params = sampling_params(3, TOKENS, 0.0, 0, False)
    for pol in ("dsde", "adaedl", "heuristic", "static:3"):
        real = run_cell(backend.engine, pol, _prompts(), ["p0", "p1", "p2"], params, batch=2)
        sim, _, _ = simulate(trace, pol, 2, num_requests=3).priced(UNIT)
        got = {r.prompt_id: (r.steps, r.drafted, r.accepted, r.output_tokens, r.sl) for r in sim}
        want = {r.prompt_id: (r.steps, r.drafted, r.accepted, r.output_tokens, r.sl) for r in real.records}
        assert got == want, pol


def test_a_pooled_policy_warms_up_untimed_as_the_engine_does(backend, trace: Trace) -> None:
    """--warm-requests in the simulator: dsde-goodput first serves other prompts untimed, and then takes the same
    steps as the engine warmed up on the same prompts (both plan with one fixed profile, as in validate); a policy
    that keeps no state across requests replays exactly as without the warm-up."""
    b = backend
    others = [[(11 * i + 5 * j) % 96 for j in range(4 + 2 * i)] for i in range(2)]
    warm = record(b.engine.target.runner, b.engine.draft.runner, others, ["w0", "w1"], TOKENS, HORIZON,
                  eos_ids=b.engine.eos_ids, top_k=b.engine.config.draft_top_k, workload="tiny")
    assert simulate(trace, "static:3", 2, warm=warm).steps == simulate(trace, "static:3", 2).steps
    cpu = builtin_profile("cpu")
    run = simulate(trace, "dsde-goodput", 2, num_requests=3, cost=cpu, warm=warm)
    assert [r.rid for r in run.requests] == ["p0", "p1", "p2"]  # the warm-up is not part of the timed run
    cold = simulate(trace, "dsde-goodput", 2, num_requests=3, cost=cpu)
    assert run.steps != cold.steps  # the pooled estimates it starts from are the warm-up's
    params, warm_params = (sampling_params(n, TOKENS, 0.0, 0, False) for n in (3, 2))
    online, b.engine.costs = b.engine.costs, ProfileCosts(cpu)
    try:
        real = run_cell(b.engine, "dsde-goodput", _prompts(), ["p0", "p1", "p2"], params, batch=2, watch=0,
                        warm=Warmup(others, ["w0", "w1"], warm_params))
    finally:
        b.engine.costs = online
    sim, _, _ = run.priced(UNIT)
    got = {r.prompt_id: (r.steps, r.drafted, r.accepted, r.output_tokens, r.sl) for r in sim}
    assert got == {r.prompt_id: (r.steps, r.drafted, r.accepted, r.output_tokens, r.sl) for r in real.records}


def test_closed_batches_replay_a_bench_cell_batch_by_batch(backend, trace: Trace) -> None:
    """--sim-closed: each group of `batch` prompts runs to its end before the next starts, each with a fresh policy,
    as `dsde bench` runs the cells of a prompt set; the replay takes the engine's steps request for request, and the
    next batch starts after the last step of the one before."""
    ids, prompts, params = ["p0", "p1", "p2"], _prompts(), sampling_params(3, TOKENS, 0.0, 0, False)
    for pol in ("dsde", "static:3"):
        real = [r for a, z in ((0, 2), (2, 3))
                for r in run_cell(backend.engine, pol, prompts[a:z], ids[a:z], params[a:z], batch=2).records]
        run = simulate(trace, pol, 2, closed=True)
        sim, _, total = run.priced(UNIT)
        got = {r.prompt_id: (r.steps, r.drafted, r.accepted, r.output_tokens, r.sl) for r in sim}
        assert got == {r.prompt_id: (r.steps, r.drafted, r.accepted, r.output_tokens, r.sl) for r in real}, pol
        first = simulate(replace(trace, seqs=trace.seqs[:2]), pol, 2)
        assert run.requests[2].admitted_step == len(first.steps) and total == pytest.approx(len(run.steps))
    doc = sweep([trace], ["off", "static:2"], [2], [UNIT], closed=True)
    assert doc["closed"] is True  # every cell serves each prompt once
    assert {c["metrics"]["output_tokens"] for c in doc["cells"]} == {sum(r.output_tokens for r in sim)}
    with pytest.raises(ConfigError, match="num_requests"):
        sweep([trace], ["off"], [2], [UNIT], num_requests=4, closed=True)
    with pytest.raises(ConfigError, match="fresh policy"):
        simulate(trace, OraclePolicy(), 2, closed=True)


def test_oracle_is_a_lower_bound(trace: Trace) -> None:
    doc = sweep([trace], DEFAULT_SIM_POLICIES, [1, 4], [UNIT])
    for bs in (1, 4):
        cells = {c["policy"]: c["metrics"] for c in doc["cells"] if c["batch"] == bs}
        oracle = cells["oracle"]["target_fwd_per_tok"]
        assert all(m["target_fwd_per_tok"] >= oracle - 1e-12 for m in cells.values())
        assert cells["oracle"]["acceptance_rate"] == pytest.approx(1.0)  # it never drafts a rejected token
        assert cells["oracle"]["oracle_gap"] == pytest.approx(1.0)
        assert cells["off"]["target_fwd_per_tok"] == pytest.approx(1.0)
    assert any(c["policy"] == "static-opt" for c in doc["cells"])


def test_sweep_prices_every_profile_in_seconds(trace: Trace) -> None:
    profiles = [builtin_profile("cpu"), builtin_profile("gpu"), parse_profile("gpu:ratio=0.3")]
    doc = sweep([trace, trace], DEFAULT_SIM_POLICIES, [1, 4, 16], profiles)
    assert doc["elapsed_s"] < 30
    n = 2 * 3 * len(profiles) * len(DEFAULT_SIM_POLICIES)
    assert len([c for c in doc["cells"] if c["policy"] != "static-opt"]) == n
    assert {c["profile"] for c in doc["cells"]} == {"cpu", "gpu", "gpu:ratio=0.3"}


def test_trace_round_trip(tmp_path, trace: Trace) -> None:
    p = tmp_path / "t.json"
    trace.save(p)
    back = Trace.load(p)
    assert [s.tokens for s in back.seqs] == [s.tokens for s in trace.seqs]
    assert [s.draft for s in back.seqs] == [s.draft for s in trace.seqs]
    r1 = summarize(*simulate(back, "dsde", 2).priced(UNIT)[:2], 1.0)
    r2 = summarize(*simulate(trace, "dsde", 2).priced(UNIT)[:2], 1.0)
    assert r1.target_fwd_per_tok == r2.target_fwd_per_tok


def _toy_trace(eos_at: int | None = None) -> Trace:
    # tokens 0..9; the rollout at i matches the next 2 tokens, then diverges
    toks = list(range(10))
    draft = [[toks[i + j] if j < 2 and i + j < 10 else 99 for j in range(min(4, 9 - i))] for i in range(10)]
    s = SeqTrace("s", 3, toks, eos_at, draft, [[0.1] * len(d) for d in draft], [[1.0] * len(d) for d in draft],
                 top1=[[0.9] * len(d) for d in draft], prompt=[1, 2, 3])
    return Trace("toy", 10, 4, 64, {}, [s])


def test_toy_replay_arithmetic() -> None:
    tr = _toy_trace()
    assert [tr.seqs[0].match(i) for i in range(10)] == [2, 2, 2, 2, 2, 2, 2, 2, 1, 0]
    run = simulate(tr, "static:4", 1)
    recs, samples, total = run.priced(UNIT)
    # steps start at 0, 3, 6, then 9 (k limited to 0 by the 1 token left): 4 steps, 10 tokens
    assert recs[0].steps == 4 and recs[0].output_tokens == 10 and recs[0].sl == [4, 4, 3, 0]
    assert recs[0].accepted == 6 and total == 4.0
    oracle = simulate(tr, "oracle", 1).priced(UNIT)[0][0]
    assert oracle.sl == [2, 2, 2, 0] and oracle.accepted == oracle.drafted == 6


def test_toy_replay_stops_at_eos() -> None:
    rec = simulate(_toy_trace(eos_at=4), "static:4", 1).priced(UNIT)[0][0]
    assert rec.output_tokens == 4 and rec.finish_reason == "stop"


def test_cost_model_step() -> None:
    c = CostModel("c", target_base_s=1.0, target_per_token_s=0.1, draft_base_s=0.5, draft_per_token_s=0.05)
    d, t = c.step([3, 1, 0])
    # draft: forward 1 over 2 live sequences, forwards 2 and 3 over 1
    assert d == pytest.approx((0.5 + 0.05 * 1) + 0.5 + 0.5)
    assert t == pytest.approx(1.0 + 0.1 * (4 + 2 + 1 - 1))
    p = CostModel("p", 1.0, 0.1, 0.5, 0.05, padded=True)
    d, t = p.step([3, 1, 0])
    assert d == pytest.approx(3 * (0.5 + 0.05 * 2))
    assert t == pytest.approx(1.0 + 0.1 * (3 * 4 - 1))
    _, t_prefill = c.step([0], extra=[9])
    assert t_prefill == pytest.approx(1.0 + 0.1 * 9)


def test_profiles() -> None:
    gpu = builtin_profile("gpu")
    assert gpu.padded and gpu.ratio == pytest.approx(0.05)
    assert gpu.target_fwd(1) == gpu.target_fwd(gpu.knee)  # flat while memory-bound
    g2 = parse_profile("gpu:ratio=0.2,knee=64")
    assert g2.ratio == pytest.approx(0.2) and g2.knee == 64 and g2.name == "gpu:ratio=0.2,knee=64"
    m = CostModel("measured", 0.2, 0.01, 0.1, 0.005)
    assert parse_profile("measured", m).target_base_s == 0.2
    assert parse_profile("cpu:base_ms=60").ratio == pytest.approx(builtin_profile("cpu").ratio)
    with pytest.raises(ConfigError):
        parse_profile("measured")
    with pytest.raises(ConfigError):
        parse_profile("tpu")
    with pytest.raises(ConfigError):
        parse_profile("gpu:speed=3")


def test_a_costs_file_is_a_named_profile(tmp_path) -> None:
    """`--costs NAME=FILE`: a costs file measured elsewhere (benchmarks/gpu_costs.py on a GPU) prices by its table."""
    table = CostModel("gpu-measured", 0.015, 0.0001, 0.016, 0.0001, points={"target": [[1, 0.015], [8, 0.016]],
                      "draft": [[1, 0.016], [8, 0.013]]}, table=True)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"backend": {}, "model": asdict(table)}))
    h100 = load_costs_file("h100", path)
    assert h100.name == "h100" and h100.draft_fwd(8) == pytest.approx(0.013)  # the table, not the hinge
    assert parse_profile("h100", files={"h100": h100}).target_fwd(4) == pytest.approx(0.015 + 3 / 7 * 0.001)
    assert parse_profile("h100:ratio=0.5", files={"h100": h100}).draft_fwd(8) == pytest.approx(0.008)
    for name, bad, words in (("gpu", path, "built-in"), ("x", tmp_path / "none.json", "no such file")):
        with pytest.raises(ConfigError, match=words):
            load_costs_file(name, bad)
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ConfigError, match="not a costs file"):
        load_costs_file("x", tmp_path / "bad.json")


def test_a_cached_cost_table_prices_only_the_runners_it_was_timed_on(tmp_path) -> None:
    """The `measured` profile reuses results/costs-tiny.json for the same pair and runners, and times them again for
    runners the flags chose otherwise (--step static, --backend torch): one table does not price another step."""
    from dsde_bench.sim import session

    built = []

    def backend(step: str = "eager"):
        built.append(step)
        return tiny_backend(max_batch=2, max_sl=4, step=step)

    pair = {"draft": "tiny", "target": "tiny", "dtype": "float32"}
    cfg = session.SimulateConfig(("code",), 1, 4, 4, pair, results_dir=tmp_path, tag="tiny")
    first = session._measured(cfg, backend, dict)
    assert session._measured(cfg, backend, dict) == first and built == ["eager"]  # the cached table
    static = replace(cfg, backend={**pair, "step": "static"})
    session._measured(static, lambda: backend("static"), dict)
    assert built == ["eager", "static"]
    assert json.loads((tmp_path / "costs-tiny.json").read_text())["backend"] == {**pair, "step": "static"}
    session._measured(replace(cfg, backend={**pair, "backend": "torch"}), backend, dict)
    assert built == ["eager", "static", "eager"]


def test_a_cost_aware_policy_plans_with_the_draft_prefill_the_replay_prices() -> None:
    """A cold row's first draft step feeds its whole context to the draft, priced as draft_fwd(rows + context). The
    policy's StepCosts must charge the same: the slope of a table cut at the step's few tokens, which falls on the
    H100's table (launch-bound), priced it at 0, and dsde-goodput drafted rows with 2 tokens left and 470 to prefill."""
    h100 = CostModel("h100", 0.015, 0.0001, 0.016, 0.0001, table=True, points={
        "target": [[1, 0.0149], [8, 0.0159], [32, 0.0175], [256, 0.1152]],
        "draft": [[1, 0.0158], [8, 0.0130], [32, 0.0150], [256, 0.1299]]})
    costs = ProfileCosts(h100).estimate(4, 8)  # a step of 4 rows with a token or two to draft each
    per_token = (h100.draft_fwd(4 + 256) - h100.draft_fwd(4)) / 256
    assert costs.draft_context(470) == pytest.approx(470 * per_token)
    assert costs.draft_context(470) > 10 * costs.verify(8)  # dearer than ten steps: not worth 2 tokens
    assert ProfileCosts(UNIT).estimate(1).draft_context(100) == 0.0  # a flat draft takes in context for free


def test_engine_profile_prices_what_the_engine_ran_and_follows_a_measured_model_beyond() -> None:
    # [batch, sum_k, draft_calls, draft_s, target_s, prefill]: the fastest step of each group counts, prefills not
    rows = [[1, 3, 3, 0.30, 1.0, 0], [1, 3, 3, 0.36, 1.2, 0], [4, 4, 1, 0.12, 1.5, 0], [4, 0, 0, 0.0, 9.0, 1]]
    beyond = CostModel("m", 1.0, 0.001, 0.05, 0.0005)
    own, cont = fit_engine_steps(rows), fit_engine_steps(rows, beyond=beyond)
    for m in (own, cont):
        assert m.target_fwd(4) == pytest.approx(1.0) and m.target_fwd(8) == pytest.approx(1.5)
        assert m.draft_fwd(1) == pytest.approx(0.10) and m.draft_fwd(4) == pytest.approx(0.12)
    # past the engine's largest forward: the measured model's increments, not the last two points' slope
    assert cont.target_fwd(1024) == pytest.approx(1.5 + 0.001 * (1024 - 8))
    assert cont.draft_fwd(1024) == pytest.approx(0.12 + 0.0005 * (1024 - 4))
    assert own.draft_fwd(1024) == pytest.approx(0.12 + (0.02 / 3) * (1024 - 4))
    with pytest.raises(ConfigError):
        fit_engine_steps([[4, 0, 0, 0.0, 9.0, 1]])


def test_oracle_policy_reads_its_lookahead() -> None:
    from dsde_core.policies import SeqInfo

    o = OraclePolicy()
    o.lookahead = {"a": 5, "b": 0}
    assert [p.k for p in o.plan([SeqInfo("a", 0.0, 3), SeqInfo("b", 0.0, 3), SeqInfo("c", 0.0, 3)])] == [3, 0, 0]


@pytest.mark.slow
@pytest.mark.real_models
def test_replay_matches_the_engine_on_the_real_pair() -> None:
    """The same check on the embedded Qwen2.5-Coder pair in bf16 (2 HumanEval prompts, 24 tokens): a benchmark
    validation of many minutes on a small CPU; test_replay_matches_the_engine holds the replay to the engine on the
    tiny pair in the default suite."""
    from dsde_bench.backend import load_backend
    from dsde_bench.workloads import DataPackageMissing, load_workload

    try:
        prompts = load_workload("code", 2, seed=0)
    except DataPackageMissing as e:
        pytest.skip(str(e))
    b = load_backend(max_batch=2, max_seq_len=1024, max_sl=HORIZON, num_threads=os.cpu_count())  # the real pair's
    ids = [b.encode(p.text) for p in prompts]
    tr = record(b.engine.target.runner, b.engine.draft.runner, ids, [p.id for p in prompts], 24, HORIZON,
                eos_ids=b.engine.eos_ids, top_k=b.engine.config.draft_top_k, workload="code")
    res = validate(b, [tr], ["static:2", "static:4", "heuristic", "adaedl", "dsde"], [1, 2], print_fn=lambda s: None)
    assert res["ok"], res["rows"]
