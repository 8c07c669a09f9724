"""Trace-driven simulator: replay any speculation policy on a recorded trace, at any batch size, under a step-cost
model (dsde_bench.sim.costs); plus the oracle (hindsight-best k every step).

The replay runs the real policy objects through their real interface (plan -> StepFeedback -> observe ->
release) with the engine's own rules: k = min(plan.k, max_k) with max_k = min(max_sl, tokens left - 1); AdaEDL's
confidence stop; greedy acceptance = the longest prefix of the draft's rollout that equals the target's tokens;
EOS and max_tokens end a request; continuous batching refills a slot before the next step. At temperature 0 the
schedule of steps does not depend on time, so it is computed once and then priced under every cost model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dsde_bench.metrics import RequestRecord, StepSample, add_speedups, add_static_opt, summarize
from dsde_bench.recording import RecordingPolicy
from dsde_bench.sim.costs import CostModel, ProfileCosts
from dsde_bench.sim.trace import SeqTrace, Trace
from dsde_core.cost import StepCosts
from dsde_core.errors import ConfigError
from dsde_core.policies import Plan, SeqInfo, SpeculationPolicy, StepFeedback, make_policy
from dsde_core.policies.adaedl import entropy_confidence, should_stop
from dsde_core.policies.base import clamp_k


# ---- the oracle ----------------------------------------------------------------------------------------------
class OraclePolicy(SpeculationPolicy):
    """Hindsight-best k every step: exactly the number of draft tokens the target will accept (so every drafted
    token is accepted and no step is shorter than it could be). Only the simulator can run it: it sets
    `lookahead[req_id]` before every plan. For greedy decoding this is the lower bound on target forwards per
    token of any policy with the same max SL (inside a run of matches every start position reaches the same
    end, so taking the longest step each time is optimal), with the fewest draft forwards among those."""

    name = "oracle"

    def __init__(self) -> None:
        self.lookahead: dict[str, int] = {}

    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        return [Plan(k=clamp_k(self.lookahead.get(s.req_id, 0), s.max_k)) for s in seqs]

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        pass

    def release(self, req_id: str) -> None:
        self.lookahead.pop(req_id, None)

    def num_tracked(self) -> int:
        return 0


def make_sim_policy(spec: str) -> SpeculationPolicy:
    return OraclePolicy() if spec.strip().lower() == "oracle" else make_policy(spec)


# ---- the replay ----------------------------------------------------------------------------------------------
@dataclass
class _Live:
    rid: str
    seq: SeqTrace
    admitted_step: int
    pos: int = 0  # index into seq.tokens of the next token to produce
    out: int = 0  # tokens emitted so far
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    sl: list[int] = field(default_factory=list)
    first_step: int | None = None
    done: bool = False
    reason: str = ""


@dataclass
class SimRun:
    """The schedule of a replay: per step the k of every running sequence and the prompt tokens it fed."""

    policy: str
    batch: int
    steps: list[tuple[list[int], list[int], list[int]]]  # (ks of all running sequences, prompt tokens each fed
    # the target, context tokens each fed the draft at its first drafting step)
    requests: list[_Live]
    finished_step: dict[str, int]
    series: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def priced(self, cost: CostModel) -> tuple[list[RequestRecord], list[StepSample], float]:
        """Per-request records and per-step samples with times from `cost`; the total simulated time."""
        samples = []
        clock = [0.0]
        for ks, extra, draft_extra in self.steps:
            d, t = cost.step(ks, extra, draft_extra)
            samples.append(StepSample(len(ks), [k for k in ks if k > 0], d, t, prefill=any(extra)))
            clock.append(clock[-1] + d + t)
        recs = []
        for r in self.requests:
            start = clock[r.admitted_step]
            end = clock[self.finished_step[r.rid] + 1]
            first = clock[r.first_step + 1] if r.first_step is not None else None
            itl = (end - first) / (r.out - 1) if first is not None and r.out > 1 else None
            recs.append(RequestRecord(r.rid, r.seq.prompt_tokens, r.out, r.steps, r.drafted, r.accepted, list(r.sl),
                                      end - start, None if first is None else first - start, itl, r.reason))
        return recs, samples, clock[-1]


def simulate(trace: Trace, policy: str | SpeculationPolicy, batch: int, max_sl: int | None = None,
             num_requests: int | None = None, max_tokens: int | None = None, watch: int = 0,
             cost: CostModel | None = None, warm: Trace | None = None, closed: bool = False) -> SimRun:
    """Replay `policy` on the trace with `batch` requests in flight (greedy, temperature 0).
    cost: the profile a cost-aware policy plans with (its schedule then holds for that profile only).

    num_requests: how many requests (default: one per traced prompt, at least `batch`; prompts are reused in order,
    each copy a separate request). max_sl: the engine's ceiling (default and at most the trace's horizon).
    warm: a policy that learns across requests (dsde-goodput) first serves this trace's prompts, untimed, at the
    same batch size: the steady state of a server, as `dsde bench --warm-requests` runs it. The other policies keep
    no state across requests and skip it.
    closed: the prompts run in closed batches of `batch`, in order, each to its end before the next starts and each
    with a fresh policy (and its warm-up), as a `dsde bench` cell of `batch` prompts runs them (a cell of more
    prompts refills each freed slot instead); one request per prompt.
    """
    if batch < 1:
        raise ConfigError(f"batch must be >= 1, got {batch}")
    if closed:
        if not isinstance(policy, str):
            raise ConfigError("closed batches need a policy spec: each batch starts a fresh policy")
        if num_requests is not None:
            raise ConfigError("closed batches run each prompt once: num_requests does not apply")
        groups = [replace(trace, seqs=trace.seqs[i:i + batch]) for i in range(0, len(trace.seqs), batch)]
        return _chain([simulate(g, policy, batch, max_sl=max_sl, num_requests=len(g.seqs), max_tokens=max_tokens,
                                watch=watch if i == 0 else 0, cost=cost, warm=warm) for i, g in enumerate(groups)])
    pol = make_sim_policy(policy) if isinstance(policy, str) else policy
    name = policy if isinstance(policy, str) else pol.name
    costs = ProfileCosts(cost) if cost is not None else None
    if warm is not None and pol.pooled:
        _replay(warm, pol, batch, max_sl, len(warm.seqs), max_tokens, costs, prefix="warm-")
    rec = RecordingPolicy(pol, watch=watch)
    steps, everyone, finished = _replay(trace, rec, batch, max_sl, num_requests, max_tokens, costs)
    return SimRun(name, batch, steps, everyone, finished, rec.series)


def _chain(runs: Sequence[SimRun]) -> SimRun:
    """Runs one after another as one schedule: each run's step indices shift by the steps before it."""
    steps: list[tuple[list[int], list[int], list[int]]] = []
    requests: list[_Live] = []
    finished: dict[str, int] = {}
    series: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        shift = len(steps)
        steps += run.steps
        requests += [replace(r, admitted_step=r.admitted_step + shift,
                             first_step=None if r.first_step is None else r.first_step + shift) for r in run.requests]
        finished.update({rid: step + shift for rid, step in run.finished_step.items()})
        series.update(run.series)
    return SimRun(runs[0].policy, runs[0].batch, steps, requests, finished, series)


def _replay(trace: Trace, planner: SpeculationPolicy, batch: int, max_sl: int | None,
            num_requests: int | None, max_tokens: int | None, costs: ProfileCosts | None,
            prefix: str = "") -> tuple[list[tuple[list[int], list[int], list[int]]], list[_Live], dict[str, int]]:
    """The engine's step loop on the trace: `planner` plans and observes (a policy, or a recorder around one).
    Returns the steps, the requests and the step each finished in."""
    oracle = getattr(planner, "inner", planner)  # the oracle policy reads the trace's matches ahead
    cap_sl = trace.horizon if max_sl is None else min(max_sl, trace.horizon)
    limit = trace.max_tokens if max_tokens is None else min(max_tokens, trace.max_tokens)
    n_req = num_requests if num_requests is not None else max(len(trace.seqs), batch)
    todo = [(prefix + f"{trace.seqs[i % len(trace.seqs)].id}"
             + (f"#{i // len(trace.seqs)}" if i >= len(trace.seqs) else ""),
             trace.seqs[i % len(trace.seqs)]) for i in range(n_req)]
    todo.reverse()
    running: list[_Live] = []
    everyone: list[_Live] = []
    steps: list[tuple[list[int], list[int], list[int]]] = []
    finished: dict[str, int] = {}
    while todo or running:
        step = len(steps)
        while todo and len(running) < batch:
            rid, seq = todo.pop()
            live = _Live(rid, seq, admitted_step=step)
            running.append(live)
            everyone.append(live)
        if isinstance(oracle, OraclePolicy):
            oracle.lookahead = {r.rid: r.seq.match(r.pos) for r in running}
        pending = [r.seq.prompt_tokens if r.steps == 0 else 1 for r in running]
        infos = [SeqInfo(r.rid, 0.0, max(0, min(cap_sl, limit - r.out - 1)), n, limit - r.out, _draft_lag(r))
                 for r, n in zip(running, pending, strict=True)]
        plans = planner.plan(infos, costs.estimate(len(infos), sum(pending) + sum(i.max_k for i in infos))
                             if costs is not None else None, len(todo))
        ks = _draft_levels(running, plans, [min(p.k, i.max_k) for p, i in zip(plans, infos, strict=True)])
        fbs = []
        for r, p, k, info in zip(running, plans, ks, infos, strict=True):
            acc = min(k, r.seq.match(r.pos))
            fbs.append(StepFeedback(r.rid, min(p.k, info.max_k), k, acc, tuple(r.seq.kld[r.pos][:k]),
                                    tuple(r.seq.entropy[r.pos][:k]), tuple(r.seq.top1[r.pos][:k])))
        planner.observe(fbs)
        draft_extra = [_draft_lag(r) if k > 0 else 0 for r, k in zip(running, ks, strict=True)]
        steps.append((ks, [n - 1 for n in pending], draft_extra))
        for r, fb in zip(running, fbs, strict=True):
            _commit(r, fb, limit, step)
        for r in [r for r in running if r.done]:
            finished[r.rid] = step
            planner.release(r.rid)
        running = [r for r in running if not r.done]
    return steps, everyone, finished


def _draft_lag(r: _Live) -> int:
    """The context the draft takes in when r drafts: its prompt and output so far when it never drafted before."""
    return 0 if r.drafted else r.seq.prompt_tokens - 1 + r.out


def _draft_levels(running: list[_Live], plans: Sequence[Plan], caps: Sequence[int]) -> list[int]:
    """The draft worker's loop (dsde_core.workers.DraftWorker.propose) on the trace: level by level, row i stops at its
    cap, at its AdaEDL confidence stop, or where the batch's DraftStop ends it. Returns the tokens each proposed."""
    stop = next((p.stop for p in plans if p.stop is not None), None)
    n = [0] * len(running)
    reach = [p.worth for p in plans]
    live = [i for i, c in enumerate(caps) if c > 0]
    drafted = level = 0
    while live:
        nxt = []
        for i in live:
            r, p, j = running[i], plans[i], n[i]
            n[i] += 1
            if stop is not None and p.p_next is not None:
                reach[i] *= stop.accept_prob(r.seq.top1[r.pos][j], p.accept_model)
            if n[i] < caps[i] and not should_stop(entropy_confidence(r.seq.entropy[r.pos][j]), p.min_confidence):
                nxt.append(i)
        drafted += len(live)
        level += 1
        ruled = [i for i in nxt if plans[i].p_next is not None]
        if stop is not None and ruled:
            go = stop.next_level([reach[i] for i in ruled], [plans[i].p_next for i in ruled],
                                 [caps[i] - n[i] for i in ruled], drafted, level)
            keep = {i for i, g in zip(ruled, go, strict=True) if g}
            nxt = [i for i in nxt if plans[i].p_next is None or i in keep]
        live = nxt
    return n


def _commit(r: _Live, fb: StepFeedback, limit: int, step: int) -> None:
    """The engine's commit: accepted drafts + one correction/bonus token, cut at EOS and at max_tokens."""
    r.steps += 1
    r.drafted += fb.proposed
    r.accepted += fb.accepted
    r.sl.append(fb.proposed)
    emit = fb.accepted + 1
    eos = r.seq.eos_at
    new, reason = emit, ""
    if eos is not None and r.pos <= eos < r.pos + emit:
        new, reason = eos - r.pos, "stop"
    if r.out + new >= limit:  # the engine checks max_tokens after every token, before it could reach the EOS
        new, reason = limit - r.out, "length"
    if reason:
        r.done, r.reason = True, reason
    r.pos += emit
    r.out += new
    if new and r.first_step is None:
        r.first_step = step


# ---- the sweep ---------------------------------------------------------------------------------------------------
DEFAULT_SIM_POLICIES: tuple[str, ...] = (
    "off", "static:1", "static:2", "static:3", "static:4", "static:6", "static:8", "heuristic", "adaedl",
    "acceptance", "dsde-nocap", "dsde", "dsde-paper", "dsde-goodput", "oracle",
)


def sweep(traces: Sequence[Trace], policies: Sequence[str], batch_sizes: Sequence[int], profiles: Sequence[CostModel],
          num_requests: int | None = None, watch: int = 2,
          on_cell: Callable[[dict[str, Any]], None] | None = None,
          warm: Mapping[str, Trace] | None = None, closed: bool = False) -> dict[str, Any]:
    """Every (workload, batch, policy) replayed once, priced under every profile. Returns the results document.
    warm: per workload, the trace a policy that learns across requests serves first, untimed (see simulate).
    closed: each group of `batch` prompts runs as its own closed batch (see simulate); a cell's figures are over
    all of them."""
    warm = warm or {}
    if "off" not in policies:
        raise ConfigError("the policies must include 'off': speedups are measured against it")
    cells: list[dict[str, Any]] = []
    series: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    order = ["off", *(p for p in policies if p != "off")]
    aware = {p for p in order if make_sim_policy(p).cost_aware}
    for tr in traces:
        for bs in batch_sizes:
            n_req = num_requests  # closed: None, each prompt once (simulate refuses a count)
            if n_req is None and not closed:
                n_req = max(len(tr.seqs), 2 * bs)
            w = watch if bs == batch_sizes[0] else 0
            # a cost-aware policy's schedule depends on the profile: replayed once per profile, the rest once
            wt = warm.get(tr.workload)
            runs = {p: simulate(tr, p, bs, num_requests=n_req, watch=w, warm=wt, closed=closed)
                    for p in order if p not in aware}
            for i, cost in enumerate(profiles):
                runs.update({p: simulate(tr, p, bs, num_requests=n_req, watch=w if i == 0 else 0, cost=cost, warm=wt,
                                         closed=closed) for p in aware})
                for p, run in runs.items():
                    if i == 0 or p in aware:
                        series += [{"workload": tr.workload, "batch": bs, "policy": p, "request": rid, "steps": rows,
                                    **({"profile": cost.name} if p in aware else {})}
                                   for rid, rows in run.series.items()]
                group = []
                for p, run in runs.items():
                    recs, samples, total = run.priced(cost)
                    m = summarize(recs, samples, total).as_dict()
                    group.append({"kind": "sim", "workload": tr.workload, "temperature": 0.0, "batch": bs,
                                  "profile": cost.name, "policy": p, "label": p, "metrics": m})
                add_speedups(group)
                oracle = next((c["metrics"] for c in group if c["policy"] == "oracle"), None)
                for c in group:
                    if oracle:
                        c["metrics"]["oracle_gap"] = c["metrics"]["target_fwd_per_tok"] / oracle["target_fwd_per_tok"]
                    if on_cell:
                        on_cell(c)
                cells += group
    for c in add_static_opt(cells):
        if on_cell:
            on_cell(c)
    return {
        "kind": "simulate",
        "profiles": [asdict(p) for p in profiles],
        "traces": [{"workload": t.workload, "prompts": len(t.seqs), "max_tokens": t.max_tokens, "horizon": t.horizon,
                    "backend": t.backend, "positions": sum(len(s.tokens) for s in t.seqs),
                    "mean_match": _mean_match(t)} for t in traces],
        "warm_traces": [{"workload": t.workload, "prompts": len(t.seqs), "max_tokens": t.max_tokens}
                        for t in warm.values()],
        "closed": closed,
        "cells": cells,
        "series": series,
        "elapsed_s": time.perf_counter() - t0,
    }


def _mean_match(t: Trace) -> float:
    ms = [s.match(i) for s in t.seqs for i in range(s.output_len)]
    return sum(ms) / len(ms) if ms else math.nan
