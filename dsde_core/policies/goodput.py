"""dsde-goodput: cost-aware DSDE. A sequence drafts while its next token is worth more than the time it takes,
judged token by token from the draft's confidence; where no draft pays, speculation switches off.

Terms, per sequence i of a batch of B (all learnt online):
- p = sigmoid(w0 + w1 * logit(c) + w2 * x_i): the chance that a drafted token is accepted given all before it were,
  from the draft's confidence c in it and DSDE's instability signal x_i = log(1 + WVIR_i * SF_i) (AcceptanceModel).
  The confidence is known when the token is drafted, the KLD only after verification: c decides within a step.
- p_first_i: the running acceptance of a step's first drafted token; pbar_i: the running mean p of a drafted token,
  by token (a mean of step means would read low: the stop rule ends a step after a doubtful token).
- e_i(h) = p_first_i * sum_{m<h} pbar_i^m: the drafted tokens accepted in a step where row i drafts h.
- V(T), D(n), C: the seconds of a target forward over T tokens, of a draft forward over n rows, and of a context
  token the draft takes in (the engine's step-cost model, dsde_core.cost.StepCosts).
- lambda_B = rho_B * B / V(B): the batch's goodput, rho_B this policy's running speedup over target-only decoding at
  batch B (each step priced by the tables it was planned with: no timing noise). rho_B starts at 2: too high a lambda
  only makes the policy draft less until the rate reached pulls rho_B down; too low drafts tokens that do not pay. A
  step is planned with the larger of lambda_B and the best rate the model sees for it (DraftStop.step_goodput).

The plan is level 0 of the stop rule (stopping.DraftStop): it picks the rows that draft a first token, each with
k = its ceiling, p_next = pbar_i and its acceptance model; the draft worker applies the rule after every level.
- Cold rows (an empty draft cache of lag_i tokens: the engine defers a draft's prefill until the row drafts) pay
      fixed_i(h) = C * lag_i * (1 + e_i(h)) / remaining_i
  this step, their prefill spread over the steps their remaining tokens take, and are judged at the step's own
  goodput from B / V(B) up: a row drafts where drafting from now on, prefill included, beats not drafting.
- Worth. In an open batch (requests wait, or the last change was a request joining running ones) every token is
  worth 1. A closed batch only shrinks and lasts as long as its last row, so row i's gains weigh
      w_i = B * S_i / sum_j S_j,    S_i = remaining_i / (1 + e_i(h_i))    (0 for a row with one token left)
  with h_i its mean drafted tokens a step: the row on the critical path keeps drafting, one that ends early stops.
- Until the pooled means have seen explore_steps drafting steps every row drafts: on its priors alone a batch
  might never draft, and so never learn that drafting pays.
- A row that is off probes (drafts one step) every probe_every plans, the interval doubling up to probe_max; a cold
  row waits probe_max plans and needs probe_max tokens left. Where no row has drafted for pool_probe_every plans, the
  row with the most tokens left drafts once, so a draft that once looked slow or weak is timed and judged again.
  A cold probe and the pool probe pay the draft's prefill of the row's whole context, so they are priced: a row
  probes so only where that prefill is at most probe_budget of the time its remaining tokens take at target-only
  speed,
      C * lag_i <= probe_budget * remaining_i * V(B)
  (the pool probe takes the row with the most tokens left among those; where none is within budget, it waits). No
  probe costs a request more than probe_budget of its time; where requests are short, the draft is judged again by
  the first one long enough to afford it. Each paid probe that the rule does not follow (the row is not chosen at
  the next plan) doubles both waits, up to probe_backoff times, and any row the rule chooses resets them. Where no
  draft length pays, the probes so cost ever less instead of a prefill per request.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from dsde_core.cost import OnlineCostModel, StepCosts
from dsde_core.errors import ConfigError
from dsde_core.policies.base import Plan, SeqInfo, SpeculationPolicy, StepFeedback
from dsde_core.policies.stopping import CONF_EPS, AcceptModel, DraftStop, logit, sigmoid
from dsde_core.signals import WVIR_FLAT_VARIANCE, scale_factor, wvir


@dataclass(frozen=True)
class GoodputConfig:
    max_sl: int = 20
    prior_weights: tuple[float, float, float] = (0.7, 0.9, 0.0)  # (w0, w1, w2) before any judged token
    prior_variance: float = 1.0  # of each weight before any judged token
    forgetting: float = 0.995  # per judged token: the acceptance model's memory is ~200 tokens
    rho: float = 0.9  # per drafting step, of a sequence's p_first and pbar (memory ~10 steps)
    pool_rate: float = 0.01  # per drafting step of any sequence, of the pooled means new sequences start from (memory
    # ~100 steps, several requests: a faster one lets one batch's last few plans set where every new request starts)
    pool_weight: float = 4.0  # the pooled means' priors count as this many drafting steps
    sampled_floor: float = 0.1  # sampled requests: confidences below it count as it (see AcceptanceModel)
    explore_steps: int = 16  # every row explores until the pool holds this many drafting steps (pooled over rows, as
    # requests differ more than steps do; a few first-token draws, coin tosses at T = 1, are too noisy to stop on)
    start_weight: float = 4.0  # a sequence's pooled start counts as this many of its own drafting steps
    prior_first: float = 0.7  # pooled p_first and pbar before any step
    prior_pbar: float = 0.7
    probe_every: int = 8  # plans a row that went off waits before it probes; the interval doubles while it stays off
    probe_max: int = 64  # the longest interval; a cold row waits this long, and probes only with this many tokens left
    pool_probe_every: int = 256  # plans without any drafting row before the longest row probes (see the module doc)
    probe_backoff: int = 16  # the most the cold and pool probes' waits grow, doubling after each that finds no gain
    probe_budget: float = 0.02  # the most of a row's remaining target-only time a probe's draft prefill may take
    window: int = 30  # DSDE's N: KLD history for WVIR
    delta: float = 0.9  # WVIR's decay
    speedup_rate: float = 0.2  # per decode step, of rho_B (memory ~5 steps)
    speedup_start: float = 2.0  # rho before any step (see the module doc)

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.max_sl <= 64, f"max_sl must be in [1, 64], got {self.max_sl}"),
            (len(self.prior_weights) == 3 and all(math.isfinite(w) for w in self.prior_weights),
             f"prior_weights must be 3 finite numbers, got {self.prior_weights}"),
            (self.prior_variance > 0, f"prior_variance must be > 0, got {self.prior_variance}"),
            (CONF_EPS <= self.sampled_floor < 0.5, f"sampled_floor must be in [{CONF_EPS}, 0.5), got "
                                                   f"{self.sampled_floor}"),
            (0.0 < self.forgetting <= 1.0, f"forgetting must be in (0, 1], got {self.forgetting}"),
            (0.0 <= self.rho < 1.0, f"rho must be in [0, 1), got {self.rho}"),
            (0.0 < self.pool_rate <= 1.0, f"pool_rate must be in (0, 1], got {self.pool_rate}"),
            (self.pool_weight > 0, f"pool_weight must be > 0, got {self.pool_weight}"),
            (self.explore_steps >= 0, f"explore_steps must be >= 0, got {self.explore_steps}"),
            (self.start_weight > 0, f"start_weight must be > 0, got {self.start_weight}"),
            (0.0 < self.prior_pbar < 1.0, f"prior_pbar must be in (0, 1), got {self.prior_pbar}"),
            (0.0 < self.prior_first < 1.0, f"prior_first must be in (0, 1), got {self.prior_first}"),
            (self.window >= 2, f"window must be >= 2, got {self.window}"),
            (0.0 < self.delta <= 1.0, f"delta must be in (0, 1], got {self.delta}"),
            (1 <= self.probe_every <= self.probe_max, f"need 1 <= probe_every <= probe_max, got "
                                                      f"{self.probe_every}, {self.probe_max}"),
            (self.pool_probe_every >= 1, f"pool_probe_every must be >= 1, got {self.pool_probe_every}"),
            (self.probe_backoff >= 1, f"probe_backoff must be >= 1, got {self.probe_backoff}"),
            (0.0 < self.probe_budget <= 1.0, f"probe_budget must be in (0, 1], got {self.probe_budget}"),
            (0.0 < self.speedup_rate <= 1.0, f"speedup_rate must be in (0, 1], got {self.speedup_rate}"),
            (self.speedup_start > 0, f"speedup_start must be > 0, got {self.speedup_start}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"dsde-goodput: {msg}")


def running_rate(n: int, start: float, floor: float) -> float:
    """The weight of the n-th observation (n >= 1) in a running mean whose start counts as `start` observations: a
    plain mean over the first ones, then never below `floor` (a decay of 1 - floor per observation)."""
    return max(floor, 1 / (n + start))


class AcceptanceModel:
    """Online Bayesian logistic regression of acceptance on z = (1, logit(max(c, floor)), x): p = sigmoid(w . z).

    Fitted to every judged token (y = 1: accepted; 0: the first rejected; the tokens after it are not judged) by one
    Newton step per token, with covariance P, forgetting f per token and v = p (1 - p):
        P <- P / f;  P <- P - (P z)(P z)^T v / (1 + v z^T P z);  w <- w + P z (y - p)
    For sampled requests the floor is sampled_floor: at T > 0 a drafted token x is accepted with probability
    min(1, p(x) / q(x)), which a small q(x) does not make smaller, while logit(c) keeps falling, so a confidence below
    the floor says no more than the floor does (unfloored, one unlikely draw would end the draft)."""

    def __init__(self, prior: Sequence[float], variance: float, forgetting: float, floor: float = CONF_EPS) -> None:
        self.w = np.asarray(prior, dtype=np.float64)  # [3]
        self.floor = floor
        self.p = np.eye(3) * variance  # [3, 3] the weights' covariance
        self.max_var = variance  # forgetting never makes the model less sure than its prior
        self.forgetting = forgetting
        self.judged = 0

    def row_model(self, x: float) -> AcceptModel:
        """(a, s, floor) of one sequence: p = sigmoid(a + s * logit(max(c, floor))), a = w0 + w2 * x."""
        return float(self.w[0] + self.w[2] * x), float(self.w[1]), self.floor

    def update(self, confidence: float, x: float, accepted: bool) -> None:
        z = np.array([1.0, logit(confidence, self.floor), x])
        p = sigmoid(float(self.w @ z))
        v = max(p * (1.0 - p), 1e-6)
        cov = self.p / self.forgetting
        pz = cov @ z
        cov = cov - np.outer(pz, pz) * (v / (1.0 + v * float(z @ pz)))
        w = self.w + cov @ z * (float(accepted) - p)
        if not (np.all(np.isfinite(w)) and np.all(np.isfinite(cov))):
            return
        if np.max(np.diag(cov)) > self.max_var:  # windup in directions the data never vary in (see cost._RLS)
            ev, vec = np.linalg.eigh((cov + cov.T) / 2)
            cov = (vec * np.minimum(ev, self.max_var)) @ vec.T
        self.w, self.p = w, cov
        self.judged += 1


class SpeedupByBatch:
    """rho_B: a running mean per batch size B (a plain mean over its first steps, where its start counts as one,
    then rate `rate`); a B not seen yet starts from the nearest one seen."""

    def __init__(self, rate: float, start: float) -> None:
        self.rate, self.start = rate, start
        self._rho: dict[int, tuple[float, int]] = {}  # B -> (rho, steps)

    def observe(self, batch: int, ratio: float) -> None:
        if not math.isfinite(ratio):
            return
        rho, n = self._rho.get(batch, (self.get(batch), 0))
        self._rho[batch] = (rho + running_rate(n + 1, 1, self.rate) * (ratio - rho), n + 1)

    def get(self, batch: int) -> float:
        if batch in self._rho:
            return self._rho[batch][0]
        if not self._rho:
            return self.start
        nearest = min(self._rho, key=lambda b: (abs(math.log(b / batch)), -self._rho[b][1]))
        return self._rho[nearest][0]


@dataclass
class _State:
    """One sequence's estimates. p_first and pbar are running means: a plain mean over the sequence's first drafting
    steps, its pooled start counting as start_weight of them (one rejected token, a likely draw at T = 1, must not
    switch a good draft off), then decay rho per drafting step; a probe counts for half, as after a time off it is the
    freshest evidence there is. The pooled means follow every sequence's outcomes the same way, their priors counting
    as pool_weight steps: behind a weak draft, new requests start off."""

    greedy: bool
    temperature: float
    p_first: float  # running acceptance of the first drafted token of a step
    p_sum: float  # running means, per drafting step, of the sum of p over its drafted tokens and of their number:
    p_count: float  # pbar = p_sum / p_count is a running mean of p by token (see the module doc)
    history: deque[float] = field(default_factory=deque)  # last N KLDs
    x: float = 0.0  # log(1 + WVIR * SF) after the last step that drafted
    on: bool = True
    off_since: int = 0
    probe_every: int = 0
    cold: bool = False  # it went off with an empty draft cache (so it probes every probe_max plans)
    probing: bool = False
    warming: bool = False  # a probe began with a cold draft cache and has not drafted yet (its prefill is chunked)
    paid_probe: bool = False  # the last plan began a probe that pays the draft's prefill (a cold or the pool probe)
    last_k: int = 0
    steps: int = 0  # steps that drafted

    @property
    def pbar(self) -> float:
        """The running mean p of drafted tokens, by token."""
        return self.p_sum / self.p_count

    def start_probe(self, plan: int, cold: bool) -> None:
        """A probe begins at this plan; with a cold draft cache it goes on until the sequence drafts (`warming`)."""
        self.probing, self.off_since, self.cold, self.warming = True, plan, False, cold

    def accepted_per_step(self, k: int) -> float:
        """e = p_first * sum_{m<k} pbar^m: expected drafted tokens accepted in a step of k (the first token is
        accepted with p_first, each after it with pbar given the one before)."""
        return self.p_first * sum(self.pbar ** m for m in range(k))


class GoodputPolicy(SpeculationPolicy):
    """Batch-level: plans every sequence together (it needs the step costs; the engine passes them)."""

    name = "dsde-goodput"
    bound_field = "max_sl"
    cost_aware = True
    pooled = True

    def __init__(self, config: GoodputConfig | None = None) -> None:
        cfg = self.config = config or GoodputConfig()
        self._states: dict[str, _State] = {}
        self._plans = 0
        self._drafted_at = 0  # the last plan in which a row drafted
        self._models = {g: AcceptanceModel(cfg.prior_weights, cfg.prior_variance, cfg.forgetting,
                                           CONF_EPS if g else cfg.sampled_floor) for g in (True, False)}
        self._pool_first = cfg.prior_first
        self._pool_sum, self._pool_count = cfg.prior_pbar, 1.0  # pooled pbar = sum / count, as in _State
        self._pooled = 0  # drafting steps the pooled means have seen
        self._default_costs = OnlineCostModel()
        self._last: tuple[StepCosts, int] | None = None  # the costs and verify base the last plan used
        self._speedup = SpeedupByBatch(cfg.speedup_rate, cfg.speedup_start)
        self._open = False  # the batch is being refilled (see the module doc)
        self._left = 0  # requests released since the last plan
        self._backoff = 1  # the cold and pool probes' waits are this many times theirs (see the module doc)

    # ---- the policy interface ----------------------------------------------------------------------------
    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        cfg = self.config
        self._plans += 1
        if not seqs:
            return []
        base = sum(s.pending for s in seqs)
        costs = costs or self._default_costs.estimate(len(seqs), base + sum(s.max_k for s in seqs))
        self._last = (costs, base)
        self._track_refills(seqs)
        states = []
        for seq in seqs:
            st = self._states.get(seq.req_id)
            if st is None:
                st = self._states[seq.req_id] = _State(seq.temperature == 0.0, seq.temperature, self._pool_first,
                                                       self._pool_sum, self._pool_count, probe_every=cfg.probe_every)
            st.greedy, st.temperature = seq.temperature == 0.0, seq.temperature
            states.append(st)
        ks = [min(s.max_k, cfg.max_sl) for s in seqs]
        # level 0: the stop rule on the first token, whose acceptance is p_first (the tokens after it: pbar)
        rows = [i for i, k in enumerate(ks) if k > 0]
        worth = self._worth(seqs, states, ks) if waiting == 0 and not self._open else [1.0] * len(seqs)
        reach = [worth[i] * states[i].p_first / max(states[i].pbar, 1e-6) for i in rows]
        pbar, room = [states[i].pbar for i in rows], [ks[i] for i in rows]
        fixed = [self._prefill_share(seqs[i], states[i], ks[i], costs) for i in rows]
        if any(f[0] > 0 for f in fixed):  # rows with an empty draft cache draft only where their prefill pays
            start = self._starts(costs, len(seqs), reach, pbar, room, fixed)
            keep = [j for j, (f, s) in enumerate(zip(fixed, start, strict=True)) if f[0] == 0 or s]
            reach, pbar, room = ([x[j] for j in keep] for x in (reach, pbar, room))
            candidates = [rows[j] for j in keep]
        else:
            candidates = rows
        stop = DraftStop(costs, base, self._speedup.get(len(seqs)) * len(seqs) / costs.verify(len(seqs)))
        stop = replace(stop, goodput=stop.step_goodput(reach, pbar, room, len(seqs)))
        go = stop.next_level(reach, pbar, room, 0)
        chosen = {i for i, g in zip(candidates, go, strict=True) if g}
        if rows and self._pooled < cfg.explore_steps:  # the pool has little evidence: every row explores (what
            # they learn serves every later request)
            chosen = set(rows)
        plans = []
        for i, (st, k) in enumerate(zip(states, ks, strict=True)):
            if st.paid_probe and not st.warming:  # a probe that paid a prefill has drafted: judged now
                if i not in chosen:  # it found no gain: the next ones wait longer
                    self._backoff = min(2 * self._backoff, cfg.probe_backoff)
                st.paid_probe = False
            st.probing = False
            if i in chosen:
                st.on, st.probe_every = True, cfg.probe_every
                self._backoff = 1
            elif k > 0:
                cold = seqs[i].draft_lag > 0  # the draft cache is empty (never drafted, or the draft restarted)
                if st.on:  # a cold sequence probes only every probe_max plans: its first draft step also prefills
                    # the draft with its whole context
                    st.on, st.off_since, st.cold = False, self._plans, cold
                    st.probe_every = cfg.probe_max if cold else cfg.probe_every
                elif st.cold and not cold:  # its draft cache filled meanwhile: no prefill left to recoup
                    st.cold, st.probe_every = False, cfg.probe_every
                # probes fall on plan numbers divisible by the interval, so that the batch's probes share forwards; a
                # cold sequence probes only with at least probe_max tokens left to recoup its prefill. A probe whose
                # draft prefill is fed in chunks proposed nothing yet: it goes on (observe ends it once it drafts)
                every = st.probe_every * (self._backoff if cold else 1)
                st.probing = st.warming or (
                    self._plans - st.off_since >= every and self._plans % every == 0
                    and (not cold or seqs[i].remaining is None or seqs[i].remaining >= cfg.probe_max)
                    and self._affords_probe(seqs[i], costs, len(seqs)))
                if st.probing and not st.warming:  # a new probe (one that prefills a cold cache too) doubles it
                    st.start_probe(self._plans, cold)
                    st.paid_probe = cold
                    st.probe_every = min(2 * st.probe_every, cfg.probe_max)
                elif not st.probing:
                    k = 0
            st.last_k = k
            plans.append(self._drafting(st, k, stop, worth[i]) if k > 0 else Plan(0))
        if any(p.k > 0 for p in plans):
            self._drafted_at = self._plans
        elif (rows and self._plans - self._drafted_at >= cfg.pool_probe_every * self._backoff
              and (able := [j for j in rows if self._affords_probe(seqs[j], costs, len(seqs))])):
            # the pool probe: no row has drafted for pool_probe_every plans (every row off, and cold: a warm row that
            # is off probes within probe_max plans; too short for its own probe), so the row with the most tokens
            # left among those that afford its prefill drafts once, and the draft is timed and judged afresh
            i = max(able, key=lambda j: (math.inf if seqs[j].remaining is None else seqs[j].remaining, -j))
            st = states[i]
            st.start_probe(self._plans, seqs[i].draft_lag > 0)
            st.paid_probe = seqs[i].draft_lag > 0
            st.last_k = ks[i]
            plans[i] = self._drafting(st, ks[i], stop, worth[i])
            self._drafted_at = self._plans
        return plans

    def _affords_probe(self, seq: SeqInfo, costs: StepCosts, batch: int) -> bool:
        """Whether a probe's draft prefill, C * lag, is within probe_budget of the time the row's remaining tokens
        take at target-only speed, remaining * V(B) (a row of unknown length affords it; a warm row pays none)."""
        if seq.draft_lag == 0 or seq.remaining is None:
            return True
        return costs.draft_context(seq.draft_lag) <= self.config.probe_budget * seq.remaining * costs.verify(batch)

    def _drafting(self, st: _State, k: int, stop: DraftStop, worth: float) -> Plan:
        return Plan(k, p_next=st.pbar, accept_model=self._models[st.greedy].row_model(st.x), stop=stop, worth=worth)

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        cfg = self.config
        self._observe_speedup(feedback)
        for fb in feedback:
            st = self._states.get(fb.req_id)
            if st is None or fb.proposed == 0:  # nothing drafted (a chunk of the draft's prefill, or a draft fault)
                continue
            st.steps, st.warming = st.steps + 1, False
            # the pooled start counts as start_weight steps, then decay rho; a probe counts for half: after a time off
            # it is the freshest evidence there is
            rate = running_rate(st.steps, cfg.start_weight, 0.5 if st.probing else 1 - cfg.rho)
            st.p_first += rate * (float(fb.accepted > 0) - st.p_first)
            # the pooled means follow every sequence's outcomes: their priors count as pool_weight steps
            self._pooled += 1
            pool = running_rate(self._pooled, cfg.pool_weight, cfg.pool_rate)
            self._pool_first += pool * (float(fb.accepted > 0) - self._pool_first)
            model = self._models[st.greedy]
            if fb.draft_conf:
                row = model.row_model(st.x)
                p, n = sum(DraftStop.accept_prob(c, row) for c in fb.draft_conf), len(fb.draft_conf)
                st.p_sum += rate * (p - st.p_sum)
                st.p_count += rate * (n - st.p_count)
                self._pool_sum += pool * (p - self._pool_sum)
                self._pool_count += pool * (n - self._pool_count)
                for j in range(min(fb.accepted + 1, fb.proposed)):  # the accepted ones and the first rejected
                    model.update(fb.draft_conf[j], st.x, j < fb.accepted)
            self._update_instability(st, fb)

    def release(self, req_id: str) -> None:
        if self._states.pop(req_id, None) is not None:
            self._left += 1

    def num_tracked(self) -> int:
        return len(self._states)

    @property
    def batch_open(self) -> bool:
        """Whether the last plan read the batch as open, being refilled, so that every row's tokens were worth the
        same (the module doc)."""
        return self._open

    def stats(self, req_id: str) -> dict[str, float]:
        s = self._states.get(req_id)
        if s is None:
            return {}
        w = self._models[s.greedy].w
        return {"p_first": s.p_first, "pbar": s.pbar, "instability": s.x, "on": float(s.on), "k": float(s.last_k),
                "w_conf": float(w[1]), "w_instability": float(w[2])}

    # ---- internals -----------------------------------------------------------------------------------------
    def _track_refills(self, seqs: Sequence[SeqInfo]) -> None:
        """Open: a request joined running ones. Closed: one left since the last plan and none joined running ones
        (every row new, as a batch that took every slot at once, included). Neither: unchanged (at first: closed)."""
        joined = sum(s.req_id not in self._states for s in seqs)
        if 0 < joined < len(seqs):
            self._open = True
        elif self._left:
            self._open = False
        self._left = 0

    @staticmethod
    def _worth(seqs: Sequence[SeqInfo], states: Sequence[_State], ks: Sequence[int]) -> list[float]:
        """w_i in a closed batch, what a token of row i is worth against the batch's mean of 1: the batch only
        shrinks and its time is set by the row that finishes last, so a row's tokens are worth its share of the
        batch's expected remaining steps:
            w_i = B * S_i / sum_j S_j,    S_i = remaining_i / (1 + e_i(h_i)),    e_i(h) = p_first_i * sum_{m<h} pbar_i^m
        with h_i its mean drafted tokens per drafting step, rounded, between 1 and k_i (0 where k_i is 0). A row with
        one token left ends with this step whatever is drafted: S_i = 0 (the rows that outlast it share B)."""
        if len(seqs) < 2 or any(s.remaining is None for s in seqs):
            return [1.0] * len(seqs)
        steps = [s.remaining / (1 + st.accepted_per_step(min(k, max(1, round(st.p_count))))) if s.remaining > 1
                 else 0.0 for s, st, k in zip(seqs, states, ks, strict=True)]
        total = sum(steps)
        return [len(seqs) * x / total for x in steps] if total > 0 else [1.0] * len(seqs)

    @staticmethod
    def _starts(costs: StepCosts, batch: int, reach: Sequence[float], pbar: Sequence[float], room: Sequence[int],
                fixed: Sequence[Sequence[float]]) -> list[bool]:
        """Which rows would draft in a decode step of this batch, each with an empty draft cache paying its prefill's
        share fixed_i(h), judged at the step's own goodput from target-only's B / V(B) up (Dinkelbach): the whole
        request's test, drafting from now on, prefill included, against not drafting (the module doc)."""
        decode = DraftStop(costs, batch, batch / costs.verify(batch))
        own = replace(decode, goodput=decode.step_goodput(reach, pbar, room, batch, fixed=fixed))
        return own.next_level(reach, pbar, room, 0, fixed=fixed)

    @staticmethod
    def _prefill_share(seq: SeqInfo, st: _State, k: int, costs: StepCosts) -> list[float]:
        """[k]: this step's share of the draft prefill a sequence with an empty draft cache pays when it drafts h =
        1..k tokens a step: C * lag spread over the steps its remaining tokens then take, remaining / (1 + e(h)) with
        e(h) = p_first * sum_{m<h} pbar^m its expected accepted tokens per step."""
        if seq.draft_lag == 0 or seq.remaining is None:
            return [0.0]
        per_step = costs.draft_context(seq.draft_lag) / max(seq.remaining, 1)
        return [per_step * (1 + st.accepted_per_step(h)) for h in range(1, k + 1)]

    def _observe_speedup(self, feedback: Sequence[StepFeedback]) -> None:
        """rho_B: this policy's decode steps at batch B against target-only decoding, each priced by the costs it was
        planned with (no timing noise): (emitted / step_s) / (B / V(B))."""
        b = len(feedback)
        if self._last is None or b == 0 or self._last[1] != b:  # a prompt was fed: not a decode step
            return
        costs, base = self._last
        emitted = sum(fb.accepted + 1 for fb in feedback)
        ratio = (emitted / costs.step_s([fb.proposed for fb in feedback], base)) / (b / costs.verify(b))
        self._speedup.observe(b, ratio)

    def _update_instability(self, st: _State, fb: StepFeedback) -> None:
        """DSDE's signal, as in its SL rule: WVIR over the KLD history times SF of this step's mean KLD."""
        cfg = self.config
        klds = [max(0.0, v) for v in fb.kld]
        st.history.extend(klds)
        while len(st.history) > cfg.window:
            st.history.popleft()
        sf = scale_factor(sum(klds) / len(klds), st.temperature, True)
        # (a flat history is no evidence of rising instability: 0, where DSDE's WVIR reports its constant 20)
        known = len(st.history) >= cfg.window // 3 and np.var(st.history) >= WVIR_FLAT_VARIANCE
        st.x = math.log1p(min(wvir(st.history, cfg.delta) * sf, 1e6)) if known else 0.0
