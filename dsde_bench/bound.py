"""DSDE's bound on SL_max for this machine, picked on one seed's prompts (and judged on another seed's).

DSDE's SL_max comes from the warm-up (the longest accepted run, scaled up by the KLD ratio), bounded by MAX
(`dsde:MAX`, default 20). The default suits GPUs, where a draft token costs a few percent of a target step; on a
CPU it costs a third, and DSDE's long runs past the first rejection are paid in full. The pick: the MAX whose
mean request latency, relative to target-only decoding on the same prompts, has the lowest geometric mean over
the workloads of a `dsde bench` run (T=0, batch 1).

    python -m dsde_bench.bound results/dsde_bound_pick.json     # prints MAX
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsde_core.errors import ConfigError
from dsde_core.policies.dsde import DSDEConfig


def bound_of(policy: str) -> int | None:
    """'dsde:6' -> 6, 'dsde' -> the default bound, anything else -> None (DSDE with the cap only)."""
    name, sep, arg = policy.partition(":")
    if name != "dsde":
        return None
    return int(arg) if sep else DSDEConfig.max_sl


def bound_ratios(cells: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """MAX -> workload -> mean latency / target-only's on the same prompts (T=0, batch 1 cells)."""
    out: dict[int, dict[str, float]] = {}
    cells = [c for c in cells if c["temperature"] == 0.0 and c["batch"] == 1]
    for w in sorted({c["workload"] for c in cells}):
        cs = [c for c in cells if c["workload"] == w]
        off = next((c["metrics"]["mean_e2e_s"] for c in cs if c["policy"] == "off"), None)
        if not off:
            continue
        for c in cs:
            n = bound_of(c["policy"])
            if n is not None:
                out.setdefault(n, {})[w] = c["metrics"]["mean_e2e_s"] / off
    return dict(sorted(out.items()))


def bound_scores(cells: Sequence[dict[str, Any]]) -> dict[int, float]:
    """MAX -> geometric mean over workloads of mean latency / target-only's (T=0, batch 1 cells)."""
    return {n: math.exp(sum(math.log(r) for r in by_w.values()) / len(by_w))
            for n, by_w in bound_ratios(cells).items()}


def pick_bound(doc: dict[str, Any]) -> int:
    scores = bound_scores(doc["cells"])
    if not scores:
        raise ConfigError("no DSDE cells with a target-only reference at T=0, batch 1 to pick a bound from")
    return min(scores, key=lambda n: (scores[n], n))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m dsde_bench.bound RESULTS.json", file=sys.stderr)
        return 2
    try:
        print(pick_bound(json.loads(Path(args[0]).read_text())))
    except (OSError, ValueError, KeyError, ConfigError) as e:
        print(f"dsde_bench.bound: {args[0]}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
