"""The step-cost model: what the forwards of a step will cost, learnt online from the steps the engine times.

One engine step over a batch of B sequences, sequence i feeding n_i pending tokens (1 when decoding) and k_i drafts:
    verify = V(sum_i (n_i + k_i), c)                          one ragged target forward
    draft  = sum_{l=1..max k} D(m_l) + C * (context tokens)   one batched draft forward per level
with m_l the rows drafting at level l, c the longest row's context, and
    V(n, c) = V(n) exp(gamma c)    seconds of a target forward over n query tokens
    D(m) = D0 + D1 m               seconds of a draft forward over m rows
    C                              seconds per context token the draft takes in (a first draft step's prefill)

V(n) is a table, not a line: a CPU GEMM is flat in the rows up to a block (16 in oneDNN) and then jumps; a GPU forward
is flat up to its compute knee. The target is timed on its own every step with its exact n, so each entry is the
median of the last `memory` times at that n (a shared machine's bursts would pull a running mean up for as long as
it remembers them), and the medians are made non-decreasing by a weighted isotonic fit (pool adjacent violators, each n
weighted by its times: one slow forward at an n seen once is averaged with the well-known n above it instead of
raising every n above it, as a running maximum would). An n not seen is priced linearly between the n seen around it
(optimistic just past a jump, so that n gets tried once and learnt), and past them by the prior scaled to the nearest.

gamma: attention runs over caches padded to the longest row, so a forward costs more the longer its context. The
table is kept at c = 0 (each time divided by exp(gamma c) before the medians are taken) and scaled to a batch's c;
gamma is the slope of log seconds on c among forwards over the same n (ContextSlope; 0 until contexts vary). A table
by n alone would mix contexts: target-only steps come with the long prompt that turned drafting off, drafting steps
at short contexts, and drafting would look cheaper than it is. The draft's calls are scaled by the same factor.

D and C: the draft is timed per call (several levels), so (D0, D1) is fitted by recursive least squares (_RLS) to
(forwards, rows summed over them) -> seconds on the calls that only drafted. A call that also took in context tokens
(a first draft step prefills the draft with the whole context; a lagging cache catches up) prices C instead, a
running mean of its time beyond D over its context tokens: a prefill is one efficient GEMM, so a context token costs
far less than the decode row D1 would charge for it. After a pause in drafting longer than the fit's memory the fit
is reopened (its values kept, not its confidence): what it remembers is old, and a burst of other work before the
pause must not price the draft for good.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dsde_core.errors import ConfigError


def _extend(table: Sequence[float], n: int) -> float:
    """table[n - 1] for n = 1..len; past the end, linear on the slope of the last 16 entries; 0 for n <= 0."""
    if n <= 0:
        return 0.0
    if n <= len(table):
        return table[n - 1]
    span = min(16, len(table) - 1)
    slope = (table[-1] - table[-1 - span]) / span if span > 0 else 0.0
    return table[-1] + max(slope, 0.0) * (n - len(table))


def isotonic(y: Sequence[float], w: Sequence[float]) -> np.ndarray:
    """The non-decreasing sequence closest to y in weighted least squares (pool adjacent violators): a run that
    decreases is replaced by its weighted mean."""
    blocks: list[tuple[float, float, int]] = []  # (value, weight, entries)
    for yi, wi in zip(y, w, strict=True):
        v, wt, c = float(yi), float(wi), 1
        while blocks and blocks[-1][0] > v:
            pv, pw, pc = blocks.pop()
            v, wt, c = (pv * pw + v * wt) / (pw + wt), pw + wt, pc + c
        blocks.append((v, wt, c))
    return np.repeat([b[0] for b in blocks], [b[2] for b in blocks])


@dataclass(frozen=True)
class StepCosts:
    """Predicted seconds of the forwards of one step at batch size `batch`."""

    batch: int
    verify_table: tuple[float, ...]  # [N]: a target forward over n = 1..N query tokens (non-decreasing)
    draft_table: tuple[float, ...]  # [M]: a draft forward over n = 1..M query tokens
    padded: bool = False  # the target verifies every sequence padded to the longest draft (vLLM-style engines)
    context_per_token_s: float | None = None  # C: the draft taking in a context token; None: the draft table's slope

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ConfigError(f"StepCosts.batch must be >= 1, got {self.batch}")
        if not self.verify_table or not all(v > 0 for v in self.verify_table):
            raise ConfigError("StepCosts.verify_table must be non-empty and positive")
        if not self.draft_table or not all(v >= 0 for v in self.draft_table):
            raise ConfigError("StepCosts.draft_table must be non-empty and non-negative")

    def verify(self, n: int) -> float:
        """Seconds of a target forward over n query tokens."""
        return _extend(self.verify_table, n)

    def draft(self, n: int) -> float:
        """Seconds of a draft forward over n query tokens; 0 for no forward."""
        return _extend(self.draft_table, n)

    def draft_context(self, n: int) -> float:
        """Seconds the draft adds to a forward to take in n context tokens (a first draft step's prefill)."""
        if n <= 0:
            return 0.0
        if self.context_per_token_s is not None:
            return self.context_per_token_s * n
        return self.draft(self.batch + n) - self.draft(self.batch)

    def step_s(self, ks: Sequence[int], base: int | None = None) -> float:
        """Seconds of a step in which sequence i proposes ks[i] and the target is fed `base` tokens besides the drafts
        (default: one per sequence)."""
        levels = sum(self.draft(sum(k >= level for k in ks)) for level in range(1, max(ks, default=0) + 1))
        drafts = len(ks) * max(ks, default=0) if self.padded else sum(ks)
        return self.verify((len(ks) if base is None else base) + drafts) + levels

    # the model at a glance (gauges): at this batch, around k = 0
    @property
    def verify_s(self) -> float:
        return self.verify(self.batch)

    @property
    def verify_per_token_s(self) -> float:
        return (self.verify(5 * self.batch) - self.verify(self.batch)) / (4 * self.batch)

    @property
    def draft_fwd_s(self) -> float:
        return self.draft(self.batch)

    @property
    def draft_per_token_s(self) -> float:
        return (self.draft(2 * self.batch) - self.draft(self.batch)) / self.batch


@dataclass(frozen=True)
class CostPrior:
    """The model before any measurement, in seconds (shaped like the default pair on a CPU: a draft forward ~1/4
    of a target's)."""

    verify_base_s: float = 0.080
    verify_per_token_s: float = 0.002
    draft_fwd_s: float = 0.020  # the draft's prior is scaled by V(1) seen / verify_base_s (OnlineCostModel)
    draft_per_token_s: float = 0.002
    draft_context_per_token_s: float = 0.0005  # C: a context token the draft takes in (a prefill's, not a decode row's)
    weight: float = 4.0  # how many observations the draft prior is worth
    forgetting: float = 0.98  # per observation: the draft fit's memory is ~1 / (1 - forgetting) = 50 steps
    memory: int = 20  # a verify table entry is the median of its last memory observations; C a running mean of ~as many
    context_min: int = 16  # a draft call with this many context tokens prices C, not D
    context_window: int = 256  # forwards the context slope is fitted over
    context_spread: float = 256.0  # tokens: the slope's prior (0) counts as `weight` forwards this far apart in context

    def verify(self, n: int) -> float:
        return self.verify_base_s + self.verify_per_token_s * max(n - 1, 0)


class _RLS:
    """Recursive least squares y ~ x . theta with exponential forgetting f, covariance P:
        g = P x / (f + x^T P x);   theta <- theta + g (y - x . theta);   P <- (P - g (P x)^T) / f

    Forgetting divides the covariance by f every update; in a direction the features never vary in (a steady
    batch size, k_i all equal) nothing shrinks it again, so it would grow as f^-n ("covariance windup") and
    overflow after ~10^4 steps. Its eigenvalues are therefore capped at WINDUP times the prior's largest variance
    (which keeps it symmetric positive semi-definite and leaves the excited directions alone), and an update that
    is not finite is dropped."""

    WINDUP = 100.0  # the covariance never grows past this many times the prior's

    def __init__(self, theta: Sequence[float], typical: Sequence[float], weight: float, forgetting: float) -> None:
        self.theta = np.asarray(theta, dtype=np.float64)
        # P is the coefficients' covariance over the timing noise's variance (the normal equations' inverse), so a
        # prior worth `weight` observations of each feature at its typical size x is P0 = 1 / (weight x^2), whatever
        # the noise and the coefficient's size
        self.p = np.diag(1.0 / (weight * np.asarray(typical, dtype=np.float64) ** 2))
        self.max_var = self.WINDUP * float(np.max(np.diag(self.p)))  # windup cap
        self.forgetting = forgetting
        self.p0 = self.p.copy()  # [2, 2] the prior's covariance

    def reopen(self) -> None:
        """Keep the fit's values but (almost) none of its confidence, P + WINDUP P0 (the old data then count for a
        hundredth of the prior's `weight` observations): after a long pause the next observations decide."""
        self.p = self.p + self.WINDUP * self.p0

    def update(self, x: Sequence[float], y: float) -> None:
        x = np.asarray(x, dtype=np.float64)
        px = self.p @ x
        gain = px / (self.forgetting + x @ px)
        theta = self.theta + gain * (y - x @ self.theta)
        p = (self.p - np.outer(gain, px)) / self.forgetting
        if not (np.all(np.isfinite(theta)) and np.all(np.isfinite(p))):
            return
        if np.max(np.diag(p)) > self.max_var:  # only then: an eigendecomposition per update is not needed
            w, v = np.linalg.eigh((p + p.T) / 2)
            p = (v * np.minimum(w, self.max_var)) @ v.T
        self.theta, self.p = theta, p


class ContextSlope:
    """gamma, the log seconds a forward adds per token of its longest row's context, V(n, c) = V(n, 0) exp(gamma c):
    the slope of log seconds on context among forwards over the same n query tokens (a within-n regression over the
    last `window` forwards, so that neither the n nor the machine's drift between them enters it), shrunk towards 0 by
    `prior` (in tokens^2: the prior counts as that spread of context behind a slope of 0), and never below 0.
        gamma = max(0, Sxy / (Sxx + prior)),  Sxy = sum_n sum_i (c_i - cbar_n)(y_i - ybar_n),  Sxx alike with c
    The sums are kept per n and moved as forwards enter and leave the window (no pass over it per step)."""

    def __init__(self, window: int, prior: float) -> None:
        self.window, self.prior = window, prior
        self._recent: deque[tuple[int, int, float]] = deque()  # (n, context, log seconds)
        self._sums: defaultdict[int, np.ndarray] = defaultdict(lambda: np.zeros(5))  # n -> [count, c, y, c^2, c y]
        self.value = 0.0

    def observe(self, n: int, context: int, log_s: float) -> None:
        self._recent.append((n, context, log_s))
        self._sums[n] += (1.0, context, log_s, context * context, context * log_s)
        if len(self._recent) > self.window:
            m, c, y = self._recent.popleft()
            self._sums[m] -= (1.0, c, y, c * c, c * y)
            if self._sums[m][0] < 0.5:
                del self._sums[m]
        sxx = sxy = 0.0
        for k, sc, sy, scc, scy in self._sums.values():
            sxx += scc - sc * sc / k
            sxy += scy - sc * sy / k
        denom = sxx + self.prior  # 0 only with no prior and no spread in context within any n: no slope to read
        self.value = max(0.0, sxy / denom) if denom > 0 else 0.0


@dataclass
class OnlineCostModel:
    """Fits the step-cost model above to the steps the engine times."""

    prior: CostPrior = field(default_factory=CostPrior)
    observed: int = 0
    draft_idle: int = 0  # steps since D was last fitted

    def __post_init__(self) -> None:
        # n -> the last `memory` (seconds, context) of a target forward over n query tokens
        self._seen: dict[int, deque[tuple[float, int]]] = {}
        self._median: dict[int, float] = {}  # n -> the median of their seconds at context 0 (over the slope's factor)
        self._slope = ContextSlope(self.prior.context_window, self.prior.weight * self.prior.context_spread ** 2)
        self._median_slope = 0.0  # the slope the medians were taken at
        self._fit: tuple[np.ndarray, np.ndarray] | None = None  # ([K] the n seen, [K] isotonic fit to their medians)
        self._draft: _RLS | None = None  # made at the first draft step, from a prior scaled to the target's speed
        self._context: tuple[float, int] | None = None  # (C, calls it has seen)

    def observe(self, verify_tokens: int, verify_s: float, draft_forwards: int, draft_rows: int,
                draft_s: float, draft_context: int = 0, context: int = 0) -> None:
        """One decode step: the target forward over verify_tokens query tokens took verify_s; the draft call ran
        draft_forwards batched forwards over draft_rows rows in all, and took in draft_context context tokens besides,
        in draft_s; the batch's longest row held `context` tokens."""
        if verify_tokens < 1 or not verify_s > 0:
            return
        seen = self._seen.setdefault(verify_tokens, deque(maxlen=self.prior.memory))
        seen.append((verify_s, context))
        self._slope.observe(verify_tokens, context, math.log(verify_s))
        if abs(self._slope.value - self._median_slope) > 0.01 * self._slope.value:  # the slope moved: every median
            self._median_slope = self._slope.value
            for n in self._seen:
                self._median[n] = self._normal_median(n)
        else:
            self._median[verify_tokens] = self._normal_median(verify_tokens)
        keys = sorted(self._median)  # refit here, once per step, not in every estimate (which reads V three times)
        self._fit = np.array(keys), isotonic([self._median[k] for k in keys], [len(self._seen[k]) for k in keys])
        p = self.prior
        draft_s /= self.context_factor(context)  # the draft's fits are at context 0 too
        if draft_forwards > 0 and draft_context >= p.context_min:
            # C = (the call's time beyond D) / context tokens: a plain mean where the prior counts as `weight` calls
            d0, d1 = self._draft_fit()
            sample = max(draft_s - d0 * draft_forwards - d1 * draft_rows, 0.0) / draft_context
            rate, n = self._context or (self.context_per_token(), 0)
            self._context = (rate + (sample - rate) / min(n + 1 + p.weight, p.memory), n + 1)
        elif draft_forwards > 0:
            if self._draft is None:
                self._draft = _RLS(self._draft_prior(), [4.0, 16.0], p.weight, p.forgetting)
            elif self.draft_idle > 1 / (1 - p.forgetting):  # a pause longer than the fit's memory: what it remembers
                self._draft.reopen()  # is old (a burst of other work then may have made the draft look slow)
            self._draft.update([draft_forwards, draft_rows], draft_s)
        timed = draft_forwards > 0 and draft_context < p.context_min  # D was fitted to this step
        self.draft_idle = 0 if timed else self.draft_idle + 1
        self.observed += 1

    def _normal_median(self, n: int) -> float:
        """The median of the forwards over n query tokens, each divided by its context's factor."""
        return float(np.median([s / self.context_factor(c) for s, c in self._seen[n]]))

    def context_factor(self, context: int) -> float:
        """exp(gamma * context): what a forward costs with its longest row holding `context` tokens against none."""
        return math.exp(self._slope.value * context)

    def _draft_fit(self) -> tuple[float, float]:
        """(D0, D1): the fit, or the scaled prior before the first draft step; never negative."""
        theta = self._draft.theta if self._draft is not None else self._draft_prior()
        return max(float(theta[0]), 0.0), max(float(theta[1]), 0.0)

    def context_per_token(self) -> float:
        """C: the running mean, or the prior scaled like the draft's before any call with context tokens."""
        if self._context is not None:
            return self._context[0]
        return self.prior.draft_context_per_token_s * self._prior_scale()

    def _draft_prior(self) -> tuple[float, float]:
        """(D0, D1) of the prior, scaled to this target's speed."""
        scale = self._prior_scale()
        return self.prior.draft_fwd_s * scale, self.prior.draft_per_token_s * scale

    def _prior_scale(self) -> float:
        """How fast this target is against the prior's, V(1) seen / verify_base_s: a draft that was never timed is
        priced as the prior's share of a target forward (a tiny model's draft is cheap, a GPU's too)."""
        return self.verify(1) / self.prior.verify_base_s

    def verify_table(self, n: int) -> np.ndarray:
        """[n]: V(1..n) at context 0: the isotonic fit to the medians seen, linear between the n seen, and outside them
        the prior scaled by the nearest n seen; past the last n seen not yet made non-decreasing."""
        ns = np.arange(1, n + 1)
        p = self.prior
        prior = p.verify_base_s + p.verify_per_token_s * (ns - 1)
        if self._fit is None:
            return prior
        keys, means = self._fit
        ratio = means / (p.verify_base_s + p.verify_per_token_s * (keys - 1))  # seen / prior
        outside = prior * np.where(ns < keys[0], ratio[0], ratio[-1])
        return np.where((ns >= keys[0]) & (ns <= keys[-1]), np.interp(ns, keys, means), outside)

    def verify(self, n: int) -> float:
        return float(self.verify_table(n)[-1])

    def estimate(self, batch: int, max_tokens: int | None = None, context: int = 0) -> StepCosts:
        """The model at batch size `batch`, tabled up to max_tokens query tokens (default batch x 21), the longest row
        holding `context` tokens."""
        b = max(batch, 1)
        n = max(max_tokens or b * 21, b + 1)
        scale = self.context_factor(context)
        table = np.maximum.accumulate(self.verify_table(n)) * scale
        d0, d1 = self._draft_fit()
        drafts = tuple(scale * (d0 + d1 * i) for i in range(1, n + 1))
        return StepCosts(b, tuple(table.tolist()), drafts, context_per_token_s=scale * self.context_per_token())
