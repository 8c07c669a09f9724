"""dsde-goodput's targets, each judged from the cells' figures (dsde_bench.report.targets)."""

from __future__ import annotations

import json
from typing import Any

from dsde_bench import report
from dsde_bench.report import sections
from dsde_bench.report import targets as tg


def _cell(w: str, b: int, policy: str, tok_s: float, t: float = 0.0, **extra: Any) -> dict[str, Any]:
    return {"workload": w, "temperature": t, "batch": b, "policy": policy, "label": policy,
            "metrics": {"output_tok_s": tok_s, "mean_e2e_s": 1.0 / tok_s, "speedup": 1.0}, **extra}


def _doc(cells: list[dict[str, Any]]) -> dict[str, Any]:
    return {"cells": cells, "backend": {}, "meta": {"command": "dsde bench ..."}, "elapsed_s": 1.0}


def _one(cells: list[dict[str, Any]]) -> tg.Target:
    [target] = tg.goodput(_doc(cells))
    return target


def test_a_low_acceptance_cell_is_judged_against_target_only() -> None:
    cells = [_cell("chat", 1, "off", 10.0, 1.0), _cell("chat", 1, "static:2", 8.0, 1.0),
             _cell("chat", 1, "dsde", 7.0, 1.0), _cell("chat", 1, "dsde-goodput", 9.9, 1.0)]
    t = _one(cells)
    assert t.name == "dsde-goodput never below target-only (>= 0.98x) where no static k pays"
    assert (t.where, t.figure, t.met) == ("chat T=1 b1", "0.990x", True)
    cells[-1]["metrics"]["output_tok_s"] = 9.7
    assert _one(cells).met is False


def test_a_low_acceptance_cell_where_it_drafted_nothing_says_so() -> None:
    """Where dsde-goodput ran target-only's step schedule its gap is timing; the target is still judged by tokens/s,
    and the rounds that did draft are counted where the run kept them."""
    cells = [_cell("mixed", 1, "off", 10.0), _cell("mixed", 1, "static:1", 8.0), _cell("mixed", 1, "dsde", 7.0),
             _cell("mixed", 1, "dsde-goodput", 9.5)]
    for c, sl in zip(cells, ([0, 0, 0], [1, 1], [3, 2], [0, 0, 0]), strict=True):
        c["requests"] = [{"sl": sl}]
    assert (_one(cells).figure, _one(cells).met) == ("0.950x; drafted nothing", False)
    cells[-1]["sl_means"] = [2.6, 0.0, 1.3]  # the median run drafted nothing, two other rounds did
    assert _one(cells).figure == "0.950x; median run drafted nothing (2/3 rounds drafted)"
    cells[-1]["requests"] = [{"sl": [0, 1, 0]}]  # it drafted once: no such remark
    assert _one(cells).figure == "0.950x"


def test_a_run_without_static_k_does_not_judge_low_acceptance() -> None:
    """DSDE below target-only alone does not make a low-acceptance regime: every static k must be below it too."""
    cells = [_cell("mixed", 8, "off", 10.0), _cell("mixed", 8, "dsde", 9.0), _cell("mixed", 8, "dsde-goodput", 9.5)]
    assert tg.goodput(_doc(cells)) == [] and not tg.low_acceptance(cells)


def test_mixed_must_beat_the_best_static_k_and_dsde_strictly() -> None:
    cells = [_cell("mixed", 4, "off", 10.0), _cell("mixed", 4, "static:2", 12.0), _cell("mixed", 4, "dsde", 11.0),
             _cell("mixed", 4, "dsde-goodput", 12.0)]
    t = _one(cells)
    assert t.name == "dsde-goodput ahead of the best static k and DSDE+cap on mixed (tokens/s)" and t.met is False
    cells[-1]["metrics"]["output_tok_s"] = 12.5
    assert _one(cells).met is True
    for c in cells:  # elsewhere a tie is enough
        c["workload"] = "code"
    cells[-1]["metrics"]["output_tok_s"] = 12.0
    assert _one(cells).name == "dsde-goodput at least the best static k and DSDE+cap (tokens/s)" and _one(cells).met


def test_throughput_targets_compare_with_the_static_k_of_the_best_tokens_per_second() -> None:
    """Static-opt is picked by mean latency; a throughput target is held against the best static k by tokens/s."""
    cells = [_cell("code", 4, "off", 10.0), _cell("code", 4, "static:2", 13.0), _cell("code", 4, "static:3", 12.0),
             _cell("code", 4, "static-opt", 12.0, static_opt_k=3), _cell("code", 4, "dsde", 11.0),
             _cell("code", 4, "dsde-goodput", 12.5)]
    assert (_one(cells).figure, _one(cells).met) == ("0.962x static:2, 1.136x DSDE", False)


def test_dsde_ahead_of_goodput_misses_the_target() -> None:
    cells = [_cell("code", 1, "off", 10.0), _cell("code", 1, "static:8", 12.0), _cell("code", 1, "dsde", 13.2),
             _cell("code", 1, "dsde-goodput", 13.0)]
    assert (_one(cells).figure, _one(cells).met) == ("1.083x static:8, 0.985x DSDE", False)


def test_the_rounds_of_a_repeated_run_count_those_dsde_goodput_was_ahead_in() -> None:
    """The verdict takes each policy's median run; the figure counts the rounds (round-robin: a round's runs share the
    machine's load) in which dsde-goodput's wall beat the policy it is judged against."""
    cells = [_cell("chat", 4, "off", 10.0), _cell("chat", 4, "static:2", 12.0), _cell("chat", 4, "dsde", 11.0),
             _cell("chat", 4, "dsde-goodput", 11.7)]
    cells[1]["walls_s"], cells[3]["walls_s"] = [10.0, 9.4, 10.0], [10.0, 10.0, 9.8]
    assert _one(cells).figure == "0.975x static:2, 1.064x DSDE, ahead in 1/3 rounds"
    cells[3]["walls_s"] = [10.0, 10.0]  # rounds that do not pair up are not compared
    assert "rounds" not in _one(cells).figure
    low = [_cell("chat", 4, "off", 10.0, 1.0, walls_s=[10.0, 10.0, 8.0]), _cell("chat", 4, "static:2", 8.0, 1.0),
           _cell("chat", 4, "dsde", 7.0, 1.0), _cell("chat", 4, "dsde-goodput", 9.5, 1.0, walls_s=[10.5, 9.0, 10.0])]
    assert _one(low).figure == "0.950x, ahead in 1/3 rounds"  # against target-only in the low-acceptance regime


def test_a_collapse_with_batch_size_is_caught() -> None:
    cells = [_cell("mixed", b, "dsde-goodput", v) for b, v in ((1, 10.0), (4, 20.0), (16, 17.0))]
    [t] = tg.goodput(_doc(cells))
    assert t.where == "mixed T=0" and t.figure == "1->4 2.00x, 4->16 0.85x" and t.met is False
    cells[-1]["metrics"]["output_tok_s"] = 18.5
    assert tg.goodput(_doc(cells))[0].met is True


def test_the_simulator_judges_the_gpu_profile_and_the_cells_where_no_static_k_pays() -> None:
    def sim_cells(p: str, w: str, so: float, dsde: float, goodput: float) -> list[dict[str, Any]]:
        return [{"profile": p, "workload": w, "batch": 4, "policy": x, "metrics": {"speedup": v}}
                for x, v in (("static-opt", so), ("dsde", dsde), ("dsde-goodput", goodput))]

    sim = {"cells": sim_cells("gpu", "code", 5.0, 6.0, 6.6) + sim_cells("gpu", "mixed", 4.0, 3.0, 3.88)
           + sim_cells("cpu", "chat", 0.8, 0.7, 0.97) + sim_cells("cpu", "code", 0.9, 0.6, 1.0)}
    found = {(t.name, t.where): (t.figure, t.met) for t in tg.simulated(sim)}
    assert found["dsde-goodput at least Static-opt and DSDE+cap (gpu profile)", "code b4"] == ("1.10x", True)
    assert found["dsde-goodput ahead of Static-opt and DSDE+cap on mixed (gpu profile)", "mixed b4"] == ("0.97x", False)
    assert found["dsde-goodput never below target-only (>= 0.98x) where no static k pays", "cpu"] == (
        "1/2 cells, lowest 0.97x", False)
    assert ("dsde-goodput at least Static-opt and DSDE+cap (gpu profile)", "chat b4") not in found  # cpu: not judged


def test_the_closed_batch_simulator_run_is_held_against_one_static_k_for_all_its_prompts() -> None:
    def cells(w: str, tok_s: dict[str, float]) -> list[dict[str, Any]]:
        return [{"profile": "engine", "workload": w, "batch": 4, "policy": p, "metrics": {"output_tok_s": v}}
                for p, v in tok_s.items()]

    doc = {"cells": cells("chat", {"off": 20.0, "static:1": 24.0, "static:2": 25.0, "dsde": 22.0, "dsde-goodput": 25.5})
           + cells("mixed", {"off": 20.0, "static:2": 26.0, "dsde": 23.0, "dsde-goodput": 25.0}),
           "meta": {"command": "dsde bench --simulate --sim-closed"}}
    text = sections.closed_batches(doc)
    assert "| engine | chat | 1.020, 0.880 (2) |" in text and "| engine | mixed | 0.962, 0.885 (2) |" in text
    assert "at least that k in 1 of 2 rows" in text and "`dsde bench --simulate --sim-closed`" in text


def test_every_run_of_make_bench_goodput_gets_its_section_with_its_targets(tmp_path) -> None:
    res = tmp_path / "results"
    res.mkdir()
    low = [_cell("chat", 1, p, v, 1.0) for p, v in (("off", 10.0), ("static:1", 9.0), ("dsde", 8.0),
                                                   ("dsde-goodput", 9.9))]
    weak = [_cell("mixed", 1, p, v) for p, v in (("off", 10.0), ("static:1", 7.0), ("dsde", 6.0),
                                                 ("dsde-goodput", 10.0))]
    (res / "goodput_lowacc.json").write_text(json.dumps(_doc(low)))
    (res / "goodput_weak.json").write_text(json.dumps({**_doc(weak), "backend": {"draft_noise": 8.0}}))
    page = report.render(res)
    lowacc = page.split("## Low acceptance: chat at T=1")[1].split("\n## ")[0]
    assert "`make bench-lowacc` ran `dsde bench ...`" in lowacc and "| best static k | 0.90 (k=1) |" in lowacc
    assert "| dsde-goodput | 0.99 / 1.10 |" in lowacc and "Targets, 1/1 met:" in lowacc
    weak_section = page.split("## A weak draft")[1].split("\n## ")[0]
    assert weak_section.startswith("\n\nDraft logits with Gaussian noise of std 8.") and "1.000x ✓" in weak_section
