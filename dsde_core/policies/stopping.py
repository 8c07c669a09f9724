"""When to stop drafting: a draft token is worth what it adds to the expected output, against what its time
would have earned at the batch's goodput. The draft worker applies this rule level by level, with the confidence
of every token it has just drafted; dsde-goodput (goodput.py) supplies its parameters.

Acceptance model. The draft's confidence c in a token it proposes (its probability at the signal temperature: the
argmax's at T = 0) is known as the token is drafted, and predicts its acceptance well; per sequence i and drafted
position j, with the row's model (a_i, s_i, f_i) from the policy:
    p_ij = sigmoid(a_i + s_i * logit(max(c_ij, f_i)))
(f: a floor on the confidence, for sampled requests; goodput.py)
and after j drafted tokens the chance that all of them are accepted is pi_ij = prod_{m<=j} p_im.

Stop rule (one decision per draft level, for the rows still drafting). Drafting h more tokens for row i adds
    gain_i(h) = w_i * pi_ij * sum_{m=1..h} pbar_i^m           expected extra output tokens (the accepted ones)
where pbar_i is the expected p of a token not drafted yet and w_i what a token of row i is worth (1, but in a
batch with nothing waiting: goodput.py). The top-n rows by w_i * pi_ij * pbar_i drafting h more levels cost
    time(n, h) = sum_{l=1..h} D(rows of those n still drafting at level l) + V(T + added tokens) - V(T)
with D, V the step-cost tables and T the tokens the target will verify so far (with padded verification, every
sequence of the batch adds a token per level). With lambda the batch's goodput (tokens per second), the batch
drafts one more level, with the top n* rows, iff
    max_{n, h} [ sum_{i in top n} gain_i(h) - lambda * time(n, h) ] > 0
(Dinkelbach: an action pays when it earns more than its time would earn at the rate the batch already reaches).
At level 0 a row whose draft cache is empty also pays fixed_i(h) once it drafts at all: its prefill, amortised (the
policy's share of it for this step, which depends on the levels h it drafts; goodput.py).
Looking h levels ahead, not one, keeps the rule right where V jumps (on a CPU, a step crossing a GEMM block of
verified tokens) and where the next level's draft forward is dearer than the ones after it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dsde_core.cost import StepCosts

CONF_EPS = 1e-4  # confidences are clipped to [eps, 1 - eps] before the logit
Fixed = Sequence[float | Sequence[float]]  # per row: seconds it costs if it drafts at all (by levels drafted)
AcceptModel = tuple[float, float, float]  # (a, s, floor): p = sigmoid(a + s * logit(max(confidence, floor)))
CONFIDENCE_AS_P: AcceptModel = (0.0, 1.0, CONF_EPS)  # p = the confidence itself


def logit(c: float, floor: float = CONF_EPS) -> float:
    c = min(max(c, floor), 1.0 - CONF_EPS)
    return math.log(c / (1.0 - c))


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def _by_level(fixed: float | Sequence[float], levels: int) -> np.ndarray:
    """[levels]: a row's one-off cost if it drafts 1..levels levels: one figure for all, or one per level (past the
    last given, the last)."""
    if isinstance(fixed, (int, float)):
        return np.full(levels, float(fixed))
    f = np.asarray(fixed, dtype=np.float64)
    return f[np.minimum(np.arange(levels), len(f) - 1)] if len(f) else np.zeros(levels)


@dataclass(frozen=True)
class DraftStop:
    """The batch's stop rule for one step (what crosses to the draft worker with the plans)."""

    costs: StepCosts  # the tables D and V
    verify_base: int  # tokens the target verifies this step besides the drafts (sum of the pending tokens)
    goodput: float  # lambda: output tokens per second the batch reaches

    @staticmethod
    def accept_prob(confidence: float, model: AcceptModel) -> float:
        """p: the chance that a drafted token of this confidence is accepted (given all before it were); model = (a,
        s, floor), the confidence clipped below at floor."""
        a, s, floor = model
        return sigmoid(a + s * logit(confidence, floor))

    def next_level(self, reach: Sequence[float], pbar: Sequence[float], room: Sequence[int], drafted: int,
                   level: int = 0, fixed: Fixed | None = None) -> list[bool]:
        """Which rows draft one more token. reach[i] = w_i * pi_ij, pbar[i] = expected p of an undrafted token,
        room[i] = tokens row i may still draft (> 0), drafted = draft tokens proposed so far this step (all rows),
        level = draft levels so far (the padded verification's width), fixed[i] = seconds row i costs if it drafts at
        all: one figure, or one per number of levels it drafts (1, 2, ...; past the last, the last)."""
        go = np.zeros(len(reach), dtype=bool)
        n, net, _, _ = self.best(reach, pbar, room, drafted, self.goodput, level, fixed)
        if n > 0 and net > 0:
            go[self._order(reach, pbar)[:n]] = True
        return go.tolist()

    @staticmethod
    def _order(reach: Sequence[float], pbar: Sequence[float]) -> np.ndarray:
        """Rows best first, by the next token's worth."""
        return np.argsort(-(np.asarray(reach, dtype=np.float64) * np.asarray(pbar, dtype=np.float64)), kind="stable")

    def best(self, reach: Sequence[float], pbar: Sequence[float], room: Sequence[int], drafted: int,
             goodput: float, level: int = 0, fixed: Fixed | None = None) -> tuple[int, float, float, float]:
        """(n, net, gain, seconds) of the best continuation: the top n rows drafting h more levels, max over (n, h) of
        net = gain - goodput * seconds; n = 0 when there is no row. Padded verification (costs.padded) costs every
        sequence of the batch one token per level, whichever rows draft."""
        n_rows = len(reach)
        if n_rows == 0:
            return 0, 0.0, 0.0, 0.0
        order = self._order(reach, pbar)  # [L] best rows first
        reach_a = np.asarray(reach, dtype=np.float64)[order]
        pbar_a = np.clip(np.asarray(pbar, dtype=np.float64), 0, 1)[order]
        room_a = np.asarray(room, dtype=np.int64)[order]
        h = np.arange(1, int(room_a.max()) + 1)  # [H] levels ahead
        within = h[None, :] <= room_a[:, None]  # [L, H] row i still drafts at level h
        gain = reach_a[:, None] * np.cumsum(np.where(within, pbar_a[:, None] ** h[None, :], 0.0), axis=1)  # [L, H]
        gain = np.cumsum(gain, axis=0)  # [n, H]: the top n rows, h levels
        live = np.cumsum(within, axis=0)  # [n, l]: rows of the top n drafting at level l
        d_cost = np.array([0.0] + [self.costs.draft(m) for m in range(1, n_rows + 1)])
        seconds = np.cumsum(d_cost[live], axis=1)  # [n, H]
        if self.costs.padded:  # [n, H]: the whole batch, h more levels
            added = np.broadcast_to(self.costs.batch * h[None, :], gain.shape)
            t0 = self.verify_base + self.costs.batch * level
        else:  # [n, H] tokens to verify on top
            added = np.cumsum(np.minimum(h[None, :], room_a[:, None]), axis=0)
            t0 = self.verify_base + drafted
        v_cost = np.array([self.costs.verify(t0 + a) for a in range(int(added.max()) + 1)]) - self.costs.verify(t0)
        seconds = seconds + v_cost[added]
        if fixed is not None:  # [n, H]: the top n rows' one-off costs, row i's at the min(h, room_i) levels it drafts
            by_level = np.array([_by_level(f, len(h)) for f in fixed])[order]  # [L, H]
            seconds = seconds + np.cumsum(by_level, axis=0)
        net = gain - goodput * seconds  # [n, H]
        i, j = np.unravel_index(np.argmax(net), net.shape)
        return int(i) + 1, float(net[i, j]), float(gain[i, j]), float(seconds[i, j])

    def step_goodput(self, reach: Sequence[float], pbar: Sequence[float], room: Sequence[int], rows: int,
                     iters: int = 8, fixed: Fixed | None = None) -> float:
        """The best goodput this step can reach under the model, before any token is drafted (Dinkelbach): the max
        over (n, h) of (rows + gain) / (V(T) + seconds), at least this rule's own goodput."""
        lam = self.goodput
        base_s = self.costs.verify(self.verify_base)
        for _ in range(iters):
            _, net, gain, seconds = self.best(reach, pbar, room, 0, lam, fixed=fixed)
            new = (rows + gain) / (base_s + seconds)
            if net <= 0 or new <= lam * (1 + 1e-6):
                break
            lam = new
        return lam
