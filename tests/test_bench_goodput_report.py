"""The issue-7 section of BENCHMARKS.md: each target is judged from the cells' figures."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from dsde_bench import goodput_report, provenance


def _cell(w: str, b: int, policy: str, tok_s: float, t: float = 0.0, **extra: Any) -> dict[str, Any]:
    return {"workload": w, "temperature": t, "batch": b, "policy": policy, "label": policy,
            "metrics": {"output_tok_s": tok_s, "mean_e2e_s": 1.0 / tok_s, "speedup": 1.0}, **extra}


def _git(repo: Path, *args: str) -> str:
    """A git command in a scratch repository (its own author): its stdout."""
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def _write(repo: Path, path: str, text: str) -> None:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)


def _doc(cells: list[dict[str, Any]]) -> dict[str, Any]:
    return {"cells": cells, "backend": {}, "meta": {"command": "dsde bench ..."}, "elapsed_s": 1.0}


def test_low_acceptance_cell_is_judged_against_target_only() -> None:
    cells = [_cell("chat", 1, "off", 10.0, 1.0), _cell("chat", 1, "static:2", 8.0, 1.0),
             _cell("chat", 1, "dsde", 7.0, 1.0), _cell("chat", 1, "dsde-goodput", 9.9, 1.0)]
    [(name, figure, ok)] = goodput_report.targets({"goodput_lowacc": _doc(cells)})
    assert name.startswith("low acceptance") and ok and "0.990x" in figure
    assert "drafted nothing" not in figure
    cells[-1]["metrics"]["output_tok_s"] = 9.7
    assert goodput_report.targets({"g": _doc(cells)})[0][2] is False


def test_a_low_acceptance_cell_where_it_drafted_nothing_says_the_work_was_target_onlys() -> None:
    """Where dsde-goodput ran target-only's step schedule (it drafted nothing) the figure says a gap is timing, and
    the target is still judged by tokens/s."""
    cells = [_cell("mixed", 1, "off", 10.0), _cell("mixed", 1, "static:1", 8.0), _cell("mixed", 1, "dsde", 7.0),
             _cell("mixed", 1, "dsde-goodput", 9.5)]
    for c, sl in zip(cells, ([0, 0, 0], [1, 1], [3, 2], [0, 0, 0]), strict=True):
        c["requests"] = [{"sl": sl}]
    [(_, figure, ok)] = goodput_report.targets({"goodput_weak": _doc(cells)})
    assert ok is False and "0.950x" in figure and "drafted nothing" in figure
    cells[-1]["sl_means"] = [0.0, 0.0, 0.0]  # no round drafted
    assert "any gap is timing noise" in goodput_report.targets({"goodput_weak": _doc(cells)})[0][1]
    cells[-1]["sl_means"] = [2.6, 0.0, 1.3]  # the median run drafted nothing, two other rounds did
    figure = goodput_report.targets({"goodput_weak": _doc(cells)})[0][1]
    assert "its median run drafted nothing" in figure and "timing noise" not in figure
    assert "round 1 and round 3 of 3 (SL mean 2.60/0.00/1.30 round by round)" in figure
    cells[-1]["requests"] = [{"sl": [0, 1, 0]}]  # it drafted once: no such remark
    assert "drafted nothing" not in goodput_report.targets({"goodput_weak": _doc(cells)})[0][1]


def test_a_run_without_static_k_does_not_judge_low_acceptance() -> None:
    """DSDE below target-only alone does not make a low-acceptance regime: every static k must be below it too."""
    cells = [_cell("mixed", 8, "off", 10.0), _cell("mixed", 8, "dsde", 9.0), _cell("mixed", 8, "dsde-goodput", 9.5)]
    assert goodput_report.targets({"goodput_batch": _doc(cells)}) == []


def test_mixed_must_beat_static_opt_and_dsde_strictly() -> None:
    cells = [_cell("mixed", 4, "off", 10.0), _cell("mixed", 4, "static:2", 12.0),
             _cell("mixed", 4, "static-opt", 12.0, static_opt_k=2), _cell("mixed", 4, "dsde", 11.0),
             _cell("mixed", 4, "dsde-goodput", 12.0)]
    [(_, _, ok)] = goodput_report.targets({"goodput": _doc(cells)})
    assert ok is False  # a tie is not "faster than both" on mixed
    cells[-1]["metrics"]["output_tok_s"] = 12.5
    assert goodput_report.targets({"goodput": _doc(cells)})[0][2] is True


def test_throughput_targets_compare_with_the_static_k_of_the_best_tokens_per_second() -> None:
    """Static-opt is picked by mean latency; a throughput target is held against the best static k by tokens/s."""
    cells = [_cell("code", 4, "off", 10.0), _cell("code", 4, "static:2", 13.0), _cell("code", 4, "static:3", 12.0),
             _cell("code", 4, "static-opt", 12.0, static_opt_k=3), _cell("code", 4, "dsde", 11.0),
             _cell("code", 4, "dsde-goodput", 12.5)]
    [(_, figure, ok)] = goodput_report.targets({"bench": _doc(cells)})
    assert ok is False and "0.962x Static-opt by tokens/s (static:2), 0.962x by mean latency" in figure


def test_a_cell_behind_by_tokens_per_second_but_not_by_mean_latency_is_named() -> None:
    """A closed batch's tokens/s is set by its last request: the reading names a cell where the two measures part,
    while the target stays judged by tokens/s."""
    cells = [_cell("mixed", 4, "off", 10.0), _cell("mixed", 4, "static:2", 12.0), _cell("mixed", 4, "dsde", 11.0),
             _cell("mixed", 4, "dsde-goodput", 11.6)]
    cells[-1]["metrics"]["mean_e2e_s"] = cells[1]["metrics"]["mean_e2e_s"] * 0.98
    [(_, figure, ok)] = goodput_report.targets({"bench": _doc(cells)})
    assert ok is False and "0.967x Static-opt by tokens/s (static:2), 1.020x by mean latency" in figure
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    assert "Behind by tokens/s, not by mean latency**: mixed T=0 b4 (0.967x by tokens/s, 1.020x by mean" in text
    cells[-1]["metrics"]["mean_e2e_s"] = cells[1]["metrics"]["mean_e2e_s"] * 1.02  # behind by both: not named
    assert "Behind by tokens/s" not in goodput_report.reading({"bench": _doc(cells)}, None)


def test_the_rounds_of_a_repeated_run_are_shown_beside_the_median_verdict() -> None:
    """Each policy's median run sets the verdict; the round-by-round wall ratios (round-robin: a round's runs shared
    the machine's load) show whether a miss is within the run-to-run spread (ahead in at least half the rounds) or a
    shortfall (behind in most; at T > 0, where each of dsde-goodput's runs draws its own tokens, only behind in every
    round is a verdict)."""
    cells = [_cell("chat", 4, "off", 10.0), _cell("chat", 4, "static:2", 12.0), _cell("chat", 4, "dsde", 11.0),
             _cell("chat", 4, "dsde-goodput", 11.7)]
    cells[1]["walls_s"], cells[3]["walls_s"] = [10.0, 9.4, 10.0], [10.0, 10.0, 9.8]
    [(_, figure, ok)] = goodput_report.targets({"bench": _doc(cells)})
    assert ok is False and "1.000/0.940/1.020x by wall time round by round" in figure
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    assert ("Behind in most rounds (at T > 0: in every round), so a shortfall rather than noise: chat T=0 b4 against "
            "static:2 1.000/0.940/1.020x (ahead in 1 of 3)") in text
    assert "within this machine's run-to-run spread" not in text
    cells[3]["walls_s"] = [10.0, 9.0, 9.8]  # ahead in 2 of 3: within the spread
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    assert "run-to-run spread: chat T=0 b4 against static:2" in text and "shortfall" not in text
    for c in cells:  # at T > 0 each run of dsde-goodput draws its own tokens: behind in most rounds is not a verdict
        c["temperature"] = 1.0
    cells[3]["walls_s"] = [10.0, 10.0, 9.8]  # behind in 2 of 3 again
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    assert "Behind in most rounds at T > 0, which does not settle it" in text and "chat T=1 b4 against static:2" in text
    assert "shortfall" not in text
    cells[3]["walls_s"] = [10.0, 10.0]  # rounds that do not pair up are not compared
    assert "round by round" not in goodput_report.targets({"bench": _doc(cells)})[0][1]
    assert "Run to run" not in goodput_report.reading({"bench": _doc(cells)}, None)


def test_the_plans_of_each_round_are_shown_where_the_run_kept_them() -> None:
    """Where a run kept every round's SL mean and acceptance (sl_means, acceptance_rates), the reading gives
    dsde-goodput's beside the policy it is behind, so a slow round can be told apart (other plans or the machine's
    load); a run that kept only its median run's figures reads as before."""
    cells = [_cell("chat", 4, "off", 10.0), _cell("chat", 4, "static:1", 12.0), _cell("chat", 4, "dsde", 11.0),
             _cell("chat", 4, "dsde-goodput", 11.7)]
    for c in cells:
        c["temperature"] = 1.0
    cells[1]["walls_s"], cells[3]["walls_s"] = [9.5, 9.6, 9.4], [10.0, 10.0, 9.8]
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    # behind in every round at T > 0: a shortfall (each round draws other tokens, and none of them put it ahead)
    assert ("shortfall rather than noise: chat T=1 b4 against static:1 0.950/0.960/0.959x (ahead in 0 of 3)" in text
            and "SL mean" not in text and "does not settle it" not in text)
    cells[1]["sl_means"], cells[1]["acceptance_rates"] = [0.97, 0.98, 0.97], [0.78, 0.77, 0.75]
    cells[3]["sl_means"], cells[3]["acceptance_rates"] = [1.12, 1.24, 1.23], [0.66, 0.66, 0.7]
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    assert ("(ahead in 0 of 3; SL mean 1.12/1.24/1.23 against 0.97/0.98/0.97, acceptance 0.66/0.66/0.70 against "
            "0.78/0.77/0.75)") in text
    cells[1]["sl_means"] = [0.97, 0.98]  # rounds that do not pair up are not shown
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    assert "SL mean" not in text and "acceptance 0.66/0.66/0.70" in text


def test_the_rounds_against_dsde_are_shown_where_it_is_behind_dsde() -> None:
    """A cell behind DSDE with the cap gives DSDE's round-by-round walls too, and the reading judges them as it judges
    the static k's; a policy it is ahead of is not listed there, nor DSDE's rounds in a cell it is ahead of DSDE."""
    cells = [_cell("code", 1, "off", 10.0), _cell("code", 1, "static:8", 12.0), _cell("code", 1, "dsde", 13.2),
             _cell("code", 1, "dsde-goodput", 13.0)]
    cells[1]["walls_s"], cells[2]["walls_s"], cells[3]["walls_s"] = [11.0, 11.0, 11.0], [9.7, 9.5, 10.2], [10.0] * 3
    [(_, figure, ok)] = goodput_report.targets({"bench": _doc(cells)})
    assert ok is False and "0.985x DSDE (0.970/0.950/1.020x round by round)" in figure
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    assert "shortfall rather than noise: code T=0 b1 against DSDE 0.970/0.950/1.020x (ahead in 1 of 3)" in text
    assert "against static:8" not in text
    cells[2]["metrics"]["output_tok_s"] = 12.9
    [(_, figure, ok)] = goodput_report.targets({"bench": _doc(cells)})
    assert ok is True and figure.endswith("1.008x DSDE")


def test_the_closed_batch_simulator_run_is_held_against_one_static_k_for_all_its_prompts() -> None:
    def cells(w: str, tok_s: dict[str, float]) -> list[dict[str, Any]]:
        return [{"profile": "engine", "workload": w, "batch": 4, "policy": p, "metrics": {"output_tok_s": v}}
                for p, v in tok_s.items()]

    doc = {"cells": cells("chat", {"off": 20.0, "static:1": 24.0, "static:2": 25.0, "dsde": 22.0, "dsde-goodput": 25.5})
           + cells("mixed", {"off": 20.0, "static:2": 26.0, "dsde": 23.0, "dsde-goodput": 25.0}),
           "traces": [{"workload": "chat", "prompts": 16}], "meta": {"command": "dsde bench --simulate --sim-closed"}}
    text = goodput_report.closed_table(doc)
    assert "| engine | chat | 4 | 16 | static:2 (25.0) | 25.5 | 1.020x | 0.880x |" in text
    assert "| engine | mixed | 4 | - | static:2 (26.0) | 25.0 | 0.962x | 0.885x |" in text
    assert "at least as fast as that k in 1 of 2 rows" in text and "`dsde bench --simulate --sim-closed`" in text
    assert "no closed-batch simulator run" in goodput_report.closed_table(None)
    assert "More prompts in closed batches" in goodput_report.section({}, {"cells": []}, doc)


def test_collapse_with_batch_size_is_caught() -> None:
    cells = [_cell("mixed", b, "dsde-goodput", v) for b, v in ((1, 10.0), (4, 20.0), (16, 17.0))]
    rows = [t for t in goodput_report.targets({"goodput_batch": _doc(cells)}) if t[0].startswith("no collapse")]
    assert rows and rows[0][2] is False and "4->16: 0.85x" in rows[0][1]


def test_reading_reports_the_sl_chosen_against_static_opt() -> None:
    """The SL against Static-opt's k (picked by latency), and the best static k by tokens/s where it differs; the
    throughput against the best static k by tokens/s."""
    cells = [_cell("code", 1, "off", 10.0), _cell("code", 1, "static:4", 15.0), _cell("code", 1, "static:2", 16.0),
             _cell("code", 1, "static-opt", 15.0, static_opt_k=4), _cell("code", 1, "dsde", 14.0),
             _cell("code", 1, "dsde-goodput", 16.0)]
    cells[-1]["metrics"]["sl_mean"] = 5.25
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    assert "code T=0 b1 5.2/4 (k=2 by tokens/s)." in text and "1.00x to 1.00x of its throughput" in text
    cells[2]["metrics"]["output_tok_s"] = 14.0  # now k=4 is the best by both measures: named once
    assert "code T=0 b1 5.2/4." in goodput_report.reading({"bench": _doc(cells)}, None)


def test_reading_judges_the_gpu_profile_cells_of_the_simulator() -> None:
    def sim_cells(w: str, so: float, dsde: float, goodput: float) -> list[dict[str, Any]]:
        return [{"profile": "gpu", "workload": w, "batch": 4, "policy": p, "metrics": {"speedup": v}}
                for p, v in (("static-opt", so), ("dsde", dsde), ("dsde-goodput", goodput))]

    sim = {"cells": sim_cells("code", 5.0, 6.0, 6.6) + sim_cells("mixed", 4.0, 3.0, 3.9)}
    text = goodput_report.reading({}, sim)
    assert "code b4 1.10x, mixed b4 0.97x; at least as fast in 1 of 2, faster on mixed in 0 of 1." in text
    assert "each cell from a fresh policy" in text  # the sweep says whether dsde-goodput was warmed up
    warm = goodput_report.reading({}, {**sim, "warm_traces": [{"workload": "code", "prompts": 4, "max_tokens": 64}]})
    assert "after a warm-up on 4 other prompts" in warm


def test_the_section_names_each_runs_machine_and_date() -> None:
    """Figures of different machines are not comparable: each run line says which CPU made it, and when."""
    doc = _doc([_cell("code", 1, "off", 10.0), _cell("code", 1, "dsde-goodput", 12.0)])
    doc["meta"] = {"command": "dsde bench --x", "created": "2026-11-25T00:18:08+00:00",
                   "machine": {"cpu": "AMD EPYC"}}
    text = goodput_report.section({"bench": doc}, None)
    assert "- `bench`: `dsde bench --x` (1 s, AMD EPYC, 2026-11-25)" in text
    del doc["meta"]["machine"]
    assert "(1 s, 2026-11-25)" in goodput_report.section({"bench": doc}, None)
    doc["meta"]["code"] = {"commit": "f58f5c4d0e1", "modified": False}
    assert "(1 s, 2026-11-25, commit f58f5c4)" in goodput_report.section({"bench": doc}, None)
    doc["meta"]["code"]["modified"] = True
    assert "(1 s, 2026-11-25, commit f58f5c4 with modified code)" in goodput_report.section({"bench": doc}, None)
    doc["meta"]["changed_during_run"] = True
    assert "commit f58f5c4 with modified code; the checkout changed while it ran)" in goodput_report.section(
        {"bench": doc}, None)


def test_the_section_names_runs_measured_before_the_engine_code_last_changed() -> None:
    """A figure describes the code it was measured with: runs whose commit predates the last change to the engine
    (or that record none) are named as such; a run at that change or after it is not."""
    change = provenance.last_change()
    assert change is not None  # this checkout's history (CI clones it too)
    commit, date = change
    old, new = (_doc([_cell("code", 1, "off", 10.0), _cell("code", 1, "dsde-goodput", 12.0)]) for _ in range(2))
    new["meta"] = {"code": {"commit": provenance.code_version()["commit"], "modified": False}}
    text = goodput_report.section({"goodput_old": old, "goodput_new": new}, None)
    assert (f"last changed in commit {commit[:7]} ({date}); `goodput_old` was measured before it or records no "
            "commit, so its dsde-goodput figures") in text
    assert "`goodput_new`" not in text.split("last changed in commit")[1]
    assert "last changed" not in goodput_report.section({"goodput_new": new}, None)
    assert provenance.contains(commit, commit) and not provenance.contains(None, commit)
    assert not provenance.contains("0" * 40, commit)  # a commit this checkout lacks


def test_a_commit_marked_figures_unchanged_is_not_a_change_to_the_engine(tmp_path: Path) -> None:
    """A change anywhere under dsde_core/ counts (a model's forward sets every step's time as much as a policy sets its
    plan); the benchmark's own code and the docs do not. A refactor checked to give identical figures says so in a
    trailer; the runs before it stay current."""
    def git(*args: str) -> str:
        return _git(tmp_path, *args)

    def commit(text: str, message: str, path: str = "dsde_core/policies/p.py") -> str:
        _write(tmp_path, path, text)
        git("add", ".")
        git("commit", "-q", "-m", message)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    first = commit("a = 1\n", "the policy")
    assert provenance.last_change(repo=tmp_path)[0] == first
    commit("a = 1  # folded\n", f"fold a helper\n\n{provenance.UNCHANGED} the simulator's cells are identical")
    assert provenance.last_change(repo=tmp_path)[0] == first
    second = commit("a = 2\n", f"a new rule; the old one said {provenance.UNCHANGED} in its body text")
    assert provenance.last_change(repo=tmp_path)[0] == second  # only a trailer line marks it
    third = commit("b = 1\n", "the cost model the policy plans with", "dsde_core/cost.py")
    assert provenance.last_change(repo=tmp_path)[0] == third
    fourth = commit("c = 1\n", "a faster attention: every step's time changes", "dsde_core/models/llama.py")
    assert provenance.last_change(repo=tmp_path)[0] == fourth
    commit("d = 1\n", "the docs", "README.md")
    commit("e = 1\n", "the benchmark's report", "dsde_bench/report.py")
    assert provenance.last_change(repo=tmp_path)[0] == fourth


def test_a_scripts_run_records_its_command_machine_and_commit() -> None:
    """benchmarks/perf.py and the service script call run_meta(code) as `dsde bench` does, so the page can tell
    which code their figures describe."""
    code = provenance.code_version()
    meta = provenance.run_meta(code)
    assert meta["command"].startswith("python ") and meta["code"] == code and not meta["changed_during_run"]
    assert meta["machine"]["cpu_count"] >= 1 and meta["created"][:2] == "20"
    assert provenance.run_meta(None, "dsde bench --x", ["p.png"])["command"] == "dsde bench --x"
    assert provenance.run_meta({"commit": "0" * 40, "modified": False})["changed_during_run"]


def test_the_machine_probe_of_each_round_is_shown_and_same_phase_rounds_are_tallied() -> None:
    """Where a run kept the machine probe (ms of a fixed forward before and after each round), the reading gives the
    slower of each round's two probes for both policies, and how the rounds compare that ran in one phase of the
    machine's speed (all four probes within PHASE_TOLERANCE): on a machine whose speed moves in phases, a round in
    which one policy ran slow and the other fast says nothing about the policies."""
    cells = [_cell("chat", 4, "off", 10.0), _cell("chat", 4, "static:1", 12.0), _cell("chat", 4, "dsde", 11.0),
             _cell("chat", 4, "dsde-goodput", 11.7)]
    cells[1]["walls_s"], cells[3]["walls_s"] = [9.5, 9.6, 9.4], [10.0, 9.2, 9.8]
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    assert "(ahead in 1 of 3)" in text and "machine probe" not in text  # runs without probes read as before
    cells[1]["probe_ms"] = [[48.0, 49.0], [70.0, 71.0], [50.0, 48.0]]
    cells[3]["probe_ms"] = [[49.0, 70.0], [71.0, 69.0], [48.0, 50.0]]
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    # round 1: dsde-goodput's run crossed into the slow phase (70 > 1.15 x 48): not a same-phase round
    assert ("(ahead in 1 of 3; machine probe 70/71/50 against 49/71/50 ms, ahead in 1 of the 2 rounds run in one "
            "machine phase (probes within 15%))") in text
    cells[3]["probe_ms"][2] = [48.0, None]  # a round without a probe: no probe figures at all
    text = goodput_report.reading({"bench": _doc(cells)}, None)
    assert "(ahead in 1 of 3)" in text and "machine probe" not in text


def test_the_targets_give_the_rounds_and_those_in_one_machine_phase() -> None:
    """A target's figure gives the round-by-round walls against the policy it is judged by (the best static k, or
    target-only in the low-acceptance regime) and, where the run kept machine probes, in how many rounds both runs
    ran in one phase and how many of those dsde-goodput was ahead in."""
    cells = [_cell("chat", 4, "off", 10.0, 1.0), _cell("chat", 4, "static:2", 8.0, 1.0),
             _cell("chat", 4, "dsde", 7.0, 1.0), _cell("chat", 4, "dsde-goodput", 9.5, 1.0)]
    cells[0]["walls_s"], cells[3]["walls_s"] = [10.0, 10.0, 8.0], [10.5, 9.0, 10.0]
    [(name, figure, ok)] = goodput_report.targets({"bench": _doc(cells)})
    assert name.startswith("low acceptance") and ok is False
    assert figure.startswith("0.950x, 0.952/1.111/0.800x by wall time round by round (DSDE")
    cells[0]["probe_ms"] = [[70.0, 72.0], [48.0, 50.0], [50.0, 49.0]]
    cells[3]["probe_ms"] = [[71.0, 70.0], [70.0, 71.0], [48.0, 49.0]]  # round 2: dsde-goodput's run in the slow phase
    [(_, figure, _)] = goodput_report.targets({"bench": _doc(cells)})
    assert ("0.952/1.111/0.800x by wall time round by round (ahead in 0 of the 2 rounds run in one machine phase "
            "(probes within 15%)) (DSDE") in figure
    cells[3]["probe_ms"] = [[71.0, 70.0], [70.0, 71.0]]  # rounds that do not pair up: no phase tally
    [(_, figure, _)] = goodput_report.targets({"bench": _doc(cells)})
    assert "round by round (DSDE" in figure


def test_docs_are_not_code_to_a_runs_provenance(tmp_path: Path) -> None:
    """A run's meta says "modified" or "changed during the run" only for code: an uncommitted or newly committed
    README (any *.md) or results file does not count; a source file does, and so does a commit the checkout lacks."""
    def git(*args: str) -> str:
        return _git(tmp_path, *args)

    def write(path: str, text: str) -> None:
        _write(tmp_path, path, text)

    git("init", "-q")
    for path in ("README.md", "dsde_bench/runner.py", "results/bench.json"):
        write(path, "1\n")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    start = provenance.code_version(tmp_path)
    assert start is not None and start["modified"] is False
    write("README.md", "2\n")
    write("results/bench.json", "2\n")
    assert provenance.code_version(tmp_path)["modified"] is False  # docs and results: not code
    assert not provenance.changed_since(start, tmp_path)
    git("commit", "-q", "-am", "docs and results")
    assert not provenance.changed_since(start, tmp_path)  # a new commit, but no code in it
    write("dsde_bench/runner.py", "2\n")
    assert provenance.code_version(tmp_path)["modified"] is True and provenance.changed_since(start, tmp_path)
    git("commit", "-q", "-am", "the runner")
    assert provenance.changed_since(start, tmp_path)  # committed since the run started
    assert provenance.changed_since({"commit": "0" * 40, "modified": False}, tmp_path)  # a commit it lacks
    assert not provenance.changed_since(None, tmp_path / "nowhere") and provenance.changed_since(None, tmp_path)


def test_the_section_says_how_each_runs_rounds_were_ordered() -> None:
    """A repeated run names its rounds and the policies' order in them; a run whose config predates round_order ran
    them in a fixed order."""
    text = goodput_report._repeats_text
    assert text("a", {"repeats": 9, "round_order": "alternate"}) == (
        "a: median of 9 runs per cell (round-robin over the policies, every other round reversed)")
    assert text("b", {"repeats": 5}) == "b: median of 5 runs per cell (round-robin over the policies, in the same " \
                                        "order every round)"
    assert text("c", {"repeats": 1, "round_order": "alternate"}) == text("c", {}) == "c: one run per cell"
