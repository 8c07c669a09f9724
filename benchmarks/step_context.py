"""Where a cell's engine time goes, step by step, and what the contexts cost. Not a test.

    .venv/bin/python benchmarks/step_context.py results/diagnostics/FILE.json [...]

Reads a bench JSON whose steps carry contexts and tokens ([..., sum of the rows' contexts, the longest, tokens
emitted]: runs after 2026-11-27). The batched target forward gathers every row's keys up to the longest context
(runner: keys [B, kvh, Kmax, hd]), so a step attends over B x Kmax keys ("padded keys") whatever its rows hold.

Per cell and policy, its steps in three kinds: those that carried a prompt, decode steps (nothing drafted), steps
with drafts; their count, tokens emitted, target and draft seconds, and engine ms a token. Then over its steps at
the cell's batch size without a prompt: the mean padded keys (does the policy make the batch attend over more?),
and its decode steps' median target ms and median longest context. Then, per query tokens n = B + sum_k and draft
calls (levels), over the steps at the cell's batch size without a prompt: count, median target ms and median draft
ms. Last, over the decode steps of the files at each batch size, least-squares lines of target seconds against
padded keys and against the sum of contexts, with their R^2: the better line says which one the time follows.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from dsde_bench.metrics import StepRow


def cells(doc: dict) -> list[tuple[str, int, list[StepRow]]]:
    """(label, batch, step rows) per cell and policy; SystemExit for a run whose steps lack contexts."""
    out = []
    for c in doc.get("steps", []):
        if any(len(r) < len(StepRow._fields) for r in c["steps"]):
            raise SystemExit("this run's steps carry no contexts (it predates 2026-11-27): run it again")
        out.append((f"{c['workload']} T={c['temperature']:g} b{c['batch']} {c['policy']}", c["batch"],
                    [StepRow(*r) for r in c["steps"]]))
    return out


def kinds(rows: list[StepRow]) -> dict[str, list[StepRow]]:
    """The steps that carried a prompt, the decode steps (nothing drafted) and the steps with drafts."""
    out: dict[str, list[StepRow]] = {"prompt": [], "decode": [], "drafted": []}
    for r in rows:
        out["prompt" if r.prefill else "drafted" if r.sum_k else "decode"].append(r)
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
    decode_by_batch: dict[int, list[StepRow]] = {}
    by_shape: dict[tuple[int, int, int], list[StepRow]] = {}  # (batch, n, calls) -> steps without a prompt
    for path in args.files:
        for label, b, rows in cells(json.loads(path.read_text())):
            k = kinds(rows)
            for kind, steps in k.items():
                tokens = sum(r.emitted for r in steps)
                t, d = sum(r.target_s for r in steps), sum(r.draft_s for r in steps)
                per_token = f"{1e3 * (t + d) / tokens:.1f}" if tokens else "-"
                print(f"{label} {kind:8}: {len(steps):4} steps, {tokens:5.0f} tokens, target {t:5.1f} s, "
                      f"draft {d:5.1f} s, {per_token} ms a token")
            full = [r for r in k["decode"] + k["drafted"] if r.batch == b]
            decode = [r for r in k["decode"] if r.batch == b]
            decode_by_batch.setdefault(b, []).extend(decode)
            for r in full:
                by_shape.setdefault((b, int(r.batch + r.sum_k), int(r.calls)), []).append(r)
            if full:
                print(f"{label}: mean padded keys (B x Kmax) {statistics.mean(b * r.ctx_max for r in full):.0f} over "
                      f"{len(full)} steps without a prompt")
            if decode:
                print(f"{label}: decode steps' median {1e3 * statistics.median(r.target_s for r in decode):.1f} ms, "
                      f"median longest context {statistics.median(r.ctx_max for r in decode):.0f}")
    for (b, n, calls), steps in sorted(by_shape.items()):
        print(f"batch {b}, n = {n:3} query tokens, {calls} draft calls: {len(steps):4} steps, median target "
              f"{1e3 * statistics.median(r.target_s for r in steps):6.1f} ms, draft "
              f"{1e3 * statistics.median(r.draft_s for r in steps):6.1f} ms")
    for b, steps in sorted(decode_by_batch.items()):
        if len(steps) < 3:
            continue
        t = [r.target_s for r in steps]
        lines = (("B x Kmax", [b * r.ctx_max for r in steps]), ("sum of contexts", [r.ctx_sum for r in steps]))
        for name, x in lines:
            a, slope, r2 = fit(x, t)
            print(f"batch {b} decode steps: target s = {1e3 * a:.1f} ms + {1e6 * slope:.2f} us x {name} "
                  f"(R^2 {r2:.2f}, {len(steps)} steps)")


if __name__ == "__main__":
    main()
