"""benchmarks/forward_phases.py on scripted samples (no models): per-bucket medians, and consecutive buckets grouped
into the phases a shared machine's speed goes through; bad arguments are a clear error."""

from __future__ import annotations

import subprocess
import sys

from tests.bench_scripts import BENCHMARKS, script

SCRIPT = BENCHMARKS / "forward_phases.py"


def test_bucket_medians_and_phases_follow_a_machine_that_changes_speed() -> None:
    fp = script("forward_phases")
    # 3 s at ~70 ms a forward (one outlier), then 3 s at ~48 ms: two phases, whatever the outlier
    samples = [(0.07 * i, 70.0 + (i % 3)) for i in range(43)] + [(0.07 * 43, 400.0)]
    samples += [(3.0 + 0.048 * i, 48.0 - (i % 2)) for i in range(62)]
    medians = fp.bucket_medians(samples, 1.0)
    assert [t for t, _ in medians] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(70 <= m <= 72 for _, m in medians[:3]) and all(47 <= m <= 48 for _, m in medians[3:])
    groups = fp.phases([m for _, m in medians])
    assert [len(g) for g in groups] == [3, 3]
    assert [len(g) for g in fp.phases([50.0, 52.0, 70.0, 51.0])] == [2, 1, 1]  # a return is a phase of its own


def test_bad_arguments_are_a_clear_error() -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--seconds and --bucket must be > 0" in res.stderr and "Traceback" not in res.stderr
