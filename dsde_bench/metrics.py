"""The arithmetic of a benchmark cell: per-request records and engine steps in, one row of figures out.

Definitions (every figure of BENCHMARKS.md comes from here):
- mean_e2e_s: mean over requests of (finish - admission).
- output_tok_s: output tokens of all requests / wall time of the cell (first admission to last finish).
- acceptance_rate: accepted draft tokens / proposed draft tokens, pooled over requests.
- mean_accepted_length: tokens emitted per target verification step, pooled: (accepted + steps) / steps.
- target_fwd_per_tok: target forward passes per output token, per sequence: (sum of the steps each request took
  part in) / output tokens. A batched forward counts once for every sequence in it; at batch 1 it is exactly
  the number of target forwards. 1.0 for target-only decoding (a request's prefill step emits its first token).
- draft_fwd_per_tok: draft forward passes per output token, per sequence: proposed draft tokens / output tokens.
- target_calls_per_tok / draft_calls_per_tok: the batched calls per output token, from the engine's steps: one
  target call per step, max_i k_i draft calls per step (the draft runs the longest k for the whole batch).
- sl_mean / sl_std: mean and population standard deviation of the tokens proposed per step, over all steps of
  all requests.
- speedup: target-only mean_e2e_s / this mean_e2e_s in the same (workload, temperature, batch) group;
  throughput_ratio: output_tok_s / target-only output_tok_s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from dsde_core.request import RequestStats


@dataclass
class RequestRecord:
    """What one finished request contributes to a cell."""

    prompt_id: str
    prompt_tokens: int
    output_tokens: int
    steps: int  # target verification steps the request took part in
    drafted: int
    accepted: int
    sl: list[int] = field(default_factory=list)  # tokens proposed at each step
    e2e_s: float | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    finish_reason: str = ""

    @classmethod
    def from_stats(cls, prompt_id: str, prompt_tokens: int, output_tokens: int, stats: RequestStats,
                   finish_reason: str = "") -> RequestRecord:
        return cls(prompt_id, prompt_tokens, output_tokens, stats.steps, stats.drafted, stats.accepted,
                   list(stats.sl), stats.e2e, stats.ttft, stats.itl, finish_reason)


class StepRow(NamedTuple):
    """A step as bench.json's "steps" keep it (StepSample.row): StepRow(*row). A row without the contexts and the
    tokens emitted reads them as 0."""

    batch: int
    sum_k: int
    calls: int  # draft forwards (levels)
    draft_s: float
    target_s: float
    prefill: int  # 1: a request was admitted before this step
    ctx_sum: int = 0  # committed tokens over the rows
    ctx_max: int = 0  # the longest row's
    emitted: int = 0


@dataclass
class StepSample:
    """One engine step, as the cost model and the batched-call figures need it."""

    batch: int
    ks: list[int]  # tokens proposed per sequence (0 for a sequence that proposed none)
    draft_s: float
    target_s: float
    prefill: bool = False  # a request was admitted before this step (its prompt was in the forward)
    contexts: list[int] = field(default_factory=list)  # committed tokens per sequence (engine runs; [] if simulated)
    emitted: int = 0  # tokens the step emitted (engine runs; 0 if simulated)

    @property
    def draft_calls(self) -> int:
        return max(self.ks, default=0)

    @property
    def target_tokens(self) -> int:
        """Query tokens of the verification forward outside prefill: one pending token per sequence + drafts."""
        return self.batch + sum(self.ks)

    def row(self) -> list[float]:
        """The step as bench.json's "steps" keep it: the fields of StepRow, in order (a list: JSON)."""
        return [self.batch, sum(self.ks), self.draft_calls, round(self.draft_s, 6), round(self.target_s, 6),
                int(self.prefill), sum(self.contexts), max(self.contexts, default=0), self.emitted]


@dataclass
class CellMetrics:
    requests: int
    output_tokens: int
    wall_s: float
    mean_e2e_s: float
    p50_e2e_s: float
    mean_ttft_s: float
    mean_itl_s: float
    output_tok_s: float
    acceptance_rate: float
    mean_accepted_length: float
    target_fwd_per_tok: float
    draft_fwd_per_tok: float
    target_calls_per_tok: float | None
    draft_calls_per_tok: float | None
    sl_mean: float
    sl_std: float
    speedup: float | None = None
    throughput_ratio: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def std(xs: Iterable[float]) -> float:
    """Population standard deviation (nan for no values)."""
    xs = list(xs)
    if not xs:
        return math.nan
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    s = sorted(xs)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def summarize(reqs: Sequence[RequestRecord], steps: Sequence[StepSample] | None, wall_s: float) -> CellMetrics:
    """One cell's figures from its finished requests and (optionally) the engine steps it ran."""
    if not reqs:
        raise ValueError("a cell needs at least one finished request")
    out_tokens = sum(r.output_tokens for r in reqs)
    n_steps = sum(r.steps for r in reqs)
    drafted = sum(r.drafted for r in reqs)
    accepted = sum(r.accepted for r in reqs)
    sls = [k for r in reqs for k in r.sl]
    e2e = [r.e2e_s for r in reqs if r.e2e_s is not None]
    calls_t = calls_d = None
    if steps is not None:
        calls_t = ratio(len(steps), out_tokens)
        calls_d = ratio(sum(s.draft_calls for s in steps), out_tokens)
    return CellMetrics(
        requests=len(reqs),
        output_tokens=out_tokens,
        wall_s=wall_s,
        mean_e2e_s=mean(e2e),
        p50_e2e_s=percentile(e2e, 50),
        mean_ttft_s=mean(r.ttft_s for r in reqs if r.ttft_s is not None),
        mean_itl_s=mean(r.itl_s for r in reqs if r.itl_s is not None),
        output_tok_s=ratio(out_tokens, wall_s),
        acceptance_rate=ratio(accepted, drafted) if drafted else 0.0,
        mean_accepted_length=ratio(accepted + n_steps, n_steps),
        target_fwd_per_tok=ratio(n_steps, out_tokens),
        draft_fwd_per_tok=ratio(drafted, out_tokens),
        target_calls_per_tok=calls_t,
        draft_calls_per_tok=calls_d,
        sl_mean=mean(sls) if sls else 0.0,
        sl_std=std(sls) if sls else 0.0,
    )


def add_speedups(cells: list[dict[str, Any]], baseline: str = "off") -> None:
    """Fill metrics.speedup and metrics.throughput_ratio of every cell against the baseline policy's cell of
    the same (workload, temperature, batch) group, in place. Cells without a baseline keep None."""
    base = {_group(c): c["metrics"] for c in cells if c["policy"] == baseline}
    for c in cells:
        b = base.get(_group(c))
        if b is None:
            continue
        m = c["metrics"]
        m["speedup"] = ratio(b["mean_e2e_s"], m["mean_e2e_s"])
        m["throughput_ratio"] = ratio(m["output_tok_s"], b["output_tok_s"])


def _group(cell: dict[str, Any]) -> tuple:
    """Cells compared with each other: same workload, temperature, batch (and cost profile, for simulations)."""
    return cell["workload"], cell["temperature"], cell["batch"], cell.get("profile")


def static_k(policy: str) -> int | None:
    """'static:3' -> 3; anything else -> None."""
    name, _, arg = policy.partition(":")
    return int(arg) if name == "static" and arg.isdigit() else None


def add_static_opt(cells: list[dict[str, Any]], key: str = "mean_e2e_s") -> list[dict[str, Any]]:
    """Append one 'static-opt' cell per (workload, temperature, batch): the static k with the lowest `key`
    (hindsight over the sweep, as the paper's Static-opt). Returns the added cells."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for c in cells:
        if static_k(c["policy"]) is not None and c.get("kind") != "anchor":
            groups.setdefault(_group(c), []).append(c)
    added = []
    for members in groups.values():
        best = min(members, key=lambda c: (c["metrics"][key], static_k(c["policy"])))
        added.append({**best, "policy": "static-opt", "label": f"Static-opt (k={static_k(best['policy'])})",
                      "static_opt_k": static_k(best["policy"]), "metrics": dict(best["metrics"])})
    cells.extend(added)
    return added


# ---- server mode: the figures `vllm bench serve` prints ------------------------------------------------------
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class StreamRecord:
    """One streamed HTTP request: its start, the arrival time of every content chunk, and its token counts."""

    start: float
    chunk_times: list[float]
    output_tokens: int
    prompt_tokens: int = 0
    ok: bool = True
    error: str = ""
    usage_reported: bool = False  # token counts came from the server's usage chunk
    speculation: dict[str, Any] | None = None  # the server's per-request speculation stats, when it sends them

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        return self.chunk_times[-1] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks (a speculative step streams several tokens in one chunk)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2el - ttft) / (output_tokens - 1)."""
        if not self.chunk_times or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def serve_metrics(records: Sequence[StreamRecord], duration_s: float,
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """vllm bench serve's names: completed, request_throughput, output_throughput, total_token_throughput,
    {mean,median,std,p<q>}_{ttft,tpot,itl,e2el}_ms."""
    ok = [r for r in records if r.ok and r.chunk_times]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    res: dict[str, float] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration_s,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": ratio(len(ok), duration_s),
        "output_throughput": ratio(out_tok, duration_s),
        "total_token_throughput": ratio(out_tok + in_tok, duration_s),
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itls],
        "e2el": [r.e2el for r in ok],
    }
    for name, xs in series.items():
        ms = [x * 1000.0 for x in xs]
        res[f"mean_{name}_ms"] = mean(ms)
        res[f"median_{name}_ms"] = percentile(ms, 50)
        res[f"std_{name}_ms"] = std(ms)
        for q in percentiles:
            res[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return res
