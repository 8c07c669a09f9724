"""The step-cost model: what a step will cost, learnt online from the step times the engine observes.

One engine step with per-sequence draft lengths k_i over a batch of B sequences costs
    draft  = D0 * max_i k_i + D1 * sum_i k_i            max k batched draft forwards; rows shrink as sequences stop
    verify = V0 + V1 * B + C * sum_i k_i                one ragged target forward over sum_i (k_i + 1) tokens
StepCosts is that model evaluated at one B; the policy only ever uses ratios of its terms. OnlineCostModel fits the
five coefficients by recursive least squares with forgetting (old hardware states fade) on every decode step the
engine times, starting from a prior shaped like this CPU pair (a draft forward ~ 1/4 of a target forward) so that
a cost-aware policy behaves sensibly before the first measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dsde_core.errors import ConfigError


@dataclass(frozen=True)
class StepCosts:
    """Predicted seconds of the parts of one step at a fixed batch size."""

    verify_s: float  # the target forward with no draft tokens (k_i = 0 for all i)
    verify_per_token_s: float  # + this per draft token verified
    draft_fwd_s: float  # one batched draft forward, paid max_i k_i times
    draft_per_token_s: float  # + this per draft token proposed

    def __post_init__(self) -> None:
        if not self.verify_s > 0:
            raise ConfigError(f"StepCosts.verify_s must be > 0, got {self.verify_s}")
        for name in ("verify_per_token_s", "draft_fwd_s", "draft_per_token_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"StepCosts.{name} must be >= 0, got {getattr(self, name)}")

    def step_s(self, ks: Sequence[int]) -> float:
        """Seconds of a step with these k_i (0 included)."""
        total, longest = sum(ks), max(ks, default=0)
        return self.verify_s + (self.verify_per_token_s + self.draft_per_token_s) * total + self.draft_fwd_s * longest


@dataclass(frozen=True)
class CostPrior:
    """The model before any measurement, in seconds (the ratios are what matter: a ~0.25 draft/target ratio)."""

    verify_base_s: float = 0.080
    verify_per_seq_s: float = 0.004
    verify_per_token_s: float = 0.004
    draft_fwd_s: float = 0.020
    draft_per_token_s: float = 0.001
    weight: float = 4.0  # how many observations the prior is worth
    forgetting: float = 0.98  # per observation: the fit's memory is ~1 / (1 - forgetting) = 50 steps


class _RLS:
    """Recursive least squares y ~ x . theta with exponential forgetting.

    Forgetting divides the covariance by lambda every update; in a direction the features never vary in (a steady
    batch size, k_i all equal) nothing shrinks it again, so it would grow as lambda^-n ("covariance windup") and
    overflow after ~10^4 steps. Its eigenvalues are therefore capped at `windup` times the prior's largest variance
    (which keeps it symmetric positive semi-definite and leaves the excited directions alone), and an update that
    is not finite is dropped."""

    def __init__(self, theta: Sequence[float], typical: Sequence[float], weight: float, forgetting: float) -> None:
        self.theta = np.asarray(theta, dtype=np.float64)
        # P is the coefficients' covariance over the timing noise's variance (the normal equations' inverse), so a
        # prior worth `weight` observations of each feature at its typical size x is P0 = 1 / (weight x^2), whatever
        # the noise and the coefficient's size
        self.p = np.diag(1.0 / (weight * np.asarray(typical, dtype=np.float64) ** 2))
        self.max_var = 100.0 * float(np.max(np.diag(self.p)))  # windup cap
        self.lam = forgetting

    def update(self, x: Sequence[float], y: float) -> None:
        x = np.asarray(x, dtype=np.float64)
        px = self.p @ x
        gain = px / (self.lam + x @ px)
        theta = self.theta + gain * (y - x @ self.theta)
        p = (self.p - np.outer(gain, px)) / self.lam
        if not (np.all(np.isfinite(theta)) and np.all(np.isfinite(p))):
            return
        if np.max(np.diag(p)) > self.max_var:  # only then: an eigendecomposition (3x3) per update is not needed
            w, v = np.linalg.eigh((p + p.T) / 2)
            p = (v * np.minimum(w, self.max_var)) @ v.T
        self.theta, self.p = theta, p


class OnlineCostModel:
    """Fits the step-cost model above to the engine's decode steps (prefill steps are not decode costs)."""

    def __init__(self, prior: CostPrior | None = None) -> None:
        p = prior or CostPrior()
        self.prior = p
        # the typical size of each feature: 1, B ~ 8, sum k ~ 8;  max k ~ 4, sum k ~ 16
        self._verify = _RLS([p.verify_base_s, p.verify_per_seq_s, p.verify_per_token_s], [1.0, 8.0, 8.0], p.weight,
                            p.forgetting)
        self._draft = _RLS([p.draft_fwd_s, p.draft_per_token_s], [4.0, 16.0], p.weight, p.forgetting)
        self.observed = 0

    def observe(self, ks: Sequence[int], draft_s: float, verify_s: float) -> None:
        """One decode step: k_i per running sequence, the seconds of its draft and verify phases."""
        b, total, longest = len(ks), sum(ks), max(ks, default=0)
        if b == 0:
            return
        self._verify.update([1.0, b, total], verify_s)
        if longest > 0:
            self._draft.update([longest, total], draft_s)
        self.observed += 1

    def estimate(self, batch: int) -> StepCosts:
        """The model at batch size `batch`; coefficients are floored so that costs stay positive."""
        v0, v1, c = self._verify.theta
        d0, d1 = self._draft.theta
        floor = 0.05 * self.prior.verify_base_s
        verify = max(v0 + v1 * max(batch, 1), floor)
        return StepCosts(verify_s=float(verify), verify_per_token_s=float(max(c, 0.0)),
                         draft_fwd_s=float(max(d0, 0.0)), draft_per_token_s=float(max(d1, 0.0)))
