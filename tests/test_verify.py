"""The batched rejection sampler (dsde_core/verify.py) against a per-row reference written as the algorithm reads,
position by position, given the same uniforms: ragged batches of greedy and sampled rows, draft supports of
different sizes, drafts outside the target's support, target-only rows."""

from __future__ import annotations

import pytest
import torch

from dsde_core.sampling import inverse_cdf
from dsde_core.syncs import SyncCounter
from dsde_core.verify import pack_drafts, verify_batch


def reference(p: torch.Tensor, greedy: bool, drafts: list[int], ids: torch.Tensor | None, q: torch.Tensor | None,
              u: torch.Tensor) -> list[int]:
    """One row: p [k+1, V] (its logits if greedy), ids/q [k, K] the draft's sparse distributions, u [k+1]."""
    out: list[int] = []
    for j, x in enumerate(drafts):
        if greedy:
            ok = x == int(p[j].argmax())
        else:
            q_x = float(q[j][ids[j] == x].sum())
            ok = float(u[j]) * q_x < float(p[j, x])
        if ok:
            out.append(x)
            continue
        if greedy:
            return [*out, int(p[j].argmax())]
        residual = p[j].clone()
        residual.index_add_(0, ids[j], -q[j])
        residual.clamp_(min=0.0)
        row = residual if float(residual.sum()) > 0 else p[j]
        return [*out, int(inverse_cdf(row, u[-1]))]
    last = p[len(drafts)]
    return [*out, int(last.argmax()) if greedy else int(inverse_cdf(last, u[-1]))]


def _batch(seed: int, rows: int = 12, vocab: int = 50, max_k: int = 6):
    """Random rows: each greedy or sampled, k in [0, max_k], a draft support of 1..8 ids, drafts drawn from q (a
    greedy row's q is one-hot on its token, as the draft's is), a peaked p so that both paths occur."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        greedy = bool(torch.rand((), generator=gen) < 0.4)
        k = int(torch.randint(0, max_k + 1, (), generator=gen))
        p = torch.softmax(3 * torch.randn(k + 1, vocab, generator=gen), -1)  # [k+1, V]
        p[:, int(torch.randint(vocab, (), generator=gen))] = 0.0  # a token outside the target's support
        p = p / p.sum(-1, keepdim=True)
        size = 1 if greedy else int(torch.randint(1, 9, (), generator=gen))
        ids = torch.stack([torch.randperm(vocab, generator=gen)[:size] for _ in range(k)]) if k else None
        q = torch.softmax(2 * torch.randn(k, size, generator=gen), -1) if k else None
        drafts = [int(ids[j][int(inverse_cdf(q[j], torch.rand((), generator=gen)))]) for j in range(k)]
        out.append((p, greedy, drafts, ids, q, torch.rand(k + 1, generator=gen)))
    return out


def _packed(rows: list) -> tuple:
    """verify_batch's arguments for rows of _batch."""
    length = max(len(r[2]) for r in rows) + 1
    target = torch.cat([p.log() if greedy else p for p, greedy, *_ in rows])  # [N, V]: a greedy row may hold logits
    offsets = torch.tensor([0, *[len(r[2]) + 1 for r in rows]]).cumsum(0)[:-1]  # [R]
    u = torch.zeros(len(rows), length)
    for i, (_, _, drafts, _, _, draws) in enumerate(rows):
        u[i, : len(drafts)], u[i, -1] = draws[:-1], draws[-1]
    packed = pack_drafts([r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows])
    return (target, offsets, torch.tensor([r[1] for r in rows]), *packed, u)


@pytest.mark.parametrize("seed", range(20))
def test_the_batched_sampler_equals_the_per_row_reference(seed: int) -> None:
    rows = _batch(seed)
    tokens, accepted = verify_batch(*_packed(rows))
    for i, (p, greedy, drafts, ids, q, draws) in enumerate(rows):
        expected = reference(p.log() if greedy else p, greedy, drafts, ids, q, draws)
        assert tokens[i, : int(accepted[i]) + 1].tolist() == expected, i
        assert int(accepted[i]) == len(expected) - 1


def test_an_all_greedy_batch_skips_the_sampled_path_and_verifies_the_same() -> None:
    rows = [r for seed in range(4) for r in _batch(seed) if r[1]]  # the greedy rows of four batches
    args = _packed(rows)
    full, fast = verify_batch(*args), verify_batch(*args, all_greedy=True)
    assert all(torch.equal(a, b) for a, b in zip(full, fast, strict=True)) and len(rows) > 10


def test_both_paths_occur_in_the_random_batches() -> None:
    """The comparison above means something only if rows accept, reject and take the bonus."""
    seen = set()
    for seed in range(20):
        for p, greedy, drafts, ids, q, draws in _batch(seed):
            out = reference(p.log() if greedy else p, greedy, drafts, ids, q, draws)
            seen.add(("greedy" if greedy else "sampled", "bonus" if len(out) == len(drafts) + 1 else "rejected"))
    assert seen == {(g, w) for g in ("greedy", "sampled") for w in ("bonus", "rejected")}


def test_inverse_cdf_never_picks_a_token_without_mass() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(1000, 1)  # [n, V]
    picks = inverse_cdf(probs, torch.linspace(0, 1 - 1e-7, 1000))
    assert set(picks.tolist()) == {1, 3} and (picks == 1).sum() == 500
    assert inverse_cdf(torch.tensor([0.0, 2.0, 2.0]), torch.tensor(0.5)).item() == 2  # unnormalised mass
    # u just under 1, where u * total rounds to the total: the last token with mass, not the zero-mass tail
    assert inverse_cdf(torch.tensor([0.3, 0.7, 0.0, 0.0]), torch.tensor(1 - 2 ** -24)).item() == 1


def test_the_batched_sampler_never_waits_for_the_device() -> None:
    """No host read and no data-dependent op between its inputs and its outputs (dsde_core/syncs.py): on a GPU the
    verdicts of a step stay on the device until the step's one copy back."""
    args = _packed(_batch(0))
    with SyncCounter() as c:
        verify_batch(*args)
    assert c.total == 0, c.syncs
    with SyncCounter() as c:  # the counter sees what it must
        verify_batch(*args)[1].tolist()
        args[0][args[0] > 0.5].sum()
    assert c.syncs == {"tolist": 1, "bool-index": 1}, c.syncs
