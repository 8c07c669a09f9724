"""Step-cost models for the simulator: what one batched forward of n query tokens costs the draft and the target.

A profile prices a forward by base + per_token * max(0, n - knee) per model, or by a table of timed points
(interpolated). Profiles: "measured" (timed on this machine, `measure_costs`), "engine" (fitted from the engine's own
step timings in a `dsde bench` run), "cpu" (the same shape with constants measured once on a 2-core CPU), "gpu" (a
memory-bound accelerator: flat up to `knee` tokens, a draft costing `ratio` = 5% of a target forward, padded
verification), and any costs file (`--costs NAME=FILE`); each takes "name:key=value,..." overrides (ratio, knee,
base_ms, per_token_ms, padded). ProfileCosts hands a profile's tables to a cost-aware policy in place of the
engine's online cost model.

Cost of one step with per-sequence k_i (B sequences; fwd(n) as above):
    draft  = sum over j = 1..max k of draft_fwd(tokens of the j-th batched draft forward)
    target = target_fwd(sum_i (k_i + 1))            ragged verification (this engine)
           = target_fwd(B * (max_i k_i + 1))        padded verification (vLLM-style engines, `padded`)
A request's prompt is added to the tokens of its first step's forwards. With `padded`, every draft forward runs
the whole batch (as a GPU engine does); ragged, only the sequences still drafting.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dsde_bench.metrics import StepRow
from dsde_core.cost import StepCosts
from dsde_core.errors import ConfigError

PREFILL_SPAN = 256  # context tokens over which a profile's draft prefill cost per token is averaged (the measured
# tables' range: benchmarks/gpu_costs.py times forwards of up to 256 tokens)


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
