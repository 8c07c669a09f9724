"""`dsde bench`: every speculation-length policy over a grid of workloads x temperatures x batch sizes, on the
in-process engine, plus transformers' assisted generation as the external anchor.

A cell = (workload, temperature, batch, policy). Its prompts run through the engine with `batch` requests in
flight (continuous batching: a finished request's slot is refilled before the next step), and its figures come
from dsde_bench.metrics. A repeated cell's rounds run the policies round-robin (round_policies); each cell is printed
as soon as its last round ends.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from dsde_bench.backend import Backend
from dsde_bench.metrics import (
    CellMetrics,
    RequestRecord,
    StepSample,
    add_speedups,
    add_static_opt,
    summarize,
)
from dsde_bench.probe import PROBE_FORWARDS, machine_probe
from dsde_bench.recording import RecordingPolicy
from dsde_bench.rounds import ROUND_ORDERS, round_policies, round_seed
from dsde_bench.workloads import DEFAULT_MAX_CHARS, WORKLOADS, Prompt, load_workload
from dsde_core.config import SamplingParams
from dsde_core.engine import Engine
from dsde_core.errors import ConfigError
from dsde_core.policies import SpeculationPolicy, make_policy

STATIC_KS: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
WARM_SEED_OFFSET = 1000
"""Warm-up prompts are sampled with seed + this, and never among the cell's own prompts."""
FULL_POLICIES: tuple[str, ...] = (
    "off", *(f"static:{k}" for k in STATIC_KS), "heuristic", "adaedl", "acceptance", "dsde-nocap", "dsde",
    "dsde-goodput",
)
# the default grid (under 10 minutes here): the two DSDE variants, cost-aware DSDE, two static k against target-only;
# the transformers schedule and AdaEDL run in --full (and as `--policies`)
SMALL_POLICIES: tuple[str, ...] = ("off", "static:2", "static:4", "dsde-nocap", "dsde", "dsde-goodput")

LABELS = {
    "off": "target-only",
    "heuristic": "heuristic (transformers' schedule)",
    "adaedl": "AdaEDL",
    "acceptance": "acceptance-rate threshold",
    "dsde-nocap": "DSDE, no cap",
    "dsde": "DSDE + cap",
    "dsde-paper": "DSDE (paper parameters) + cap",
    "dsde-goodput": "dsde-goodput (cost-aware)",
    "hf-assisted": "transformers assisted (default)",
    "hf-assisted-heuristic": "transformers assisted (heuristic)",
    "hf-generate": "transformers generate (no assistant)",
}


def label(policy: str) -> str:
    if policy.startswith("static:"):
        return f"static k={policy.split(':', 1)[1]}"
    return LABELS.get(policy, policy)


@dataclass(frozen=True)
class GridConfig:
    workloads: tuple[str, ...] = ("code", "mixed")
    policies: tuple[str, ...] = SMALL_POLICIES
    batch_sizes: tuple[int, ...] = (1, 4)
    temperatures: tuple[float, ...] = (0.0,)
    num_prompts: int = 4
    max_tokens: int = 32
    seed: int = 1
    max_chars: int = DEFAULT_MAX_CHARS
    anchor: tuple[str, ...] = ("hf-assisted", "hf-assisted-heuristic")  # empty: no external anchor
    watch: int = 3  # sequences per cell whose per-step SL / KLD / WVIR series are kept
    warmup: bool = True
    ignore_eos: bool = False
    repeats: int = 1  # runs per cell, round-robin over the policies; the median run is kept
    # the policies' order within a repeated cell's rounds (ROUND_ORDERS): "alternate" reverses every other round
    round_order: str = "alternate"
    warm_requests: int = 0  # a policy that learns across requests first serves this many other prompts (untimed)
    # request i's max_tokens is max_tokens * (1 - length_spread * u_i), u_i uniform in [0, 1) drawn from (seed, i):
    # with ignore_eos, requests that end apart (as a server's do) instead of a closed batch of equal ones in lockstep
    length_spread: float = 0.0
    # fixed target forwards timed before and after every round (dsde_bench.probe; 0: none): which rounds ran while the
    # machine was in a slow phase
    probe_forwards: int = PROBE_FORWARDS

    def __post_init__(self) -> None:
        for w in self.workloads:
            if w not in WORKLOADS:
                raise ConfigError(f"unknown workload {w!r}; valid: {', '.join(WORKLOADS)}")
        if not self.workloads:
            raise ConfigError("at least one workload is needed")
        if not self.policies:
            raise ConfigError("at least one policy is needed")
        for p in self.policies:
            make_policy(p)  # raises ConfigError naming the valid specs
        if "off" not in self.policies:
            raise ConfigError("the policies must include 'off' (target-only): speedups are measured against it")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ConfigError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if not self.temperatures or any(not 0.0 <= t <= 2.0 for t in self.temperatures):
            raise ConfigError(f"temperatures must be in [0, 2], got {self.temperatures}")
        if self.num_prompts < 1:
            raise ConfigError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_tokens < 2:
            raise ConfigError(f"max_tokens must be >= 2, got {self.max_tokens}")
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}")
        if self.round_order not in ROUND_ORDERS:
            raise ConfigError(f"unknown round order {self.round_order!r}; valid: {', '.join(ROUND_ORDERS)}")
        if self.warm_requests < 0:
            raise ConfigError(f"warm_requests must be >= 0, got {self.warm_requests}")
        if self.probe_forwards < 0:
            raise ConfigError(f"probe_forwards must be >= 0, got {self.probe_forwards}")
        if not 0.0 <= self.length_spread < 1.0:
            raise ConfigError(f"length_spread must be in [0, 1), got {self.length_spread}")
        if self.length_spread and self.anchor:
            raise ConfigError("length_spread gives requests different lengths, which the transformers anchor does not "
                              "run: pass --no-anchor")
        from dsde_bench.anchor import ALL_ANCHOR_SYSTEMS

        bad = [a for a in self.anchor if a not in ALL_ANCHOR_SYSTEMS]
        if bad:
            raise ConfigError(f"unknown anchor system(s) {bad}; valid: {', '.join(ALL_ANCHOR_SYSTEMS)}")

    def num_cells(self) -> int:
        engine = len(self.workloads) * len(self.temperatures) * len(self.batch_sizes) * len(self.policies)
        return engine + len(self.workloads) * len(self.temperatures) * len(self.anchor)


FULL_GRID = dict(
    workloads=WORKLOADS, policies=FULL_POLICIES, batch_sizes=(1, 4, 16), temperatures=(0.0, 1.0),
    num_prompts=16, max_tokens=128,
)


@dataclass
class CellRun:
    records: list[RequestRecord]
    steps: list[StepSample]
    wall_s: float
    series: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def drive(engine: Engine, prompts: Sequence[Sequence[int]], prompt_ids: Sequence[str],
          params: Sequence[SamplingParams], batch: int) -> CellRun:
    """Run the prompts with at most `batch` requests in flight; refill between steps. Engine.step_log is cleared."""
    if batch > engine.config.max_batch_size:
        raise ConfigError(f"batch {batch} exceeds the engine's max_batch_size {engine.config.max_batch_size}")
    engine.step_log.clear()
    todo = list(zip(prompts, prompt_ids, params, strict=True))
    todo.reverse()
    live: list[tuple[Any, str]] = []
    done: list[RequestRecord] = []
    steps: list[StepSample] = []
    t0 = time.perf_counter()
    while todo or engine.has_unfinished():
        admitted = False
        while todo and len(engine.running) + len(engine.waiting) < batch:
            ids, pid, p = todo.pop()
            live.append((engine.add_request(ids, p), pid))
            admitted = True
        n_log = len(engine.step_log)
        engine.step()
        if len(engine.step_log) > n_log:
            r = engine.step_log[-1]
            steps.append(StepSample(r.batch, list(r.ks), r.draft_s, r.target_s, prefill=admitted,
                                     contexts=list(r.contexts), emitted=r.emitted))
        for req, pid in [x for x in live if x[0].finished]:
            if req.error:
                raise RuntimeError(f"request {pid} failed: {req.error}")
            done.append(RequestRecord.from_stats(pid, len(req.prompt_ids), len(req.output_ids), req.stats,
                                                 req.finish_reason or ""))
        live = [x for x in live if not x[0].finished]
    wall = time.perf_counter() - t0
    order = {pid: i for i, pid in enumerate(prompt_ids)}
    done.sort(key=lambda r: order[r.prompt_id])
    return CellRun(done, steps, wall)


def sampling_params(n: int, max_tokens: int | Sequence[int], temperature: float, seed: int,
                    ignore_eos: bool) -> list[SamplingParams]:
    """Request i gets seed + i: at T > 0 each policy sees the same random streams. max_tokens: one for all, or
    request i's (request_lengths)."""
    lengths = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    return [SamplingParams(max_tokens=lengths[i], temperature=temperature, seed=seed + i, ignore_eos=ignore_eos)
            for i in range(n)]


def request_lengths(n: int, max_tokens: int, spread: float, seed: int) -> list[int]:
    """[n] max_tokens of each request: max_tokens * (1 - spread * u_i), u_i uniform in [0, 1) from (seed, i), at
    least 2; the same for every policy, round and temperature. spread 0: all max_tokens."""
    return [max(2, round(max_tokens * (1 - spread * random.Random(f"length:{seed}:{i}").random()))) for i in range(n)]


@dataclass(frozen=True)
class Warmup:
    """Other prompts of the workload, served untimed by a policy that learns across requests before its cell."""

    prompts: Sequence[Sequence[int]]
    prompt_ids: Sequence[str]
    params: Sequence[SamplingParams]

    def serve(self, engine: Engine, policy: SpeculationPolicy, batch: int) -> None:
        """Serve the prompts with `policy` where it learns across requests (steady state: what a server that has run a
        while sees); a policy that does not learn across requests skips them."""
        if policy.pooled and self.prompts:
            engine.set_policy(policy)
            drive(engine, self.prompts, self.prompt_ids, self.params, batch)


def other_prompts(workload: str, n: int, seed: int, max_chars: int, cell: Sequence[Prompt]) -> list[Prompt]:
    """The n prompts a policy that learns across requests serves, untimed, before a cell of `cell`'s prompts: other
    prompts of the workload (seed + WARM_SEED_OFFSET, none of the cell's). The simulator warms up on the same ones."""
    if n == 0:
        return []
    return load_workload(workload, n, seed + WARM_SEED_OFFSET, max_chars, frozenset(p.id for p in cell))


def run_cell(engine: Engine, policy: str | SpeculationPolicy, prompts: Sequence[Sequence[int]],
             prompt_ids: Sequence[str], params: Sequence[SamplingParams], batch: int, watch: int = 3,
             warm: Warmup | None = None) -> CellRun:
    """Run a cell's prompts with `policy` (a spec, or a fresh policy object); one that learns across requests first
    serves `warm`'s prompts."""
    inner = make_policy(policy) if isinstance(policy, str) else policy
    adaptive = inner.name != "off" and not inner.name.startswith("static")
    if warm is not None:
        warm.serve(engine, inner, batch)
    rec = RecordingPolicy(inner, watch=watch if adaptive else 0)
    engine.set_policy(rec)
    run = drive(engine, prompts, prompt_ids, params, batch)
    run.series = rec.series
    return run


class Round(NamedTuple):
    """One round of a repeated cell: the run, the load average and the machine probe (ms) before and after it, its
    metrics."""

    run: CellRun
    load: list[float | None]
    metrics: CellMetrics
    probe: list[float | None]


def median_run(rounds: Sequence[Round]) -> Round:
    """The round of median wall time (of an even count, the faster of the middle two)."""
    ranked = sorted(rounds, key=lambda r: r.run.wall_s)
    return ranked[(len(ranked) - 1) // 2]


def _unique_ids(prompts: Sequence[Prompt]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        n = seen.get(p.id, 0)
        seen[p.id] = n + 1
        out.append(p.id if n == 0 else f"{p.id}#{n}")
    return out


# ---- the grid --------------------------------------------------------------------------------------------------
ROW_HEADER = (f"{'workload':8} {'T':>3} {'bs':>3} {'policy':34} {'e2e s':>7} {'tok/s':>7} {'acc':>5} {'MAL':>5} "
              f"{'tfwd/tok':>8} {'dfwd/tok':>8} {'SL mean±sd':>11} {'speedup':>7}")


def format_row(cell: dict[str, Any]) -> str:
    m = cell["metrics"]

    def f(x: float | None, spec: str) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    sl = "-" if cell.get("kind") == "anchor" else f"{m['sl_mean']:.2f}±{m['sl_std']:.2f}"
    return (f"{cell['workload']:8} {cell['temperature']:>3g} {cell['batch']:>3} {cell['label'][:34]:34} "
            f"{f(m['mean_e2e_s'], '7.2f')} {f(m['output_tok_s'], '7.2f')} {f(m['acceptance_rate'], '5.2f')} "
            f"{f(m['mean_accepted_length'], '5.2f')} {f(m['target_fwd_per_tok'], '8.3f')} "
            f"{f(m['draft_fwd_per_tok'], '8.3f')} {sl:>11} {f(m['speedup'], '6.2f')}x")


def run_grid(backend: Backend, cfg: GridConfig, print_fn: Callable[[str], None] = print,
             progress: bool = True) -> dict[str, Any]:
    """Run every cell; returns the results document (see report.py for how it is read)."""
    need = max(cfg.batch_sizes)
    if need > backend.max_batch:
        raise ConfigError(f"batch size {need} needs an engine with max_batch_size >= {need} (has {backend.max_batch})")
    bar = _progress(cfg.num_cells(), progress)
    cells: list[dict[str, Any]] = []
    series: list[dict[str, Any]] = []
    steps_out: list[dict[str, Any]] = []
    workload_prompts: dict[str, list[dict[str, Any]]] = {}
    t_grid = time.perf_counter()
    if cfg.warmup:
        _warmup(backend, cfg)
    hf = None
    print_fn = _bar_print(bar, print_fn)
    policies = ["off", *(p for p in cfg.policies if p != "off")]  # round 0's order: the baseline first
    print_fn(ROW_HEADER)
    for w in cfg.workloads:
        prompts = load_workload(w, cfg.num_prompts, cfg.seed, cfg.max_chars)
        pids = _unique_ids(prompts)
        ids = [backend.encode(p.text) for p in prompts]
        lengths = request_lengths(len(ids), cfg.max_tokens, cfg.length_spread, cfg.seed)  # every cell and round's
        workload_prompts[w] = [{"id": pid, "tokens": len(x)} for pid, x in zip(pids, ids, strict=True)]
        warm_prompts = other_prompts(w, cfg.warm_requests, cfg.seed, cfg.max_chars, prompts)
        for temp in cfg.temperatures:
            warm = Warmup([backend.encode(p.text) for p in warm_prompts], [f"warm-{i}" for i in range(
                len(warm_prompts))], sampling_params(len(warm_prompts), cfg.max_tokens, temp,
                                                     cfg.seed + WARM_SEED_OFFSET, cfg.ignore_eos))
            for bs in cfg.batch_sizes:
                # repeats run round-robin over the policies, and each keeps its median run: a burst of other work
                # on a shared machine then costs every policy a round instead of biasing one of them, and a policy
                # whose schedule varies from run to run (an online cost model) is not credited with its luckiest
                runs: dict[str, list[Round]] = {}
                group: list[dict[str, Any]] = []
                probe = machine_probe(backend.engine, cfg.probe_forwards)  # each round's "after" the next's "before"
                for rep in range(cfg.repeats):
                    params = sampling_params(len(ids), lengths, temp, round_seed(cfg.seed, rep, temp), cfg.ignore_eos)
                    for pol in round_policies(policies, rep, cfg.round_order):
                        load0, probe0 = _loadavg(), probe
                        run = run_cell(backend.engine, pol, ids, pids, params, bs, cfg.watch, warm)
                        m = summarize(run.records, run.steps, run.wall_s)
                        probe = machine_probe(backend.engine, cfg.probe_forwards)
                        runs.setdefault(pol, []).append(Round(run, [load0, _loadavg()], m, [probe0, probe]))
                for pol in policies:  # the baseline first: speedups as we go
                    run, load, m, _ = median_run(runs[pol])
                    # every round's wall time, SL and acceptance: where a policy's rounds differ, they say whether its
                    # plans did or the machine's load (the cell's other figures are the median run's)
                    cell = {**_cell(w, temp, bs, pol, run, m), "loadavg": load, "repeats": cfg.repeats,
                            "walls_s": [round(r.run.wall_s, 4) for r in runs[pol]],
                            "sl_means": [round(r.metrics.sl_mean, 3) for r in runs[pol]],
                            "acceptance_rates": [round(r.metrics.acceptance_rate, 3) for r in runs[pol]]}
                    if cfg.probe_forwards:  # ms of the fixed forward before and after each round
                        cell["probe_ms"] = [r.probe for r in runs[pol]]
                    group.append(cell)
                    series += [{"workload": w, "temperature": temp, "batch": bs, "policy": pol, "request": rid,
                                "steps": rows} for rid, rows in run.series.items()]
                    steps_out.append({"workload": w, "temperature": temp, "batch": bs, "policy": pol,
                                      "steps": [s.row() for s in run.steps]})
                    add_speedups(group)
                    print_fn(format_row(cell))
                    bar.update(1)
                cells += group
            if cfg.anchor:
                hf = hf or _load_anchor(backend)
                for system in cfg.anchor:
                    cell = _anchor_cell(backend, hf, system, w, temp, ids, pids, cfg)
                    cells.append(cell)
                    add_speedups([c for c in cells if c["workload"] == w and c["temperature"] == temp])
                    print_fn(format_row(cell))
                    bar.update(1)
    bar.close()
    for c in add_static_opt(cells):
        print_fn(format_row(c))
    add_speedups(cells)
    return {
        "kind": "bench",
        "config": _jsonable(asdict(cfg)),
        "backend": backend.description,
        "prompts": workload_prompts,
        "cells": cells,
        "series": series,
        "steps": steps_out,
        "elapsed_s": time.perf_counter() - t_grid,
    }


def _cell(w: str, temp: float, bs: int, pol: str, run: CellRun, m: CellMetrics) -> dict[str, Any]:
    return {"kind": "engine", "workload": w, "temperature": temp, "batch": bs, "policy": pol, "label": label(pol),
            "metrics": m.as_dict(), "requests": [asdict(r) for r in run.records]}


def _anchor_cell(backend: Backend, hf: tuple[Any, dict[str, Any]], system: str, w: str, temp: float,
                 ids: list[list[int]], pids: list[str], cfg: GridConfig) -> dict[str, Any]:
    from dsde_bench.anchor import run_anchor

    target, assistants = hf
    records, wall = run_anchor(target, assistants[system], ids, pids, cfg.max_tokens, temp, cfg.seed,
                               backend.pad_token_id)
    m = summarize(records, None, wall).as_dict()
    for k in ("acceptance_rate", "mean_accepted_length", "target_fwd_per_tok", "draft_fwd_per_tok", "sl_mean",
              "sl_std", "mean_ttft_s", "mean_itl_s"):
        m[k] = None  # transformers does not report them
    return {"kind": "anchor", "workload": w, "temperature": temp, "batch": 1, "policy": system,
            "label": label(system), "metrics": m, "requests": [asdict(r) for r in records]}


def _load_anchor(backend: Backend) -> tuple[Any, dict[str, Any]]:
    from dsde_bench.anchor import assistants

    if backend.hf_pair is None:
        raise ConfigError("this backend has no transformers models for the external anchor; pass --no-anchor")
    target, draft = backend.hf_pair()
    return target, assistants(draft)


def _warmup(backend: Backend, cfg: GridConfig) -> None:
    """One short run per batch size: the first call of each shape pays one-off costs (weight packing, allocator)."""
    ids = [backend.encode("Warm up: write one short sentence about the sea.")]
    for bs in sorted(set(cfg.batch_sizes)):
        p = sampling_params(bs, 8, 0.0, 0, False)
        run_cell(backend.engine, "static:4", ids * bs, [f"w{i}" for i in range(bs)], p, bs, watch=0)


def _loadavg() -> float | None:
    """1-minute load average: the machine is shared, and a cell measured under load says so in the JSON."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return None


def _jsonable(x: Any) -> Any:
    if isinstance(x, tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    return x


def _bar_print(bar: Any, print_fn: Callable[[str], None]) -> Callable[[str], None]:
    """Rows printed above the progress bar, or flushed as printed: into a file or a pipe, stdout is block-buffered,
    and a long run's log would show no cell until the buffer fills."""
    if print_fn is not print:
        return print_fn
    if hasattr(bar, "write"):
        return lambda s: bar.write(s, file=sys.stdout)
    return lambda s: print(s, flush=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="cells", unit="cell", file=sys.stderr, leave=False, dynamic_ncols=True)
