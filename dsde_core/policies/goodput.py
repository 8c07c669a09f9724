"""dsde-goodput: DSDE's stability signal turned into expected accepted tokens, and the k of every sequence (0
included) chosen to maximise the batch's output tokens per second under the engine's measured step costs.

Per sequence i, a per-token acceptance estimate from recent steps, discounted by DSDE's instability signal:
    a_i <- rho * a_i + accepted,   b_i <- rho * b_i + [a draft token was rejected]        (each step that drafted)
    alpha_hat_i = (a_i + a0) / (a_i + b_i + a0 + b0)                                 (a0 + b0 = prior weight)
    alpha_i = alpha_hat_i * min(1, 1 / (WVIR_i * SF_i)) ** eta
WVIR and SF are DSDE's (signals.wvir over the last N KLDs, signals.scale_factor of the last step's mean KLD;
WVIR * SF counts as 0 before N/3 KLDs are known and for a flat history):
WVIR * SF > 1 is DSDE's "KLD rising and large" (DSDE drops to SL_min there); here it lowers the acceptance
expected from the next tokens instead. Under geometric acceptance the expected tokens one step emits with k
draft tokens (the accepted ones plus the target's own correction or bonus token) are
    E_i(k) = sum_{j=0..k} alpha_i^j = (1 - alpha_i^(k+1)) / (1 - alpha_i)
and the step costs (dsde_core.cost.StepCosts, from the engine's online fit at this batch size B)
    T(k) = V + (C_v + C_d) * sum_i k_i + D * max_i k_i.
The plan maximises the batch goodput G(k) = sum_i E_i(k_i) / T(k) over k_i in [0, max_k_i] (Dinkelbach):
    lambda <- G(0) = B / V;  repeat: k <- argmax_k sum_i E_i(k_i) - lambda * T(k);  lambda <- G(k)
where the inner argmax is exact: for each K = max k, every sequence takes its best k_i <= K independently.
k = 0 for all is always a candidate, so speculation switches off exactly where it does not pay, and no cap
rule is needed: a long k raises D * max k for every sequence and is taken only when the batch gains from it.
Hysteresis: a sequence that is off turns on only if that gains `margin` expected tokens beyond break-even
(a sequence that is on turns off at break-even). Probing: a sequence off for `probe_every` plans proposes
`probe_k` tokens so that its acceptance estimate stays fresh; the interval doubles up to `probe_max` while
probes keep it off. Probes of the whole batch fall on the same steps (one plan counter), so they share draft
forwards.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dsde_core.cost import CostPrior, StepCosts
from dsde_core.errors import ConfigError
from dsde_core.policies.base import Plan, SeqInfo, SpeculationPolicy, StepFeedback, clamp_k
from dsde_core.signals import WVIR_FLAT_VARIANCE, scale_factor, wvir

ALPHA_MAX = 0.995  # E(k) stays finite and k grows only as far as costs allow


@dataclass(frozen=True)
class GoodputConfig:
    max_sl: int = 20
    prior_alpha: float = 0.7  # acceptance assumed before a request has drafted
    prior_weight: float = 2.0  # worth this many observed draft positions
    rho: float = 0.9  # per-step decay of the acceptance counts (memory ~ 10 steps)
    eta: float = 0.25  # strength of the instability discount
    window: int = 30  # DSDE's N: KLD history for WVIR
    delta: float = 0.9  # WVIR's decay
    margin: float = 0.05  # expected tokens per step a sequence must gain to switch speculation on
    probe_every: int = 8
    probe_max: int = 64
    probe_k: int = 2
    position_profile: bool = True  # per-position acceptance shape, learnt over all sequences
    profile_decay: float = 0.995  # per step, of the position counts

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.max_sl <= 64, f"max_sl must be in [1, 64], got {self.max_sl}"),
            (0.0 < self.prior_alpha < 1.0, f"prior_alpha must be in (0, 1), got {self.prior_alpha}"),
            (self.prior_weight > 0, f"prior_weight must be > 0, got {self.prior_weight}"),
            (0.0 < self.rho <= 1.0, f"rho must be in (0, 1], got {self.rho}"),
            (self.eta >= 0, f"eta must be >= 0, got {self.eta}"),
            (self.window >= 2, f"window must be >= 2, got {self.window}"),
            (0.0 < self.delta <= 1.0, f"delta must be in (0, 1], got {self.delta}"),
            (self.margin >= 0, f"margin must be >= 0, got {self.margin}"),
            (1 <= self.probe_every <= self.probe_max, f"need 1 <= probe_every <= probe_max, got "
                                                      f"{self.probe_every}, {self.probe_max}"),
            (1 <= self.probe_k <= self.max_sl, f"probe_k must be in [1, max_sl], got {self.probe_k}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"dsde-goodput: {msg}")


@dataclass
class _State:
    temperature: float
    acc: float = 0.0  # decayed accepted draft positions
    rej: float = 0.0  # decayed rejections
    history: deque[float] = field(default_factory=deque)  # last N KLDs
    instability: float = 0.0  # WVIR * SF after the last step that drafted
    on: bool = True
    off_since: int = 0  # plan counter when speculation went off
    probe_every: int = 0
    last_k: int = 0


def expected_tokens(alpha: np.ndarray, max_k: int, shape: np.ndarray | None = None) -> np.ndarray:
    """E[b, k] = sum_{j=0..k} prod_{m<=j} alpha_b * shape_m for k = 0..max_k: the tokens one step emits with k
    drafts (shape: [K] relative acceptance at draft position m given all earlier ones accepted; None: all 1, the
    geometric case). [B] -> [B, K+1]"""
    shape = np.ones(max_k) if shape is None else shape[:max_k]
    cond = np.clip(alpha[:, None] * shape[None, :], 0.0, ALPHA_MAX)  # [B, K]
    reach = np.cumprod(cond, axis=1)  # [B, K]: P(positions 1..j all accepted)
    return np.concatenate([np.ones((len(alpha), 1)), 1.0 + np.cumsum(reach, axis=1)], axis=1)


def best_plan(values: np.ndarray, max_k: np.ndarray, costs: StepCosts, on_bonus: np.ndarray,
              iters: int = 10) -> np.ndarray:
    """Dinkelbach over k in [0, max_k_i]^B for max sum_i values[i, k_i] / T(k), with a per-sequence penalty
    on_bonus[i] for k_i > 0 (hysteresis). values: [B, K+1]; returns k: [B]."""
    b, width = values.shape
    j = np.arange(width)
    allowed = j[None, :] <= max_k[:, None]  # [B, K+1]
    lam = b / costs.verify_s  # goodput of target-only decoding
    ks = np.zeros(b, dtype=np.int64)
    per_token = costs.verify_per_token_s + costs.draft_per_token_s
    for _ in range(iters):
        # N(k) - lambda * T(k), separable once K = max k is fixed: row i picks its best k_i <= K
        score = values - lam * per_token * j[None, :] - on_bonus[:, None] * (j[None, :] > 0)  # [B, K+1]
        score = np.where(allowed, score, -np.inf)
        best = np.maximum.accumulate(score, axis=1)  # [B, K+1]: best score with k_i <= K
        objective = best.sum(axis=0) - lam * (costs.verify_s + costs.draft_fwd_s * j)  # [K+1]
        top = int(np.argmax(objective))
        cand = np.argmax(np.where(j[None, :] <= top, score, -np.inf), axis=1)  # [B]
        gain = values[np.arange(b), cand].sum() - on_bonus[cand > 0].sum()
        new_lam = gain / costs.step_s(cand.tolist())
        if new_lam <= lam * (1 + 1e-9):
            break
        ks, lam = cand, new_lam
    return ks


class GoodputPolicy(SpeculationPolicy):
    """Batch-level: plans every sequence together (it needs the step costs; the engine passes them)."""

    name = "dsde-goodput"
    cost_aware = True

    def __init__(self, config: GoodputConfig | None = None) -> None:
        self.config = config or GoodputConfig()
        self._states: dict[str, _State] = {}
        self._plans = 0
        self._default = _prior_costs()
        self._pos_seen = np.zeros(self.config.max_sl)  # decayed: draft positions reached (all earlier accepted)
        self._pos_acc = np.zeros(self.config.max_sl)  # decayed: of those, accepted

    # ---- estimates -------------------------------------------------------------------------------------
    def alpha(self, req_id: str) -> float:
        """alpha_i: the acceptance expected per draft token, after the instability discount."""
        s, cfg = self._states[req_id], self.config
        a0 = cfg.prior_alpha * cfg.prior_weight
        alpha_hat = (s.acc + a0) / (s.acc + s.rej + cfg.prior_weight)
        discount = min(1.0, 1.0 / s.instability) ** cfg.eta if s.instability > 0 else 1.0
        return min(alpha_hat * discount, ALPHA_MAX)

    def position_shape(self) -> np.ndarray | None:
        """[max_sl] conditional acceptance at each draft position over the mean one (acceptance tends to come in
        runs: a token after accepted ones is more likely accepted), shrunk to 1 where positions are rarely seen."""
        if not self.config.position_profile:
            return None
        w = self.config.prior_weight * 4
        overall = (self._pos_acc.sum() + 1.0) / (self._pos_seen.sum() + 2.0)
        cond = (self._pos_acc + w * overall) / (self._pos_seen + w)  # [max_sl]
        return cond / overall

    # ---- the policy interface ----------------------------------------------------------------------------
    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None) -> list[Plan]:
        cfg = self.config
        self._plans += 1
        if not seqs:
            return []
        for seq in seqs:
            if seq.req_id not in self._states:
                self._states[seq.req_id] = _State(seq.temperature, probe_every=cfg.probe_every)
            self._states[seq.req_id].temperature = seq.temperature
        states = [self._states[s.req_id] for s in seqs]
        max_k = np.array([min(s.max_k, cfg.max_sl) for s in seqs], dtype=np.int64)  # [B]
        alpha = np.array([self.alpha(s.req_id) for s in seqs])  # [B]
        values = expected_tokens(alpha, int(max_k.max()), self.position_shape())  # [B, K+1]
        bonus = np.array([0.0 if st.on else cfg.margin for st in states])
        ks = best_plan(values, max_k, costs or self._default, bonus)
        plans = []
        for seq, st, k in zip(seqs, states, ks.tolist(), strict=True):
            if k == 0 and not st.on and self._plans - st.off_since >= st.probe_every:
                k = min(cfg.probe_k, seq.max_k)  # a probe: refresh the acceptance estimate
                st.off_since = self._plans
                st.probe_every = min(2 * st.probe_every, cfg.probe_max)
            elif k > 0 and not st.on:
                st.on, st.probe_every = True, cfg.probe_every
            elif k == 0 and st.on and seq.max_k > 0:
                st.on, st.off_since = False, self._plans
            st.last_k = k
            plans.append(Plan(clamp_k(k, seq.max_k)))
        return plans

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        cfg = self.config
        self._pos_seen *= cfg.profile_decay
        self._pos_acc *= cfg.profile_decay
        for fb in feedback:
            s = self._states.get(fb.req_id)
            if s is None or fb.proposed == 0:
                continue
            reached = min(fb.accepted + 1, fb.proposed, cfg.max_sl)  # positions 0..accepted were judged
            self._pos_seen[:reached] += 1.0
            self._pos_acc[: min(fb.accepted, cfg.max_sl)] += 1.0
            s.acc = cfg.rho * s.acc + fb.accepted
            s.rej = cfg.rho * s.rej + (1.0 if fb.accepted < fb.proposed else 0.0)
            klds = [max(0.0, v) for v in fb.kld]
            s.history.extend(klds)
            while len(s.history) > cfg.window:
                s.history.popleft()
            # DSDE's instability, as in its SL rule: WVIR over the KLD history times SF of this step's mean KLD
            sf = scale_factor(sum(klds) / len(klds), s.temperature, True)
            # (a flat history is no evidence of rising instability: 0, where DSDE's WVIR reports its constant 20)
            known = len(s.history) >= cfg.window // 3 and np.var(s.history) >= WVIR_FLAT_VARIANCE
            s.instability = wvir(s.history, cfg.delta) * sf if known else 0.0

    def release(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def num_tracked(self) -> int:
        return len(self._states)

    def stats(self, req_id: str) -> dict[str, float]:
        s = self._states.get(req_id)
        if s is None:
            return {}
        return {"alpha": self.alpha(req_id), "instability": s.instability, "on": float(s.on), "k": float(s.last_k)}


def _prior_costs() -> StepCosts:
    p = CostPrior()
    return StepCosts(p.verify_base_s, p.verify_per_token_s, p.draft_fwd_s, p.draft_per_token_s)
