"""benchmarks/step_context.py on a scripted bench document (no models): it keeps full decode steps only and finds
the line target time follows."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_context.py"


def _run(tmp_path: Path, doc: dict) -> subprocess.CompletedProcess:
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(doc))
    return subprocess.run([sys.executable, str(SCRIPT), str(f)], capture_output=True, text=True, timeout=60)


def test_padded_keys_explain_a_time_that_follows_them(tmp_path: Path) -> None:
    # batch 4; target seconds = 80 ms + 20 us per padded key (4 x Kmax); the rows' sum varies independently
    rows = []
    for i, kmax in enumerate(range(100, 700, 25)):
        total = 4 * kmax - (i % 5) * 90  # staggered rows: padding of 0..360 keys
        rows.append([4, 0, 0, 0.0, 0.080 + 20e-6 * 4 * kmax, 0, total, kmax])
    noise = [[4, 3, 2, 0.05, 9.9, 0, 800, 200],  # drafted: left out
             [4, 0, 0, 0.00, 9.9, 1, 800, 200],  # carried a prompt: left out
             [3, 0, 0, 0.00, 9.9, 0, 600, 200]]  # not the cell's batch: left out
    doc = {"steps": [{"workload": "chat", "temperature": 1.0, "batch": 4, "policy": "off", "steps": rows + noise}]}
    out = _run(tmp_path, doc)
    assert out.returncode == 0, out.stderr
    assert re.search(rf"chat T=1 b4 off\s+{len(rows)}\s", out.stdout)
    padded = re.search(r"= ([\d.]+) ms \+ ([\d.]+) us x B x Kmax \(R\^2 ([\d.]+)", out.stdout)
    assert padded and abs(float(padded[1]) - 80.0) < 0.1 and abs(float(padded[2]) - 20.0) < 0.01
    assert float(padded[3]) > 0.999
    by_sum = re.search(r"us x sum of contexts \(R\^2 ([\d.]+)", out.stdout)
    assert by_sum and float(by_sum[1]) < float(padded[3])


def test_a_run_without_contexts_is_refused_by_name(tmp_path: Path) -> None:
    doc = {"steps": [{"workload": "chat", "temperature": 1.0, "batch": 4, "policy": "off",
                      "steps": [[4, 0, 0, 0.0, 0.1, 0]]}]}
    out = _run(tmp_path, doc)
    assert out.returncode != 0 and "carry no contexts" in out.stderr and "Traceback" not in out.stderr
