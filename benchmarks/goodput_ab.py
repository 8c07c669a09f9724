"""dsde-goodput against itself at another git revision, in one run: does a policy change pay on this machine?

    python benchmarks/goodput_ab.py [--policies off,static:1,dsde-goodput@REV,dsde-goodput] [--workload chat]
                                    [--temperature 1] [--batch 4] [--max-batch N] [--num-prompts 16]
                                    [--max-tokens 48] [--rounds 5] [--out FILE.json]

A policy spec `dsde-goodput@REV` is the policy as it was at git revision REV (its module,
dsde_core/policies/goodput.py, read with `git show` and loaded beside today's; everything else is today's). Each
cell runs as `dsde bench` runs it (the embedded pair in-process, its prompts and seeds, --warm-requests 4 for a
policy that learns across requests, round-robin rounds (every other one reversed) with new seeds at T > 0, the
closed-loop driver that keeps --batch requests in flight; the engine has --batch KV slots unless --max-batch gives
more, as `dsde bench` loads one engine for its largest batch size). The table prints each policy's median wall time
and its tokens/s against target-only decoding ("off"), with every round's wall time and its ratio to the first
spec's run of the same round: compare the ratios, not the seconds (a shared machine). Then where each policy's time
went, medians over its rounds (`phases`): steps that fed a prompt, decode steps at the full batch that drafted and
that did not, and the batch's tail (decode steps at a smaller batch), each with its draft and target seconds, the
tokens it emitted and ms a token. A run that drafted nothing ran the first spec's forwards when that is "off": its
ratio is the machine's noise. --out keeps, beside the walls, every run's steps as bench.json keeps them
(dsde_bench.metrics.StepRow). """

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsde_bench.backend import Backend, load_backend
from dsde_bench.metrics import StepRow
from dsde_bench.provenance import code_version, run_meta
from dsde_bench.rounds import round_policies, round_seed
from dsde_bench.runner import WARM_SEED_OFFSET, Warmup, drive, other_prompts, run_cell, sampling_params
from dsde_bench.workloads import DEFAULT_MAX_CHARS, load_workload
from dsde_core.config import SamplingParams
from dsde_core.errors import ConfigError
from dsde_core.policies import SpeculationPolicy, make_policy

MODULE = "dsde_core/policies/goodput.py"


@functools.cache
def policy_at(rev: str) -> type[SpeculationPolicy]:
    """GoodputPolicy as dsde_core/policies/goodput.py was at git revision rev (read once: a run compares fixed code)."""
    out = subprocess.run(["git", "show", f"{rev}:{MODULE}"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent)
    if out.returncode != 0:
        raise ConfigError(f"no {MODULE} at git revision {rev!r}: {out.stderr.strip()}")
    source = out.stdout
    path = Path(tempfile.mkdtemp()) / f"goodput_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"goodput_at_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.GoodputPolicy


def build(spec: str) -> SpeculationPolicy:
    name, _, rev = spec.partition("@")
    if rev and name != "dsde-goodput":
        raise ConfigError(f"only dsde-goodput takes @REV, got {spec!r}")
    return policy_at(rev)() if rev else make_policy(name)


def cell_arguments(ap: argparse.ArgumentParser) -> None:
    """The cell's options (the goodput_lowacc cell by default)."""
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=None,
                    help="the engine's KV slots (default: --batch; `dsde bench` loads its largest batch size)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--warm-requests", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)


def check_cell(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.rounds, args.num_prompts, args.max_tokens, args.batch) < 1:
        ap.error("--rounds, --num-prompts, --max-tokens and --batch must be >= 1")
    if args.max_batch is not None and args.max_batch < args.batch:
        ap.error(f"--max-batch {args.max_batch} is below --batch {args.batch}: the engine needs a slot for each "
                 f"request in flight")


@dataclass
class Cell:
    backend: Backend
    ids: list[list[int]]  # the prompts' token ids
    pids: list[str]
    warm: Warmup  # what a policy that learns across requests serves first

    def params(self, args: argparse.Namespace, rnd: int) -> list[SamplingParams]:
        """Round rnd's sampling parameters (new seeds each round at T > 0, shared by every policy)."""
        return sampling_params(len(self.ids), args.max_tokens, args.temperature,
                               round_seed(args.seed, rnd, args.temperature), True)


def load_cell(args: argparse.Namespace) -> Cell:
    """The embedded pair, the cell's prompts and its warm-up prompts, as `dsde bench` runs the cell; one short
    warm-up run done."""
    backend = load_backend(max_batch=args.max_batch or args.batch)
    max_chars = DEFAULT_MAX_CHARS
    prompts = load_workload(args.workload, args.num_prompts, args.seed, max_chars)
    ids = [backend.encode(p.text) for p in prompts]
    pids = [f"{p.id}#{i}" for i, p in enumerate(prompts)]
    warm_p = other_prompts(args.workload, args.warm_requests, args.seed, max_chars, prompts)
    warm = Warmup([backend.encode(p.text) for p in warm_p], [f"warm-{i}" for i in range(len(warm_p))],
                  sampling_params(len(warm_p), args.max_tokens, args.temperature, args.seed + WARM_SEED_OFFSET, True))
    w = min(2, args.batch)  # warm-up: a short run of w prompts at once
    drive(backend.engine, ids[:w], pids[:w], sampling_params(w, 4, args.temperature, args.seed, True), w)
    return Cell(backend, ids, pids, warm)


PHASES = ("prefill", "full, drafting", "full, not drafting", "tail")


@dataclass
class Phase:
    """One phase of a run: its steps, their draft and target seconds and the tokens they emitted."""

    steps: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    emitted: int = 0

    def add(self, row: StepRow) -> None:
        self.steps, self.emitted = self.steps + 1, self.emitted + row.emitted
        self.draft_s, self.target_s = self.draft_s + row.draft_s, self.target_s + row.target_s

    def __str__(self) -> str:
        ms = f"{1000 * (self.draft_s + self.target_s) / self.emitted:6.1f}" if self.emitted else "     -"
        return (f"{self.steps:4d} steps, draft {self.draft_s:6.2f} s + target {self.target_s:6.2f} s, "
                f"{self.emitted:5d} tokens, {ms} ms a token")


def phases(rows: list[StepRow], batch: int) -> dict[str, Phase]:
    """One run's steps by phase: a prompt fed; a decode step at `batch` rows that drafted or not; a decode step at
    fewer rows (the batch's tail, once nothing is left to admit, or a slot not yet refilled)."""
    out = {name: Phase() for name in PHASES}
    for r in rows:
        name = ("prefill" if r.prefill else "tail" if r.batch < batch
                else "full, drafting" if r.sum_k > 0 else "full, not drafting")
        out[name].add(r)
    return out


def median_phases(runs: list[dict[str, Phase]]) -> dict[str, Phase]:
    """Each phase's field by field median over runs."""
    return {name: Phase(round(statistics.median(r[name].steps for r in runs)),
                        statistics.median(r[name].draft_s for r in runs),
                        statistics.median(r[name].target_s for r in runs),
                        round(statistics.median(r[name].emitted for r in runs))) for name in PHASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="off,static:1,dsde-goodput@HEAD,dsde-goodput")
    cell_arguments(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    check_cell(ap, args)
    specs = args.policies.split(",")
    try:
        for s in specs:
            build(s)  # a bad spec or revision fails before the models load
    except ConfigError as e:
        raise SystemExit(f"goodput_ab: {e}") from None
    code = code_version()
    cell = load_cell(args)
    backend, ids, pids, warm = cell.backend, cell.ids, cell.pids, cell.warm
    walls: dict[str, list[float]] = {s: [] for s in specs}
    steps: dict[str, list[list[list[float]]]] = {s: [] for s in specs}  # per spec, per round: the run's steps
    tokens = args.num_prompts * args.max_tokens
    for rnd in range(args.rounds):
        params = cell.params(args, rnd)
        for s in round_policies(specs, rnd, "alternate"):  # every other round reversed, as dsde bench's
            run = run_cell(backend.engine, build(s), ids, pids, params, args.batch, watch=0, warm=warm)
            walls[s].append(run.wall_s)
            steps[s].append([x.row() for x in run.steps])
        for s in specs:
            wall, drafted = walls[s][rnd], sum(StepRow(*row).calls > 0 for row in steps[s][rnd])
            print(f"round {rnd} {s:28} {wall:7.2f} s {tokens / wall:6.2f} tok/s  {walls[specs[0]][rnd] / wall:5.3f}x  "
                  f"drafted in {drafted} of {len(steps[s][rnd])} steps", flush=True)
    base = statistics.median(walls[specs[0]])
    print(f"\n{args.workload} T={args.temperature:g} b{args.batch} on an engine of "
          f"{backend.engine.config.max_batch_size} slots, {args.num_prompts} prompts x {args.max_tokens} "
          f"tokens, {args.rounds} rounds; speedup = median wall of {specs[0]} / median wall")
    for s in specs:
        med = statistics.median(walls[s])
        ratios = " ".join(f"{b / w:.3f}" for b, w in zip(walls[specs[0]], walls[s], strict=True))
        print(f"{s:28} median {med:7.2f} s  {base / med:5.3f}x  rounds {' '.join(f'{w:.1f}' for w in walls[s])}  "
              f"round by round {ratios}x")
    print("\nwhere the time went (medians over the rounds, phase by phase)")
    for s in specs:
        split = median_phases([phases([StepRow(*r) for r in run], args.batch) for run in steps[s]])
        print(s)
        for name, phase in split.items():
            print(f"  {name:20} {phase}")
    if args.out:
        doc = {"args": vars(args), "walls_s": walls, "steps": steps, "meta": run_meta(code)}
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
