"""benchmarks/step_context.py on a scripted bench document (no models): the time and tokens of each kind of step,
the padded keys, and the line decode time follows."""

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
    # batch 4 decode steps of 4 tokens; target seconds = 80 ms + 20 us per padded key (4 x Kmax); the rows' sum of
    # contexts varies apart from it
    rows = []
    for i, kmax in enumerate(range(100, 700, 25)):
        total = 4 * kmax - (i % 5) * 90  # staggered rows: padding of 0..360 keys
        rows.append([4, 0, 0, 0.0, 0.080 + 20e-6 * 4 * kmax, 0, total, kmax, 4])
    others = [[4, 3, 2, 0.08, 0.5, 0, 800, 200, 6],  # drafted: in the mean padded keys, not in the decode line
              [4, 0, 0, 0.00, 2.0, 1, 800, 200, 4],  # carried a prompt: in neither
              [3, 0, 0, 0.00, 0.4, 0, 600, 200, 3]]  # not the cell's batch: in neither
    doc = {"steps": [{"workload": "chat", "temperature": 1.0, "batch": 4, "policy": "off", "steps": rows + others}]}
    out = _run(tmp_path, doc)
    assert out.returncode == 0, out.stderr
    decode_s = sum(r[4] for r in rows) + 0.4
    decode_tokens = 4 * len(rows) + 3
    assert (f"chat T=1 b4 off decode  : {len(rows) + 1:4} steps, {decode_tokens:5} tokens, target {decode_s:5.1f} s, "
            f"draft   0.0 s, {1e3 * decode_s / decode_tokens:.1f} ms a token") in out.stdout
    drafted = "chat T=1 b4 off drafted :    1 steps,     6 tokens, target   0.5 s, draft   0.1 s, 96.7 ms a token"
    assert drafted in out.stdout
    padded = (sum(4 * r[7] for r in rows) + 800) / (len(rows) + 1)
    assert f"mean padded keys (B x Kmax) {padded:.0f} over {len(rows) + 1} steps" in out.stdout
    assert re.search(rf"batch 4, n =   4 query tokens, 0 draft calls: +{len(rows)} steps", out.stdout)
    assert re.search(r"batch 4, n =   7 query tokens, 2 draft calls: +1 steps, median target +500.0 ms, draft +80.0 ms",
                     out.stdout)
    by_padded = re.search(r"= ([\d.]+) ms \+ ([\d.]+) us x B x Kmax \(R\^2 ([\d.]+), (\d+) steps", out.stdout)
    assert by_padded and abs(float(by_padded[1]) - 80.0) < 0.1 and abs(float(by_padded[2]) - 20.0) < 0.01
    assert float(by_padded[3]) > 0.999 and int(by_padded[4]) == len(rows)
    by_sum = re.search(r"us x sum of contexts \(R\^2 ([\d.]+)", out.stdout)
    assert by_sum and float(by_sum[1]) < float(by_padded[3])


def test_a_run_without_contexts_is_refused_by_name(tmp_path: Path) -> None:
    doc = {"steps": [{"workload": "chat", "temperature": 1.0, "batch": 4, "policy": "off",
                      "steps": [[4, 0, 0, 0.0, 0.1, 0, 400, 100]]}]}  # contexts, no tokens
    out = _run(tmp_path, doc)
    assert out.returncode != 0 and "carry no contexts" in out.stderr and "Traceback" not in out.stderr
