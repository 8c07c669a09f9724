"""Decode steps' target time against the contexts they attend over, per policy. Not a test.

    .venv/bin/python benchmarks/step_context.py results/diagnostics/FILE.json [...]

Question it answers: does a policy's verify get slower because its rows drift apart? The batched target forward
gathers every row's keys up to the longest context (runner: keys [B, kvh, Kmax, hd]), so B x Kmax keys are read
whatever the rows hold. Reads a bench JSON whose steps carry contexts ([..., sum of contexts, longest], runs after
2026-11-27). For each cell and policy, the steps at the cell's batch size that drafted nothing and carried no
prompt: their count, median target ms, median longest context, median padded keys (B x Kmax) and the padding's
share of them. Then, over all those steps of the files at each batch size, least-squares lines of target seconds
against padded keys and against the sum of contexts, with their R^2: the better line says which one the time
follows.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np


def decode_steps(doc: dict) -> list[tuple[str, int, list[tuple[float, int, int]]]]:
    """Per cell and policy: (label, batch, [(target_s, sum of contexts, longest)]) of its full decode steps."""
    out = []
    for c in doc.get("steps", []):
        rows = [r for r in c["steps"] if len(r) >= 8]
        if len(rows) < len(c["steps"]):
            raise SystemExit("this run's steps carry no contexts (it predates 2026-11-27): run it again")
        b = c["batch"]
        picked = [(r[4], r[6], r[7]) for r in rows if r[0] == b and r[1] == 0 and not r[5]]
        out.append((f"{c['workload']} T={c['temperature']:g} b{b} {c['policy']}", b, picked))
    return out


def fit(x: list[float], y: list[float]) -> tuple[float, float, float]:
    """(a, b, R^2) of y = a + b x by least squares."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    (b, a), res, *_ = np.polyfit(xs, ys, 1, full=True)
    ss = float(((ys - ys.mean()) ** 2).sum())
    return float(a), float(b), 1.0 - float(res[0]) / ss if len(res) and ss > 0 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    pooled: dict[int, list[tuple[float, int, int]]] = {}
    print(f"{'cell / policy':40} {'steps':>5} {'target ms':>9} {'Kmax':>5} {'B x Kmax':>8} {'padding':>7}")
    for path in args.files:
        for label, b, steps in decode_steps(json.loads(path.read_text())):
            if not steps:
                print(f"{label:40} {0:5}")
                continue
            pooled.setdefault(b, []).extend(steps)
            pad = statistics.median(1 - s / (b * m) for _, s, m in steps)
            print(f"{label:40} {len(steps):5} {1e3 * statistics.median(t for t, *_ in steps):9.1f} "
                  f"{statistics.median(m for *_, m in steps):5.0f} {statistics.median(b * m for *_, m in steps):8.0f} "
                  f"{pad:7.1%}")
    for b, steps in sorted(pooled.items()):
        if len(steps) < 3:
            continue
        t = [s[0] for s in steps]
        for name, x in (("B x Kmax", [b * m for *_, m in steps]), ("sum of contexts", [s for _, s, _ in steps])):
            a, slope, r2 = fit(x, t)
            print(f"batch {b}: target s = {1e3 * a:.1f} ms + {1e6 * slope:.2f} us x {name} (R^2 {r2:.2f}, "
                  f"{len(steps)} steps)")


if __name__ == "__main__":
    main()
