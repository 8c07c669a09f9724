"""benchmarks/gpu_step.py, the device step's check for a lent GPU, run on this CPU with the tiny shapes (Triton
under its interpreter): every code path it takes on a GPU but CUDA's events, and the figures it must write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dsde_bench.sim.costs import load_costs_file

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_step_check_runs_on_the_cpu_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    cmd = [sys.executable, "benchmarks/gpu_step.py", "--tiny", "--device", "cpu", "--out", str(out),
           "--batches", "1,3", "--queries", "1,5", "--contexts", "24", "--repeats", "1", "--prompt-len", "8",
           "--max-tokens", "12", "--policies", "static:2,dsde-goodput", "--alphas", "0.5,1.0",
           "--costs-out", str(tmp_path / "costs_step.json")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] and len(doc["forwards"]) == 2 * 3 * 2 * 2  # models x attentions x batches x queries
    assert {(r[0], r[1]) for r in doc["forwards"]} == {(m, a) for m in ("target", "draft")
                                                       for a in ("torch", "triton", "static")}
    assert all(r[5] > 0 and r[6] > 0 for r in doc["forwards"])
    assert all(d < 1e-4 for d in doc["kernel_max_abs_diff"].values()), doc["kernel_max_abs_diff"]
    assert doc["verify"]["tokens_equal_cpu"] and doc["verify"]["host_syncs"] == 0
    tiny = doc["tiny_static"]
    assert tiny["static_max_abs_diff"] < 1e-4 and tiny["speculation_equals_target_only"]
    rows = doc["engine"]["rows"]  # [policy, batch, alpha, tokens/s, acceptance, lossless]
    assert len(rows) == 2 * (1 + 2 * 2)  # batches x (target-only + alphas x policies)
    assert all(r[3] > 0 and r[5] for r in rows)  # every run emitted, and what target-only did
    assert all(r[4] == 1.0 for r in rows if r[2] == 1.0)  # alpha 1: every drafted token accepted
    assert any(r[4] is not None and r[4] < 0.9 for r in rows if r[2] == 0.5)
    assert "x target" in done.stdout
    costs = load_costs_file("gpu-step", tmp_path / "costs_step.json")  # what make bench-sim prices with
    assert costs.table and all(s > 0 for _, s in costs.points["target"] + costs.points["draft"])
    assert "of floor" in done.stdout


def test_the_gpu_step_check_names_what_it_lacks() -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--out", "/tmp/x.json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "--configs DIR" in done.stderr and "Traceback" not in done.stderr
