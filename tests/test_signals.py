"""signals.py against direct numpy computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsde_core.signals import (
    KLD_EPS,
    WVIR_FLAT_VALUE,
    entropy,
    full_kld,
    scale_factor,
    sparse_kld,
    wvir,
)


def _np_kl(p: np.ndarray, q: np.ndarray, eps: float = KLD_EPS) -> float:
    p = np.maximum(p, eps)
    q = np.maximum(q, eps)
    return float(np.sum(p * (np.log(p) - np.log(q))))


def _np_sparse_kl(p_full: np.ndarray, ids: np.ndarray, q_sel: np.ndarray, eps: float = KLD_EPS) -> float:
    p_sel = p_full[ids]
    p_bins = np.append(p_sel, 1.0 - p_sel.sum())
    q_bins = np.append(q_sel, 1.0 - q_sel.sum())
    return _np_kl(p_bins, q_bins, eps)


def _np_wvir(x: list[float], delta: float) -> float:
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if n < 2:
        return 0.0

    def wvar(v: np.ndarray) -> float:
        w = np.array([delta ** (len(v) - 1 - j) for j in range(len(v))])
        mu = np.sum(w * v) / np.sum(w)
        return float(np.sum(w * (v - mu) ** 2) / np.sum(w))

    long = wvar(x)
    if long < 1e-6:
        return 20.0
    return wvar(x[-max(1, n // 3):]) / long


def _dirichlet(rng: np.random.Generator, shape: tuple[int, ...], alpha: float = 0.5) -> np.ndarray:
    return rng.dirichlet(np.full(shape[-1], alpha), size=shape[:-1])


# ---------------------------------------------------------------- KLD


def test_sparse_kld_matches_numpy_batched() -> None:
    rng = np.random.default_rng(0)
    k, V, K = 4, 40, 6
    p = _dirichlet(rng, (k, V))
    q = _dirichlet(rng, (k, V))
    ids = np.stack([rng.choice(V, size=K, replace=False) for _ in range(k)])
    q_sel = np.take_along_axis(q, ids, axis=-1)
    got = sparse_kld(torch.tensor(p), torch.tensor(ids), torch.tensor(q_sel))
    assert got.shape == (k,)
    want = [_np_sparse_kl(p[i], ids[i], q_sel[i]) for i in range(k)]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


def test_sparse_kld_extra_leading_dims_and_float32() -> None:
    rng = np.random.default_rng(1)
    p = _dirichlet(rng, (2, 3, 20))
    q = _dirichlet(rng, (2, 3, 20))
    ids = np.argsort(-q, axis=-1)[..., :5]
    q_sel = np.take_along_axis(q, ids, axis=-1)
    f32 = torch.float32
    got = sparse_kld(torch.tensor(p, dtype=f32), torch.tensor(ids), torch.tensor(q_sel, dtype=f32))
    assert got.shape == (2, 3) and got.dtype == torch.float32
    want = np.array([[_np_sparse_kl(p[a, b], ids[a, b], q_sel[a, b]) for b in range(3)] for a in range(2)])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)


def test_sparse_kld_rest_bin_by_hand() -> None:
    # V = 4, K = 2 draft ids {0, 1}: p = [.5, .2 | .2, .1], q at ids = [.4, .4], q_rest = .2, p_rest = .3
    p = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64)
    got = sparse_kld(p, torch.tensor([0, 1]), torch.tensor([0.4, 0.4], dtype=torch.float64))
    want = 0.5 * math.log(0.5 / 0.4) + 0.2 * math.log(0.2 / 0.4) + 0.3 * math.log(0.3 / 0.2)
    assert got.item() == pytest.approx(want, rel=1e-12)


def test_sparse_equals_full_when_ids_cover_vocab() -> None:
    rng = np.random.default_rng(2)
    p = _dirichlet(rng, (3, 12), alpha=1.0)
    q = _dirichlet(rng, (3, 12), alpha=1.0)
    ids = np.stack([rng.permutation(12) for _ in range(3)])
    q_sel = np.take_along_axis(q, ids, axis=-1)
    sparse = sparse_kld(torch.tensor(p), torch.tensor(ids), torch.tensor(q_sel))
    full = full_kld(torch.tensor(p), torch.tensor(q))
    torch.testing.assert_close(sparse, full, rtol=1e-9, atol=1e-9)


def test_sparse_equals_full_when_rest_is_proportional() -> None:
    # Outside the ids, q = 2 * p: the log-sum inequality is tight.
    p = torch.tensor([0.6, 0.1, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.3, 0.1, 0.4, 0.2], dtype=torch.float64)
    sparse = sparse_kld(p, torch.tensor([0, 1]), q[[0, 1]])
    assert sparse.item() == pytest.approx(full_kld(p, q).item(), rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_sparse_is_lower_bound_of_full(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k, V, K = 16, 64, 8
    p = torch.tensor(_dirichlet(rng, (k, V), alpha=0.3))
    q = torch.tensor(_dirichlet(rng, (k, V), alpha=0.3))
    ids = torch.topk(q, K, dim=-1).indices
    sparse = sparse_kld(p, ids, q.gather(-1, ids))
    full = full_kld(p, q)
    assert torch.all(sparse <= full + 1e-9), (sparse - full).max()
    assert torch.all(sparse >= -1e-9)


def test_sparse_kld_eps_clamping() -> None:
    # p is 0 at a draft id, q_probs sum to 1 (q_rest = 0): every bin clamps at eps, the result stays finite.
    p = torch.tensor([0.0, 0.7, 0.3], dtype=torch.float64)
    ids = torch.tensor([0, 1])
    q_sel = torch.tensor([0.5, 0.5], dtype=torch.float64)
    got = sparse_kld(p, ids, q_sel).item()
    eps = KLD_EPS
    want = eps * math.log(eps / 0.5) + 0.7 * math.log(0.7 / 0.5) + 0.3 * math.log(0.3 / eps)
    assert math.isfinite(got) and got == pytest.approx(want, rel=1e-12)
    # A custom eps is honoured.
    got2 = sparse_kld(p, ids, q_sel, eps=1e-4).item()
    assert got2 == pytest.approx(_np_sparse_kl(p.numpy(), ids.numpy(), q_sel.numpy(), eps=1e-4), rel=1e-12)


def test_sparse_kld_shape_errors() -> None:
    with pytest.raises(ValueError, match="shape"):
        sparse_kld(torch.rand(2, 10), torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 4))
    with pytest.raises(ValueError, match="leading dims"):
        sparse_kld(torch.rand(3, 10), torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3))


def test_full_kld_matches_numpy_and_is_zero_on_equal() -> None:
    rng = np.random.default_rng(3)
    p = _dirichlet(rng, (5, 30))
    q = _dirichlet(rng, (5, 30))
    got = full_kld(torch.tensor(p), torch.tensor(q)).numpy()
    np.testing.assert_allclose(got, [_np_kl(p[i], q[i]) for i in range(5)], rtol=1e-10)
    assert full_kld(torch.tensor(p), torch.tensor(p)).abs().max().item() < 1e-12
    with pytest.raises(ValueError):
        full_kld(torch.rand(3), torch.rand(4))


def test_entropy() -> None:
    rng = np.random.default_rng(4)
    p = _dirichlet(rng, (3, 7))
    want = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(entropy(torch.tensor(p)).numpy(), want, rtol=1e-12)
    assert entropy(torch.full((4,), 0.25)).item() == pytest.approx(math.log(4), rel=1e-6)
    assert entropy(torch.tensor([0.0, 1.0, 0.0])).item() == 0.0  # 0 log 0 = 0


# ---------------------------------------------------------------- WVIR


@pytest.mark.parametrize("history", [[], [0.3]])
def test_wvir_fewer_than_two_values_is_zero(history: list[float]) -> None:
    assert wvir(history, 0.9) == 0.0


def test_wvir_flat_history_is_20() -> None:
    assert wvir([0.2] * 30, 0.9) == WVIR_FLAT_VALUE == 20.0
    assert wvir([0.0, 0.0], 0.85) == 20.0
    assert wvir([0.1, 0.1 + 1e-4, 0.1], 0.9) == 20.0  # long variance ~2e-9 < 1e-6


def test_wvir_two_values_short_window_is_one_value() -> None:
    # n = 2: short window max(1, 0) = 1 value, whose variance is 0.
    assert wvir([0.1, 0.9], 0.9) == 0.0


def test_wvir_unweighted_by_hand() -> None:
    # delta = 1: plain variances. n = 6 -> short window = last 2.
    x = [0.0, 1.0, 0.0, 1.0, 0.0, 2.0]
    assert wvir(x, 1.0) == pytest.approx(np.var([0.0, 2.0]) / np.var(x), rel=1e-12)


def test_wvir_weighted_by_hand() -> None:
    # x = [0, 0, 0, 0, 0, 3], delta = 1/2. Short window [0, 3], w = [1/2, 1]: mu = 2, var = (2 + 1)/1.5 = 2.
    # Long: w = [1/32 .. 1], sum 63/32, mu = 32/21,
    #   var = ((31/32)(32/21)^2 + (31/21)^2) / (63/32) = (1953/441)(32/63) = 62496/27783.
    x = [0.0, 0.0, 0.0, 0.0, 0.0, 3.0]
    assert wvir(x, 0.5) == pytest.approx(2 * 27783 / 62496, rel=1e-12)


@pytest.mark.parametrize("delta", [0.9, 0.85, 0.5])
@pytest.mark.parametrize("n", [2, 3, 5, 10, 30])
def test_wvir_matches_numpy(n: int, delta: float) -> None:
    rng = np.random.default_rng(n * 100 + int(delta * 100))
    x = list(rng.exponential(0.3, size=n))
    assert wvir(x, delta) == pytest.approx(_np_wvir(x, delta), rel=1e-12)


def test_wvir_rising_instability_is_above_one() -> None:
    calm_then_noisy = [0.1] * 20 + [0.1, 1.0, 0.1, 1.5, 0.05, 1.2, 0.1, 1.0, 0.2, 1.3]
    noisy_then_calm = list(reversed(calm_then_noisy))
    assert wvir(calm_then_noisy, 0.9) > 1.0
    assert wvir(noisy_then_calm, 0.9) < 1.0


def test_wvir_accepts_deque_and_array() -> None:
    from collections import deque

    x = [0.1, 0.4, 0.2, 0.8, 0.3, 0.5]
    assert wvir(deque(x), 0.9) == wvir(np.array(x), 0.9) == wvir(x, 0.9)


# ---------------------------------------------------------------- scale factor


def test_scale_factor_formulas() -> None:
    assert scale_factor(0.15, 0.5, True) == pytest.approx(math.exp(2 * 0.15 / 0.5) - 1, rel=1e-12)
    assert scale_factor(0.15, 0.5, False) == pytest.approx(math.exp(2 * 0.15) - 1, rel=1e-12)
    assert scale_factor(0.15, 0.0, True) == pytest.approx(math.exp(0.3) - 1, rel=1e-12)  # T = 0 counts as 1
    assert scale_factor(0.15, 1.0, True) == scale_factor(0.15, 1.0, False)
    assert scale_factor(0.0, 0.7, True) == 0.0


def test_scale_factor_guards() -> None:
    assert scale_factor(-1e-9, 1.0, True) == 0.0  # a negative KLD is round-off: floored at 0
    big = scale_factor(50.0, 0.01, True)  # exponent 1e4 would overflow
    assert math.isfinite(big) and big > 1e20
    assert 0.0 * big == 0.0
