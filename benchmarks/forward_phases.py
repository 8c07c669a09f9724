"""Is this machine steady enough to benchmark? One fixed target forward (batch 1, one query token over a context of
--context tokens), timed back to back for --seconds, its medians per --bucket seconds: identical work, so every
change between buckets is the machine's, not the engine's.

    python benchmarks/forward_phases.py [--seconds 20] [--bucket 2] [--context 140] [--runs 3]

Each run is a fresh process (the model loaded anew), since a state can hold for a whole process. On the 2-core AMD
EPYC of 2026-11-29 the same forward took ~47 ms in some runs and ~72 ms in others, and switched within a run, with
nothing else on the machine (results/diagnostics/README.md): a cell of a few seconds can fall in either, which is
why `dsde bench` runs its repeats round-robin over the policies, keeps medians, and times the same forward before
and after every round (dsde_bench/probe.py, `probe_ms` in its results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def bucket_medians(samples: list[tuple[float, float]], bucket_s: float) -> list[tuple[float, float]]:
    """(bucket start s, median ms) of (seconds since start, ms) samples, in time order."""
    buckets: dict[int, list[float]] = {}
    for t, ms in samples:
        buckets.setdefault(int(t // bucket_s), []).append(ms)
    return [(k * bucket_s, statistics.median(v)) for k, v in sorted(buckets.items())]


def phases(medians: list[float], gap: float = 0.2) -> list[list[float]]:
    """Consecutive bucket medians grouped while each stays within `gap` (relative) of its group's first."""
    groups: list[list[float]] = []
    for m in medians:
        if groups and abs(m - groups[-1][0]) <= gap * groups[-1][0]:
            groups[-1].append(m)
        else:
            groups.append([m])
    return groups


def measure(seconds: float, context: int) -> list[tuple[float, float]]:
    """(seconds since start, ms) of one target forward after another, on the default pair's target."""
    from dsde_bench.probe import fixed_forward_ms, prefill_probe
    from dsde_core.config import EngineConfig
    from dsde_core.llm import SpeculativeLLM

    runner = SpeculativeLLM.load(draft=None, config=EngineConfig(max_batch_size=1, max_seq_len=context + 8)
                                 ).engine.target.runner
    out = []
    prefill_probe(runner, 0, context)
    start = time.perf_counter()
    while (t := time.perf_counter() - start) < seconds:
        out.append((t, fixed_forward_ms(runner, 0, context)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--bucket", type=float, default=2.0)
    ap.add_argument("--context", type=int, default=140)
    ap.add_argument("--runs", type=int, default=3, help="fresh processes, one after another")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: print its samples as JSON
    a = ap.parse_args()
    if a.seconds <= 0 or a.bucket <= 0 or a.context < 1 or a.runs < 1:
        ap.error("--seconds and --bucket must be > 0, --context and --runs >= 1")
    if a.one:
        print(json.dumps(measure(a.seconds, a.context)))
        return
    for run in range(1, a.runs + 1):
        child = subprocess.run([sys.executable, __file__, "--one", "--seconds", str(a.seconds), "--context",
                                str(a.context)], capture_output=True, text=True, check=True)
        samples = json.loads(child.stdout.strip().splitlines()[-1])
        medians = bucket_medians(samples, a.bucket)
        groups = ", ".join(f"{statistics.median(g):.0f} ms x{len(g)}" for g in phases([m for _, m in medians]))
        print(f"run {run}: " + " ".join(f"{t:g}s:{m:.0f}" for t, m in medians) + f"  | phases: {groups}")


if __name__ == "__main__":
    main()
