"""Trace-driven simulator: replay any speculation policy on a recorded trace, at any batch size, under a step-cost
model; plus the oracle (hindsight-best k every step).

The replay runs the real policy objects through their real interface (plan -> StepFeedback -> observe ->
release) with the engine's own rules: k = min(plan.k, max_k) with max_k = min(max_sl, tokens left - 1); AdaEDL's
confidence stop; greedy acceptance = the longest prefix of the draft's rollout that equals the target's tokens;
EOS and max_tokens end a request; continuous batching refills a slot before the next step. At temperature 0 the
schedule of steps does not depend on time, so it is computed once and then priced under every cost model.

Cost model of one step with per-sequence k_i (B sequences; `fwd(n)` = base + per_token * max(0, n - knee)):
    draft  = sum over j = 1..max k of draft_fwd(tokens of the j-th batched draft forward)
    target = target_fwd(sum_i (k_i + 1))            ragged verification (this engine)
           = target_fwd(B * (max_i k_i + 1))        padded verification (vLLM-style engines, `padded`)
A request's prompt is added to the tokens of its first step's forwards. With `padded`, every draft forward runs
the whole batch (as a GPU engine does); ragged, only the sequences still drafting.
Profiles: "measured" (this machine, from `measure_costs`), "cpu" (the same shape with constants measured once on
the development machine), "gpu" (a memory-bound accelerator: flat cost up to `knee` tokens, a 1B/70B-like draft
costing `ratio` = 5% of a target forward, padded verification); any of them can be adjusted with
"name:key=value,...", keys ratio, knee, base_ms, per_token_ms, padded.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dsde_bench.metrics import RequestRecord, StepRow, StepSample, add_speedups, add_static_opt, summarize
from dsde_bench.recording import RecordingPolicy
from dsde_bench.trace import SeqTrace, Trace
from dsde_core.cost import StepCosts
from dsde_core.errors import ConfigError
from dsde_core.policies import Plan, SeqInfo, SpeculationPolicy, StepFeedback, make_policy
from dsde_core.policies.adaedl import entropy_confidence, should_stop
from dsde_core.policies.base import clamp_k

PREFILL_SPAN = 256  # context tokens over which a profile's draft prefill cost per token is averaged (the measured
# tables' range: benchmarks/gpu_costs.py times forwards of up to 256 tokens)


# ---- cost models ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    """Seconds of one batched forward of n query tokens: base + per_token * max(0, n - knee), per model."""

    name: str
    target_base_s: float
    target_per_token_s: float
    draft_base_s: float
    draft_per_token_s: float
    knee: int = 1  # of the target
    padded: bool = False
    draft_knee: int | None = None  # None: the target's knee
    points: dict[str, list[list[float]]] | None = None  # measured (n, seconds) pairs the fit came from
    table: bool = False  # price forwards by the points themselves (interpolated), not by the hinge fitted to them

    def __post_init__(self) -> None:
        for f in ("target_base_s", "target_per_token_s", "draft_base_s", "draft_per_token_s"):
            if not getattr(self, f) >= 0:
                raise ConfigError(f"cost model {self.name!r}: {f} must be >= 0, got {getattr(self, f)}")
        if self.target_base_s <= 0:
            raise ConfigError(f"cost model {self.name!r}: target_base_s must be > 0")
        if self.knee < 1 or (self.draft_knee is not None and self.draft_knee < 1):
            raise ConfigError(f"cost model {self.name!r}: knees must be >= 1, got {self.knee}, {self.draft_knee}")

    def target_fwd(self, n: int) -> float:
        if self.table and self.points:
            return _interpolate(self.points["target"], n)
        return self.target_base_s + self.target_per_token_s * max(0, n - self.knee)

    def draft_fwd(self, n: int) -> float:
        if self.table and self.points:
            return _interpolate(self.points["draft"], n)
        knee = self.knee if self.draft_knee is None else self.draft_knee
        return self.draft_base_s + self.draft_per_token_s * max(0, n - knee)

    def draft_context_per_token(self, batch: int) -> float:
        """C, a context token the draft takes in beside `batch` rows (a first draft step's prefill, which `step` prices
        as draft_fwd(rows + context)): the mean over PREFILL_SPAN tokens, as the engine's cost model learns it. Not the
        slope of a table cut at the step's tokens (StepCosts' default), which a noisy or flat short table makes ~0."""
        return max(self.draft_fwd(batch + PREFILL_SPAN) - self.draft_fwd(batch), 0.0) / PREFILL_SPAN

    @property
    def ratio(self) -> float:
        """A draft forward over a target forward, at one token."""
        return self.draft_base_s / self.target_base_s

    def step(self, ks: Sequence[int], extra: Sequence[int] = (),
             draft_extra: Sequence[int] | None = None) -> tuple[float, float]:
        """(draft seconds, target seconds) of one step. ks: k per running sequence (0 included); extra: prompt
        tokens the target is fed this step per sequence (0 for all but newly admitted ones); draft_extra: the same
        for the draft (default: extra; the engine feeds a sequence's context to the draft when it first drafts)."""
        extra = list(extra) or [0] * len(ks)
        d_extra = extra if draft_extra is None else list(draft_extra)
        kmax = max(ks, default=0)
        b = len(ks)
        draft = 0.0
        for j in range(1, kmax + 1):
            live = [i for i, k in enumerate(ks) if k >= j] if not self.padded else list(range(b))
            n = len(live) + (sum(d_extra[i] for i in live) if j == 1 else 0)
            draft += self.draft_fwd(n)
        n_target = b * (kmax + 1) if self.padded else sum(k + 1 for k in ks)
        return draft, self.target_fwd(n_target + sum(extra))

    def tables(self, batch: int, n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The verify and draft tables (n = 1..) a cost-aware policy sees at `batch`. Padded (vLLM-style): a draft
        forward always runs the whole batch, and the verification pads every sequence to the longest."""
        b = max(batch, 1)
        verify = tuple(self.target_fwd(i) for i in range(1, n + 1))
        draft = tuple(self.draft_fwd(b) if self.padded else self.draft_fwd(i) for i in range(1, n + 1))
        return verify, draft


class ProfileCosts:
    """Stands in for the engine's OnlineCostModel: the profile's own tables, whatever the engine measures, so that an
    engine running a cost-aware policy plans exactly what the simulator replays (validation). A profile has no context
    term: the batch's context is ignored."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.observed = 0

    def estimate(self, batch: int, max_tokens: int | None = None, context: int = 0) -> StepCosts:
        b = max(batch, 1)
        verify, draft = self.cost.tables(b, max(max_tokens or b * 21, b + 1))
        return StepCosts(b, verify, draft, self.cost.padded, self.cost.draft_context_per_token(b))

    def observe(self, verify_tokens: int, verify_s: float, draft_forwards: int, draft_rows: int,
                draft_s: float, draft_context: int = 0, context: int = 0) -> None:
        self.observed += 1


def _interpolate(points: Sequence[Sequence[float]], n: float) -> float:
    """Seconds at n from measured (n, seconds) pairs: linear between them, flat before the first, and past the last
    on the slope of the last two."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    if n <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if n <= xs[i]:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (n - xs[i - 1]) / (xs[i] - xs[i - 1])
    slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])) if len(xs) > 1 else 0.0
    return ys[-1] + slope * (n - xs[-1])


GPU_BASE_S = 0.030
"""A 70B-class target decode step on GPUs (8xA100 in the paper): ~30 ms; only ratios matter for speedups."""
GPU_KNEE = 256
"""Query tokens a GPU forward absorbs at flat cost (memory-bound) before it turns compute-bound."""

# Constants for the "cpu" profile: measure_costs on the development machine (2 shared cores, bf16, the embedded
# Qwen2.5-Coder 1.5B target / 0.5B draft, 128-token context; min of 5). `measured` re-measures on the machine at
# hand; `engine` is fitted from the engine's own step timings in results/bench.json (sampling overheads included).
CPU_TARGET_BASE_S = 0.075
CPU_TARGET_PER_TOKEN_S = 0.0034
CPU_TARGET_KNEE = 4
CPU_DRAFT_BASE_S = 0.020
CPU_DRAFT_PER_TOKEN_S = 0.0012


def builtin_profile(name: str) -> CostModel:
    if name == "cpu":
        return CostModel("cpu", CPU_TARGET_BASE_S, CPU_TARGET_PER_TOKEN_S, CPU_DRAFT_BASE_S, CPU_DRAFT_PER_TOKEN_S,
                         knee=CPU_TARGET_KNEE, draft_knee=1)
    if name == "gpu":
        return CostModel("gpu", GPU_BASE_S, GPU_BASE_S / GPU_KNEE, 0.05 * GPU_BASE_S, 0.05 * GPU_BASE_S / GPU_KNEE,
                         knee=GPU_KNEE, padded=True)
    raise ConfigError(f"unknown cost profile {name!r}; valid: measured, engine, cpu, gpu, or a NAME given by "
                      "--costs NAME=FILE (with :key=value,... overrides)")


def parse_profile(spec: str, measured: CostModel | None = None, engine: CostModel | None = None,
                  files: Mapping[str, CostModel] | None = None) -> CostModel:
    """'gpu', 'cpu', 'measured', 'engine', a name of `files` (costs files: `--costs NAME=FILE`), or any of them with
    overrides: 'gpu:ratio=0.2,knee=64', 'cpu:padded=1'."""
    name, _, args = spec.strip().partition(":")
    if files and name in files:
        base = files[name]
    elif name in ("measured", "engine"):
        got = measured if name == "measured" else engine
        if got is None:
            raise ConfigError(f"cost profile {name!r} needs " + ("a measurement (measure_costs) or a costs file"
                              if name == "measured" else "engine step timings (run `dsde bench` first)"))
        base = replace(got, name=name)
    else:
        base = builtin_profile(name)
    if not args:
        return base
    kw: dict[str, Any] = {}
    for item in args.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        try:
            num = float(value)
        except ValueError:
            raise ConfigError(f"cost profile {spec!r}: cannot read {item!r} as key=number") from None
        if not eq:
            raise ConfigError(f"cost profile {spec!r}: {item!r} is not key=value")
        if base.table and key != "ratio":
            raise ConfigError(f"cost profile {spec!r}: a measured table takes only 'ratio'")
        if key == "ratio":
            kw["draft_base_s"] = num * base.target_base_s
            kw["draft_per_token_s"] = num * base.target_per_token_s
            if base.table and base.points:  # the draft's points become ratio x the target's
                kw["points"] = {**base.points, "draft": [[n, num * y] for n, y in base.points["target"]]}
        elif key == "knee":
            kw["knee"] = int(num)
        elif key == "base_ms":
            kw["target_base_s"] = num / 1000.0
        elif key == "per_token_ms":
            kw["target_per_token_s"] = num / 1000.0
        elif key == "padded":
            kw["padded"] = bool(num)
        else:
            raise ConfigError(f"cost profile {spec!r}: unknown key {key!r}; valid: ratio, knee, base_ms, "
                              "per_token_ms, padded")
    if "ratio" not in [i.partition("=")[0].strip() for i in args.split(",")] and (
            "target_base_s" in kw or "target_per_token_s" in kw):
        r = base.ratio  # keep the draft/target ratio when the target's cost changes
        tb = kw.get("target_base_s", base.target_base_s)
        kw.setdefault("draft_base_s", r * tb)
        scale = kw.get("target_per_token_s", base.target_per_token_s) / base.target_per_token_s \
            if base.target_per_token_s else 1.0
        kw.setdefault("draft_per_token_s", base.draft_per_token_s * scale)
    return replace(base, name=spec.strip(), **kw)


def load_costs_file(name: str, path: str | Path) -> CostModel:
    """The measured table of a costs file (results/costs.json's format: measure_costs on this machine, or
    benchmarks/gpu_costs.py on another), as the profile `name`."""
    if name in ("measured", "engine", "cpu", "gpu"):
        raise ConfigError(f"--costs {name}=...: {name!r} is a built-in profile; choose another name")
    try:
        model = json.loads(Path(path).read_text())["model"]
        return replace(CostModel(**model), name=name)
    except FileNotFoundError:
        raise ConfigError(f"--costs {name}={path}: no such file") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--costs {name}={path}: not a costs file (a JSON object with a 'model' cost model): "
                          f"{e}") from None


MEASURED_SIZES: tuple[int, ...] = (*range(1, 49), 56, 64, 80, 96, 128, 160, 192, 256)
"""Query tokens timed by measure_costs: every n up to 48 (a CPU GEMM's cost steps at multiples of 16), then sparser."""


@torch.inference_mode()
def measure_costs(target: Any, draft: Any, context: int = 128, repeats: int = 3,
                  sizes: Sequence[int] = MEASURED_SIZES, slot: int = 0) -> CostModel:
    """Time forwards of n query tokens after a `context`-token prefix, for each runner: the profile prices forwards
    by these points (a table), and also carries the hinge base + per_token * max(0, n - knee) fitted to them. The
    minimum of `repeats` timings is kept: on a shared machine other work only ever adds time. Uses one slot of each
    runner and leaves it empty."""
    def timings(runner: Any) -> list[list[float]]:
        def done() -> float:  # a GPU forward returns before it has run: wait for it before reading the clock
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            return time.perf_counter()

        runner.set_length(slot, 0)
        runner.forward([slot], [[1] * context], [1])  # the prefix's KV stays; each timing rolls back to it
        ns = [n for n in sizes if context + n <= runner.cache.max_seq_len]
        best = {n: math.inf for n in ns}
        for rep in range(repeats + 1):  # pass 0 only warms up: the first call of a shape pays one-off costs
            for n in ns:  # sizes interleaved, so that a burst of other work does not bias one size
                runner.set_length(slot, context)
                t0 = done()
                runner.forward([slot], [[1] * n], [n]).cpu()  # as the workers do (a no-op on the CPU)
                if rep:
                    best[n] = min(best[n], done() - t0)
        runner.set_length(slot, 0)
        return [[float(n), best[n]] for n in ns]

    tp, dp = timings(target), timings(draft)
    tb, tt, tk = fit_hinge(tp)
    db, dt, dk = fit_hinge(dp)
    return CostModel("measured", tb, tt, db, dt, knee=tk, draft_knee=dk, points={"target": tp, "draft": dp},
                     table=True)


def fit_engine_steps(rows: Sequence[Sequence[float]], beyond: CostModel | None = None) -> CostModel:
    """A cost model from the engine's own step timings (bench.json "steps", StepRow); steps that carried a prompt
    are left out. Target: seconds against query tokens batch + sum_k; draft: seconds per draft call against the
    batch. The fastest step of each group is fitted: on a shared machine other work only ever adds time (a median
    still carries minutes-long bursts).

    beyond: a measured model (measure_costs) that prices forwards larger than any the engine ran (a draft's prefill,
    a batch of 16): past its last point each table follows `beyond`'s increments, not the slope of its own last two
    points (the draft's are per-row decode costs at batch 1 to 4, far steeper than a prefill's per-token cost)."""
    t_groups: dict[int, list[float]] = {}
    d_groups: dict[int, list[float]] = {}
    for r in (StepRow(*row) for row in rows):
        if r.prefill:
            continue
        t_groups.setdefault(int(r.batch + r.sum_k), []).append(r.target_s)
        if r.calls > 0:
            d_groups.setdefault(int(r.batch), []).append(r.draft_s / r.calls)
    if not t_groups or not d_groups:
        raise ConfigError("no engine steps with drafts to fit a cost model from")
    tp = [[float(n), min(v)] for n, v in sorted(t_groups.items())]
    dp = [[float(n), min(v)] for n, v in sorted(d_groups.items())]
    tb, tt, tk = fit_hinge(tp)  # the hinge summarises what the engine ran; the tables price
    db, dt, dk = fit_hinge(dp)
    if beyond is not None:
        tp, dp = _continue(tp, beyond.target_fwd), _continue(dp, beyond.draft_fwd)
    return CostModel("engine", tb, tt, db, dt, knee=tk, draft_knee=dk, points={"target": tp, "draft": dp},
                     table=True)


def _continue(points: list[list[float]], fwd: Callable[[int], float]) -> list[list[float]]:
    """points extended past their last n with fwd's increments, at powers of two up to 4096 tokens."""
    n0, y0 = points[-1]
    ns = [2 ** i for i in range(1, 13) if 2 ** i > n0]
    return points + [[float(n), y0 + fwd(n) - fwd(int(n0))] for n in ns]


def fit_hinge(points: Sequence[Sequence[float]]) -> tuple[float, float, int]:
    """(base, per_token, knee) of y = base + per_token * max(0, n - knee), least squares, knee among the ns."""
    best = None
    for knee in sorted({int(n) for n, _ in points}):
        xs = [max(0.0, n - knee) for n, _ in points]
        ys = [y for _, y in points]
        a, b = _least_squares(xs, ys)
        err = sum((a + b * x - y) ** 2 for x, y in zip(xs, ys, strict=True))
        if best is None or err < best[0] - 1e-15:
            best = (err, a, b, knee)
    assert best is not None
    return best[1], best[2], best[3]


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope >= 0) of y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    b = max(0.0, b)
    return max(my - b * mx, min(ys) * 0.5), b


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
