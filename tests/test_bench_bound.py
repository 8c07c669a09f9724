"""DSDE's SL bound: picked from one run's cells (dsde_bench.bound), reported on another (BENCHMARKS.md section)."""

from __future__ import annotations

import json
import math

import pytest

from dsde_bench import bound, report
from dsde_bench.report import targets as tg
from dsde_core.errors import ConfigError
from tests.test_bench_report import _cell


def _pick_doc(chat8: float = 1.2) -> dict:
    # latency / target-only: dsde:4 -> 0.5, 0.9 (geo 0.671); dsde:8 -> 0.4, chat8 (1.2: geo 0.693); dsde -> 0.6, 1.1
    cells = []
    for w, rel in (("code", {"dsde:4": 0.5, "dsde:8": 0.4, "dsde": 0.6}),
                   ("chat", {"dsde:4": 0.9, "dsde:8": chat8, "dsde": 1.1})):
        cells.append(_cell(w, "off", 2.0, 10.0))
        cells += [_cell(w, p, 2.0 * r, 10.0) for p, r in rel.items()]
        cells.append(_cell(w, "dsde:4", 0.1, 10.0, bs=4))  # batch 4: not part of the pick
        cells.append(_cell(w, "static:4", 0.1, 10.0))  # not DSDE
    return {"kind": "bench", "config": {"seed": 2}, "cells": cells, "elapsed_s": 5.0,
            "meta": {"command": "dsde bench --seed 2"}}


def test_bound_of() -> None:
    assert bound.bound_of("dsde:6") == 6
    assert bound.bound_of("dsde") == 20
    assert bound.bound_of("dsde-nocap:6") is None and bound.bound_of("static:4") is None


def test_pick_is_the_lowest_geometric_mean() -> None:
    scores = bound.bound_scores(_pick_doc()["cells"])
    assert set(scores) == {4, 8, 20}
    assert scores[4] == pytest.approx(math.sqrt(0.5 * 0.9))
    assert scores[8] == pytest.approx(math.sqrt(0.4 * 1.2))
    assert bound.pick_bound(_pick_doc()) == 4  # dsde:8 wins on code alone, loses over both workloads


def test_pick_without_dsde_cells_is_an_error(tmp_path, capsys) -> None:
    doc = {"cells": [_cell("code", "off", 1.0, 1.0), _cell("code", "static:4", 1.0, 1.0)]}
    with pytest.raises(ConfigError):
        bound.pick_bound(doc)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert bound.main([str(path)]) == 1
    assert "no DSDE cells" in capsys.readouterr().err
    path.write_text(json.dumps(_pick_doc()))
    assert bound.main([str(path)]) == 0 and capsys.readouterr().out.strip() == "4"
    assert bound.main([]) == 2


def test_section_reports_the_pick_on_the_other_run(tmp_path) -> None:
    from dsde_bench.metrics import add_speedups, add_static_opt

    cells = [_cell("code", "off", 3.0, 10.0), _cell("code", "static:4", 1.0, 25.0),
             _cell("code", "dsde:4", 1.03, 24.0), _cell("code", "dsde", 1.4, 20.0),
             _cell("code", "hf-assisted", 1.5, 15.0, kind="anchor")]
    add_static_opt(cells)
    add_speedups(cells)
    doc = {"kind": "bench", "config": {"seed": 1}, "cells": cells, "elapsed_s": 9.0, "meta": {"command": "x"}}
    t = {t.name: t.met for t in tg.grid(doc, "dsde:4")}
    assert t["dsde:4 within 5% of the best static k (mean latency)"] is True  # 1.03
    assert t["dsde:4 ahead of hf-assisted (mean latency)"] is True
    assert not any(name.startswith("DSDE+cap") for name in t)
    res = tmp_path / "results"
    res.mkdir()
    (res / "dsde_bound_pick.json").write_text(json.dumps(_pick_doc()))
    (res / "dsde_bound.json").write_text(json.dumps(doc))
    page = report.write(res, tmp_path / "BENCHMARKS.md").read_text()
    section = page.split("## DSDE's SL bound for this machine")[1].split("\n## ")[0]
    assert "Picked on seed 2's prompts" in section and "Judged on seed 1's prompts" in section
    assert "| 4 (picked) | 0.900 | 0.500 | 0.671 |" in section  # columns chat, code; then the geometric mean
    assert "| dsde:4 within 5% of the best static k (mean latency) | 1.030x (k=4) ✓ | 1/1 |" in section
