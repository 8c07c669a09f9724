"""dsde-goodput's plans row by row in one cell, run as benchmarks/goodput_ab.py runs it: where it drafts, where it
does not, and what it knew then. Not a test.

    python benchmarks/goodput_plans.py [--policy dsde-goodput] [--workload chat] [--temperature 1] [--batch 4]
                                       [--max-batch N] [--num-prompts 16] [--max-tokens 48] [--rounds 1] [--all]

Per round: the wall time, then the plans at a batch below --batch (the cell's tail, once no request is left to
admit; --all: every plan) and the three before them. A plan prints its batch, whether the policy read the batch as
open (a request joined running ones) and, per row: its request, tokens left, the engine's ceiling on k, the planned k,
the draft's lag (context tokens the draft must take in before the row drafts: its whole context while it never
drafted) and the policy's p_first, pbar and on/off (another --policy prints what its stats() gives).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from goodput_ab import cell_arguments, check_cell, load_cell

from dsde_bench.recording import RecordingPolicy
from dsde_bench.runner import run_cell
from dsde_core.cost import StepCosts
from dsde_core.errors import ConfigError
from dsde_core.policies import Plan, SeqInfo, SpeculationPolicy, make_policy


@dataclass
class PlanRow:
    req_id: str
    remaining: int | None
    max_k: int
    k: int
    draft_lag: int
    stats: dict[str, float]  # the policy's own (dsde-goodput: p_first, pbar, on, ...)

    def __str__(self) -> str:
        names = [n for n in ("p_first", "pbar", "on") if n in self.stats] or sorted(self.stats)  # another policy's
        known = " ".join(f"{name} {self.stats[name]:.2f}" for name in names)
        return (f"{self.req_id}: left {self.remaining}, max_k {self.max_k}, k {self.k}, draft lag {self.draft_lag}"
                + (f", {known}" if known else ""))


@dataclass
class PlanRecord:
    waiting: int
    open: bool | None  # dsde-goodput's reading of the batch (None: a policy without one)
    rows: list[PlanRow]

    def __str__(self) -> str:
        how = "" if self.open is None else (", open" if self.open else ", closed")
        return f"batch {len(self.rows)}{how}, {self.waiting} waiting: " + "; ".join(map(str, self.rows))


class PlanLog(RecordingPolicy):
    """The policy unchanged; every plan it makes kept as a PlanRecord."""

    def __init__(self, inner: SpeculationPolicy) -> None:
        super().__init__(inner, watch=0)
        self.pooled = inner.pooled
        self.plans: list[PlanRecord] = []

    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        out = super().plan(seqs, costs, waiting)
        rows = [PlanRow(s.req_id, s.remaining, s.max_k, p.k, s.draft_lag, self.inner.stats(s.req_id))
                for s, p in zip(seqs, out, strict=True)]
        self.plans.append(PlanRecord(waiting, getattr(self.inner, "batch_open", None), rows))
        return out


def tail(plans: Sequence[PlanRecord], batch: int, before: int = 3) -> list[PlanRecord]:
    """The plans from `before` plans ahead of the first one below `batch` rows after the last full one, to the end."""
    full = [i for i, p in enumerate(plans) if len(p.rows) >= batch]
    start = full[-1] + 1 if full else 0
    return list(plans[max(0, start - before):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cell_arguments(ap)
    ap.set_defaults(rounds=1)
    ap.add_argument("--policy", default="dsde-goodput", help="the policy whose plans are printed")
    ap.add_argument("--all", action="store_true", help="every plan of the cell, not only its tail")
    args = ap.parse_args()
    check_cell(ap, args)
    try:
        make_policy(args.policy)  # a bad policy name fails before the models load
    except ConfigError as e:
        ap.error(str(e))
    cell = load_cell(args)
    engine = cell.backend.engine
    for rnd in range(args.rounds):
        inner = make_policy(args.policy)
        cell.warm.serve(engine, inner, args.batch)  # as run_cell warms it, outside the log
        log = PlanLog(inner)
        run = run_cell(engine, log, cell.ids, cell.pids, cell.params(args, rnd), args.batch, watch=0)
        shown = log.plans if args.all else tail(log.plans, args.batch)
        print(f"round {rnd}: {args.policy}, {len(run.steps)} steps in {run.wall_s:.2f} s; {len(log.plans)} plans, "
              f"{'all' if args.all else 'the tail'} below", flush=True)
        for record in shown:
            print(f"  {record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
