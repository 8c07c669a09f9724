"""Sampling processors and lossless verification on toy distributions with known p and q."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dsde_core.config import SamplingParams
from dsde_core.errors import ConfigError
from dsde_core.sampling import batch_probs, draft_dist, draft_dists, inverse_cdf, sample_level
from dsde_core.verify import verify_batch
from tests.reference_sampling import History, filter_logits, penalize, target_probs

V = 6
P = torch.tensor([
    [0.30, 0.25, 0.20, 0.15, 0.07, 0.03],  # p_1
    [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],  # p_2
    [0.40, 0.10, 0.10, 0.10, 0.10, 0.20],  # p_3: the bonus position
])
# the draft's sparse distributions: K = 4 ids each, zero mass on the other two tokens
Q_IDS = torch.tensor([[0, 1, 2, 5], [3, 4, 5, 0]])
Q_PROBS = torch.tensor([[0.10, 0.50, 0.30, 0.10], [0.10, 0.60, 0.20, 0.10]])


def _draws(n: int, seed: int = 0) -> list[list[int]]:
    """n independent steps of two drafted tokens, each drawn from its q by inverse CDF, verified by the batched
    sampler: the tokens each step emits."""
    gen = torch.Generator().manual_seed(seed)
    j = inverse_cdf(Q_PROBS.repeat(n, 1, 1), torch.rand(n, 2, generator=gen))  # [n, 2]: index into the K ids
    drafts = Q_IDS.repeat(n, 1, 1).gather(-1, j[..., None]).squeeze(-1)  # [n, 2]
    tokens, accepted = verify_batch(P.repeat(n, 1), 3 * torch.arange(n), torch.zeros(n, dtype=torch.bool), drafts,
                                    torch.full((n,), 2), Q_IDS.repeat(n, 1, 1), Q_PROBS.repeat(n, 1, 1),
                                    torch.rand(n, 3, generator=gen))
    return [row[: a + 1] for row, a in zip(tokens.tolist(), accepted.tolist(), strict=True)]


def _assert_matches(samples: list[int], p: torch.Tensor) -> None:
    counts = np.bincount(samples, minlength=V)
    expected = p.double().numpy() / p.double().sum().item() * len(samples)
    assert chisquare(counts, expected).pvalue > 1e-3, (counts, expected)
    tv = 0.5 * np.abs(counts / len(samples) - p.numpy()).sum()
    assert tv < 0.01, tv


@pytest.fixture(scope="module")
def draws() -> list[list[int]]:
    return _draws(100_000)


def test_first_token_is_distributed_as_p1(draws: list[list[int]]) -> None:
    # covers the accept path and the residual path (tokens 3 and 4 lie outside the draft's support)
    _assert_matches([d[0] for d in draws], P[0])


def test_token_after_an_acceptance_is_distributed_as_p2(draws: list[list[int]]) -> None:
    _assert_matches([d[1] for d in draws if len(d) >= 2], P[1])


def test_bonus_token_is_distributed_as_p3(draws: list[list[int]]) -> None:
    bonus = [d[2] for d in draws if len(d) == 3]
    assert len(bonus) > 5_000  # the bonus path is exercised often enough to test
    _assert_matches(bonus, P[2])


def test_acceptance_rate_is_sum_of_min_p_q(draws: list[list[int]]) -> None:
    q1 = torch.zeros(V).index_add_(0, Q_IDS[0], Q_PROBS[0])
    expected = float(torch.minimum(P[0], q1).sum())
    observed = np.mean([len(d) >= 2 for d in draws])
    assert abs(observed - expected) < 0.01


def test_draft_equal_to_target_is_always_accepted() -> None:
    gen = torch.Generator().manual_seed(1)
    n, ids = 200, torch.arange(V).repeat(200, 2, 1)  # [n, 2, V]: the draft's support is the whole vocabulary
    q = P[0].repeat(n, 2, 1)  # [n, 2, V]: q = p at both positions
    drafts = inverse_cdf(q, torch.rand(n, 2, generator=gen))  # [n, 2]
    _, accepted = verify_batch(P[0].repeat(3 * n, 1), 3 * torch.arange(n), torch.zeros(n, dtype=torch.bool), drafts,
                               torch.full((n,), 2), ids, q, torch.rand(n, 3, generator=gen))
    assert accepted.tolist() == [2] * n


def test_greedy_verification_accepts_the_matching_prefix() -> None:
    logits = torch.full((4, V), -1.0)
    for j, t in enumerate([2, 3, 1, 5]):  # target argmax per position
        logits[j, t] = 1.0

    def verify(drafts: list[int]) -> list[int]:
        k = len(drafts)
        one_hot = torch.zeros(1, max(k, 1), 1)  # a greedy draft's q: one-hot on its token
        one_hot[..., 0] = 1.0
        tokens, accepted = verify_batch(logits[: k + 1], torch.tensor([0]), torch.tensor([True]),
                                        torch.tensor([drafts or [0]])[:, :k], torch.tensor([k]),
                                        torch.tensor([drafts or [0]])[..., None][:, :k], one_hot[:, :k],
                                        torch.zeros(1, k + 1))
        return tokens[0, : int(accepted[0]) + 1].tolist()

    assert verify([2, 3, 1]) == [2, 3, 1, 5]  # all accepted + bonus
    assert verify([2, 4, 1]) == [2, 3]  # mismatch at position 2: emit the target's token
    assert verify([0, 3, 1]) == [2]
    assert verify([]) == [2]  # target-only step


def test_draft_dist_greedy_is_one_hot_and_signal_keeps_the_rest_mass() -> None:
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 0.5, 1.0])
    d = draft_dist(logits, SamplingParams(), top_k=3)
    assert d.ids.tolist() == [1, 2, 5]
    assert d.q_sample.tolist() == [1.0, 0.0, 0.0]
    full = torch.softmax(logits, -1)  # signal at temperature 1 for greedy requests
    assert torch.allclose(d.q_signal, full[[1, 2, 5]])
    assert float(d.q_signal.sum()) < 1.0
    assert d.entropy == pytest.approx(float(-(full * full.log()).sum()), rel=1e-5)


def test_draft_dist_sampling_is_truncated_and_processed() -> None:
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 0.5, 1.0])
    d = draft_dist(logits, SamplingParams(temperature=0.5, top_k=2), top_k=4)
    expected = torch.softmax(torch.tensor([3.0, 2.0]) / 0.5, -1)
    assert torch.allclose(d.q_sample[:2], expected) and d.q_sample[2:].sum() == 0


def test_target_probs_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))  # 0.5 + 0.3 reaches 0.8
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"stop": ("",)},
    {"presence_penalty": 2.01}, {"frequency_penalty": -2.5}, {"frequency_penalty": float("nan")},
    {"repetition_penalty": 0.0}, {"repetition_penalty": 5e-324}, {"repetition_penalty": 10.5},
    {"presence_penalty": "1"},
])
def test_sampling_params_reject_bad_values(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_penalize_row_j_counts_the_output_and_the_first_j_drafts() -> None:
    """Scripted: logits [3, 8]; prompt {1, 2}; output [3, 3, 4]; drafts [4, 5] (row 1 follows 4, row 2 follows 4, 5)."""
    logits = torch.tensor([[2.0, -1.0, 1.0, 3.0, 0.5, -0.5, 1.5, -2.0]]).repeat(3, 1)  # [3, 8]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    history = History.of([1, 2], [3, 3, 4])
    assert history.ids.tolist() == [1, 2, 3, 4] and history.counts.tolist() == [0, 0, 2, 1]
    out = penalize(logits, history, [4, 5], params)
    rep = torch.tensor([2.0, -2.0, 0.5, 1.5, 0.25, -1.0, 1.5, -2.0])  # ids 1, 2, 3, 4, 5 divided (>0) or multiplied
    want = torch.stack([
        torch.where(torch.tensor([0, 1, 1, 1, 1, 0, 0, 0]).bool(), rep, logits[0]) - torch.tensor(
            [0, 0, 0, 2 * 0.25 + 0.5, 0.25 + 0.5, 0, 0, 0]),
        torch.where(torch.tensor([0, 1, 1, 1, 1, 0, 0, 0]).bool(), rep, logits[0]) - torch.tensor(
            [0, 0, 0, 2 * 0.25 + 0.5, 2 * 0.25 + 0.5, 0, 0, 0]),
        torch.where(torch.tensor([0, 1, 1, 1, 1, 1, 0, 0]).bool(), rep, logits[0]) - torch.tensor(
            [0, 0, 0, 2 * 0.25 + 0.5, 2 * 0.25 + 0.5, 0.25 + 0.5, 0, 0]),
    ])
    assert torch.allclose(out, want)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 1.0, 3.0, 0.5, -0.5, 1.5, -2.0]]).repeat(3, 1))  # kept
    assert torch.allclose(penalize(logits[:1], history, [4, 5], params, first=2), want[2:])  # one row, after both
    assert penalize(logits, history, [], SamplingParams()) is logits  # no penalty: nothing computed


def test_min_p_drops_tokens_under_a_fraction_of_the_likeliest() -> None:
    """p = [0.5, 0.3, 0.15, 0.05]: min_p 0.35 keeps p >= 0.175 (the first two); the draft's sparse q_sample too."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.35))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    d = draft_dist(logits[0], SamplingParams(temperature=1.0, min_p=0.35), top_k=3)
    assert torch.allclose(d.q_sample, torch.tensor([0.625, 0.375, 0.0]))
    assert torch.allclose(target_probs(logits, SamplingParams(temperature=1.0, min_p=0.0)), logits.exp())


def test_batch_probs_equals_target_probs_row_by_row() -> None:
    """The verifier's batched filters against the per-row definition, over positions of mixed parameters (each
    filter alone, all together, none)."""
    gen = torch.Generator().manual_seed(4)
    rows = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
            for t, k, p, m in [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.2),
                               (0.5, 12, 0.9, 0.05), (2.0, 1, 1.0, 0.0), (1.0, 64, 0.3, 0.0)]]
    logits = 3 * torch.randn(len(rows), 4, 64, generator=gen)  # [R, 4, V]: 4 positions a request
    def batched(ps: list[SamplingParams]) -> torch.Tensor:
        return batch_probs(logits[: len(ps)].reshape(-1, 64), *([getattr(p, f) for p in ps for _ in range(4)]
                                                                for f in ("temperature", "top_k", "top_p", "min_p")))

    out = batched(rows).view(-1, 4, 64)
    for r, params in enumerate(rows):
        torch.testing.assert_close(out[r], target_probs(logits[r], params), atol=1e-6, rtol=1e-5)
    assert (out[5] > 0).sum(-1).tolist() == [1] * 4  # top_k 1: one token a position
    # no position filters: the sort is skipped, the result the same
    torch.testing.assert_close(batched(rows[:1]), target_probs(logits[0], rows[0]), atol=1e-6, rtol=1e-5)


def test_a_draft_level_equals_the_per_row_definition() -> None:
    """draft_dists over rows of mixed parameters (greedy, temperatures, top-k, top-p, min-p, entropy asked or not)
    against the definition row by row: q_signal the untruncated softmax at the signal temperature, q_sample the
    request's filters over the K top logits; sample_level draws ids[0] for greedy rows and, for sampled rows,
    tokens distributed as q_sample (chi-square over 20,000 draws of one row)."""
    gen = torch.Generator().manual_seed(7)
    rows = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=3),
            SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.9, min_p=0.1)]
    logits = 2 * torch.randn(len(rows), 50, generator=gen)  # [B, V]
    level = draft_dists(logits, rows, 8, [r % 2 == 0 for r in range(len(rows))])
    for r, params in enumerate(rows):
        t = params.temperature or 1.0
        top, ids = logits[r].topk(8)
        assert torch.equal(level.ids[r], ids)
        torch.testing.assert_close(level.q_signal[r], torch.softmax(logits[r] / t, -1)[ids])
        want = torch.eye(8)[0] if params.greedy else torch.softmax(
            filter_logits(top / t, params.top_k, params.top_p, params.min_p), -1)
        torch.testing.assert_close(level.q_sample[r], want)
        assert (level.entropy[r] == level.entropy[r]) == (r % 2 == 0)  # nan where not asked
    p0 = torch.softmax(logits[0], -1)
    assert float(level.entropy[0]) == pytest.approx(float(-(p0 * p0.log()).sum()), rel=1e-5)
    tokens, conf = sample_level(level, torch.rand(len(rows), generator=gen))
    assert int(tokens[0]) == int(level.ids[0, 0]) and float(conf[0]) == float(level.q_signal[0, 0])
    n = 20_000
    one = draft_dists(logits[3:4].repeat(n, 1), [rows[3]] * n, 8, [False] * n)
    drawn, _ = sample_level(one, torch.rand(n, generator=gen))
    q = one.q_sample[0]
    counts = torch.stack([(drawn == i).sum() for i in one.ids[0]]).double()
    assert counts[q == 0].sum() == 0
    expected = q[q > 0].double() / q[q > 0].double().sum() * n
    assert chisquare(counts[q > 0].numpy(), expected.numpy()).pvalue > 1e-3
