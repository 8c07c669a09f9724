"""DSDE's stability signals: per-position KLD, the weighted variance intensity ratio, the scale factor.

Pure functions, no state. The KLDs are torch (they are computed where the target's probabilities live,
batched over positions); WVIR and the scale factor are scalar bookkeeping on a short per-request history
and use numpy / math. Formulas: arXiv 2509.01083 and the authors' vLLM fork; each function states its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

KLD_EPS = 1e-8
"""Both distributions are clamped at this before the log, as in the authors' code."""

WVIR_FLAT_VARIANCE = 1e-6
"""A long-window weighted variance below this counts as 'flat history'."""

WVIR_FLAT_VALUE = 20.0
"""WVIR reported for a flat history (the authors' constant)."""

WVIR_SHORT_DIVISOR = 3
"""The short window is the newest max(1, n // 3) values: 10 of a full 30-value history."""

SF_ALPHA = 2.0
"""SF = exp(SF_ALPHA * mu) - 1."""

SF_MAX_EXPONENT = 60.0
"""The exponent is capped here so SF stays finite (WVIR * SF is then never inf * 0 = nan). Any exponent
past ~ln(2) already gives SF > 1, so the cap never changes a decision unless WVIR < exp(-60)."""


def sparse_kld(p_full: Tensor, q_ids: Tensor, q_probs: Tensor, eps: float = KLD_EPS) -> Tensor:
    """KL(p || q) over the K draft ids plus one "rest" bin, batched over leading dims.

    Args:
        p_full: [..., V] target probabilities (after temperature) over the whole vocabulary.
        q_ids: [..., K] the draft's top-K token ids (distinct within a row).
        q_probs: [..., K] the draft's *untruncated* probabilities at those ids, so that
            q_rest = 1 - sum(q_probs) is the draft's mass outside the K ids (normally > 0).
        eps: both sides of every bin are clamped at eps before the log.

    Returns:
        [...] KL divergence in nats.

    The K+1 bins are {v_1}, ..., {v_K}, rest, with p_rest = 1 - sum_k p[v_k] and q_rest = 1 - sum_k q_k:
        KLD_sparse = sum_k p_k log(p_k / q_k) + p_rest log(p_rest / q_rest).
    By the log-sum inequality, sum_{v in rest} p_v log(p_v / q_v) >= p_rest log(p_rest / q_rest), so this
    is a LOWER BOUND of the full-vocabulary KLD; it is exact when either distribution puts all of its rest
    mass on one token, or when p and q are proportional on the rest. (With the eps clamps the bound holds
    up to O(V * eps).) Only K + 1 numbers per position cross the wire instead of V.
    """
    if q_ids.shape != q_probs.shape:
        raise ValueError(f"q_ids {tuple(q_ids.shape)} and q_probs {tuple(q_probs.shape)} differ in shape")
    if p_full.shape[:-1] != q_ids.shape[:-1]:
        raise ValueError(
            f"leading dims differ: p_full {tuple(p_full.shape)} vs q_ids {tuple(q_ids.shape)}; "
            "expected [..., V] and [..., K]"
        )
    dtype = torch.promote_types(p_full.dtype, torch.float32)
    return sparse_kld_at(p_full.to(dtype).gather(-1, q_ids.long()), q_probs, eps)


def sparse_kld_at(p: Tensor, q_probs: Tensor, eps: float = KLD_EPS) -> Tensor:
    """sparse_kld from the target's probabilities at the K draft ids alone, p [..., K] (the rest bin needs no
    more): a verifier gets them from its logits without a full-vocabulary softmax."""
    dtype = torch.promote_types(p.dtype, torch.float32)
    p = p.to(dtype)
    q = q_probs.to(dtype)
    # The rest bin: mass outside the K draft ids, on each side.
    p_rest = 1.0 - p.sum(-1, keepdim=True)
    q_rest = 1.0 - q.sum(-1, keepdim=True)
    p = torch.cat([p, p_rest], dim=-1).clamp_min(eps)
    q = torch.cat([q, q_rest], dim=-1).clamp_min(eps)
    # KL(p || q) = sum p (log p - log q) over the K + 1 bins.
    return (p * (p.log() - q.log())).sum(-1)


def full_kld(p: Tensor, q: Tensor, eps: float = KLD_EPS) -> Tensor:
    """Exact KL(p || q) over the whole last dim, both clamped at eps (for validation of sparse_kld)."""
    if p.shape != q.shape:
        raise ValueError(f"p {tuple(p.shape)} and q {tuple(q.shape)} must have the same shape")
    dtype = torch.promote_types(torch.promote_types(p.dtype, q.dtype), torch.float32)
    p = p.to(dtype).clamp_min(eps)
    q = q.to(dtype).clamp_min(eps)
    return (p * (p.log() - q.log())).sum(-1)


def entropy(probs: Tensor) -> Tensor:
    """Shannon entropy in nats over the last dim, H = -sum p log p with 0 log 0 = 0."""
    probs = probs.to(torch.promote_types(probs.dtype, torch.float32))
    return -torch.special.xlogy(probs, probs).sum(-1)


def weighted_variance(x: np.ndarray, w: np.ndarray) -> float:
    """Var_w(x) = sum w (x - mu_w)^2 / sum w with mu_w = sum w x / sum w."""
    mu = float((w * x).sum() / w.sum())
    return float((w * (x - mu) ** 2).sum() / w.sum())


def wvir(kld_history: Sequence[float], delta: float) -> float:
    """Weighted variance intensity ratio of a KLD history (oldest first, newest last).

    Weights decay into the past: w_j = delta^(n-1-j), the newest value weighs 1 (in both windows).
        WVIR = Var_w(newest max(1, n//3) values) / Var_w(all n values)
    WVIR > 1: the recent KLDs vary more than the history does, i.e. instability is rising.
    Returns 0 if n < 2 (no variance yet) and WVIR_FLAT_VALUE (20) if the long variance < 1e-6.
    """
    x = np.asarray(kld_history, dtype=np.float64).reshape(-1)
    n = x.size
    if n < 2:
        return 0.0
    w = delta ** np.arange(n - 1, -1, -1, dtype=np.float64)
    m = max(1, n // WVIR_SHORT_DIVISOR)
    var_long = weighted_variance(x, w)
    if var_long < WVIR_FLAT_VARIANCE:
        return WVIR_FLAT_VALUE
    var_short = weighted_variance(x[-m:], w[-m:])
    return var_short / var_long


def scale_factor(mean_kld_last_step: float, temperature: float, divide_by_temperature: bool) -> float:
    """SF = exp(2 * mu / T) - 1 (divide_by_temperature; T = 0, greedy, counts as 1), else exp(2 * mu) - 1.

    mu is the mean KLD over the last step's proposed positions. SF grows with the current divergence and
    multiplies WVIR in the SL rule: WVIR * SF > 1 sends the sequence to SL_min. mu is floored at 0 (a KLD
    is >= 0; tiny negatives are eps round-off) and the exponent is capped at SF_MAX_EXPONENT.
    """
    mu = max(0.0, float(mean_kld_last_step))
    if divide_by_temperature and temperature > 0:
        mu = mu / temperature
    return math.exp(min(SF_ALPHA * mu, SF_MAX_EXPONENT)) - 1.0
