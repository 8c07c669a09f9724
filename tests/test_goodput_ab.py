"""benchmarks/goodput_ab.py: a policy spec names today's policy or dsde-goodput as it was at a git revision."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsde_bench.metrics import StepRow
from dsde_core.errors import ConfigError
from dsde_core.policies import GoodputPolicy, SeqInfo, StaticPolicy
from tests.bench_scripts import script

ROOT = Path(__file__).resolve().parents[1]


def test_a_revisions_policy_is_loaded_beside_todays() -> None:
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    ab = script("goodput_ab")
    old = ab.build("dsde-goodput@HEAD")
    assert old.name == "dsde-goodput" and type(old) is not GoodputPolicy  # its own module's class
    assert type(old).__module__ == "goodput_at_HEAD"
    plans = old.plan([SeqInfo("a", 0.0, 8, remaining=40), SeqInfo("b", 0.0, 8, remaining=40)])
    assert len(plans) == 2 and all(p.k >= 0 for p in plans)
    assert isinstance(ab.build("static:1"), StaticPolicy) and isinstance(ab.build("dsde-goodput"), GoodputPolicy)
    with pytest.raises(ConfigError, match="no dsde_core/policies/goodput.py at git revision 'no-such-rev'"):
        ab.build("dsde-goodput@no-such-rev")
    with pytest.raises(ConfigError, match="only dsde-goodput takes @REV"):
        ab.build("static:1@HEAD")


def test_a_runs_steps_split_by_phase() -> None:
    """Every step lands in one phase: a prompt fed (whatever the batch), else the full batch drafting or not, else the
    tail; the medians are taken field by field over the runs."""
    ab = script("goodput_ab")
    rows = [StepRow(2, 0, 0, 0.0, 0.5, 1, emitted=2), StepRow(2, 3, 2, 0.1, 0.2, 0, emitted=5),
            StepRow(2, 0, 0, 0.0, 0.1, 0, emitted=2), StepRow(2, 0, 0, 0.0, 0.1, 0, emitted=2),
            StepRow(1, 2, 2, 0.05, 0.08, 0, emitted=2), StepRow(1, 0, 0, 0.0, 0.3, 1, emitted=1)]
    split = ab.phases(rows, batch=2)
    assert [(p.steps, p.emitted) for p in split.values()] == [(2, 3), (1, 5), (2, 4), (1, 2)]
    assert split["full, drafting"].draft_s == 0.1 and split["prefill"].target_s == pytest.approx(0.8)
    assert "2 steps" in str(split["prefill"]) and "266.7 ms a token" in str(split["prefill"])
    other = ab.phases(rows[:2], batch=2)
    med = ab.median_phases([split, other, other])
    assert med["prefill"].steps == 1 and med["tail"].emitted == 0
    assert str(med["tail"]).endswith("0 tokens,      - ms a token")


def test_fewer_slots_than_requests_in_flight_is_a_cli_error() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "goodput_ab.py"), "--batch", "4", "--max-batch",
                          "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--max-batch 2 is below --batch 4" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.real_models
@pytest.mark.parametrize(("batch", "max_batch"), [(1, None), (2, None), (1, 2)])
def test_out_keeps_every_runs_steps_as_bench_json_does(tmp_path: Path, batch: int, max_batch: int | None) -> None:
    """--out: per spec, per round, the run's steps as StepRow rows; over a run they emit every token asked for. The
    engine has --batch slots, or --max-batch's."""
    out = tmp_path / "ab.json"
    slots = [] if max_batch is None else ["--max-batch", str(max_batch)]
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "goodput_ab.py"), "--policies", "off,static:2",
                          "--workload", "chat", "--temperature", "0", "--batch", str(batch), *slots, "--num-prompts",
                          "3", "--max-tokens", "5", "--warm-requests", "1", "--rounds", "2", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"b{batch} on an engine of {max_batch or batch} slots" in res.stdout, res.stdout
    doc = json.loads(out.read_text())
    assert set(doc["walls_s"]) == set(doc["steps"]) == {"off", "static:2"}
    for spec, rounds in doc["steps"].items():
        assert len(rounds) == len(doc["walls_s"][spec]) == 2
        for rows in rounds:
            steps = [StepRow(*r) for r in rows]
            assert sum(s.emitted for s in steps) == 3 * 5  # --ignore-eos: every request runs max_tokens
            assert sum(s.prefill for s in steps) >= 2  # the third prompt enters after the first (batch 1) or two
            assert all(s.sum_k == 0 for s in steps) == (spec == "off")
    assert "where the time went" in res.stdout and res.stdout.count("full, not drafting") == 2, res.stdout
