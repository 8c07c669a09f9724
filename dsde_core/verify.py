"""Verification of a whole step as batched tensor code: one rejection sampler over every row of the batch, on the
device its tensors live on (Leviathan et al. 2023; Chen et al. 2023; as vLLM's rejection sampler).

Terms, for row r of R, with k_r <= k drafted tokens (k the batch's most):
- x[r, j], j < k_r: the drafted tokens (columns from k_r on are padding and never accepted);
- p[r, j]: the target's sampling distribution at position j (its processed logits at the request's temperature,
  filtered): position j judges x[r, j], position k_r is the bonus;
- q[r, j]: the draft's sparse distribution that x[r, j] was drawn from: ids [K] and probabilities [K];
- u[r, j], j < k_r: the acceptance uniforms; u[r, k]: the emission uniform (the last column for every row). They
  are drawn on the host from each request's own generator (`draw_uniforms`), so that a seed draws the same tokens on
  any device and in any batch.
Sampled rows accept x[r, j] when u[r, j] * q_j(x) < p_j(x) (u < p / q without dividing by a q that may be tiny) and
every token before it was accepted; a_r counts the accepted tokens. At position a_r the row emits, by inverse CDF
with u[r, k], a sample of norm(max(0, p - q)) after a rejection (a_r < k_r), or of p itself as the bonus
(a_r = k_r); the emitted tokens are then distributed exactly as target-only sampling from p. Greedy rows are the
same sampler with p one-hot on the argmax: accept while x equals it, emit it at a_r (no uniform is read).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsde_core.sampling import inverse_cdf


def draw_uniforms(gen: torch.Generator, k: int) -> torch.Tensor:
    """A sampled row's k + 1 uniforms in [0, 1) for one step of k drafted tokens: k to accept by, one to emit by."""
    return torch.rand(k + 1, generator=gen)


def verify_batch(target: torch.Tensor, offsets: torch.Tensor, greedy: torch.Tensor, drafts: torch.Tensor,
                 num_drafts: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor, u: torch.Tensor,
                 all_greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's verdicts for every row at once (the module doc's terms; no host synchronisation inside).

    target [N, V]: the rows' positions packed, row r's k_r + 1 at offsets[r] [R] on: p for a sampled row; a greedy
    row may hold its processed logits instead (only its argmax is read). Packed, not padded, so that a batch of
    ragged k costs what its positions do. greedy [R] bool; drafts [R, k] int64 (any value past a row's k_r);
    num_drafts [R] int64 = k_r; q_ids, q_probs [R, k, K]: the draft's sparse distributions; u [R, k + 1] (read for
    sampled rows only). all_greedy: every row is greedy, as the caller knows on the host: the sampled rows' passes
    over V are skipped. Returns (tokens [R, k + 1] int64, accepted [R] int64): row r emits tokens[r, : accepted[r]
    + 1].
    """
    k = drafts.shape[1]
    col = torch.arange(k, device=target.device)  # [k]
    valid = col[None, :] < num_drafts[:, None]  # [R, k]
    at = (offsets[:, None] + col[None, :]).clamp(max=target.shape[0] - 1)  # [R, k]: position j of row r
    top = target.argmax(-1)  # [N]
    # q_j(x_j) and p_j(x_j): the draft's and the target's mass on each drafted token
    q_x = (q_probs * (q_ids == drafts[..., None])).sum(-1)  # [R, k]
    p_x = target[at, drafts]  # [R, k]
    ok = torch.where(greedy[:, None], drafts == top[at], u[:, :k] * q_x < p_x) & valid  # [R, k]
    accepted = ok.long().cumprod(-1).sum(-1)  # [R]: a_r, the length of the accepted prefix
    emit_at = offsets + accepted  # [R]: the emitting position's row in target
    emitted = top[emit_at] if all_greedy else torch.where(
        greedy, top[emit_at], _sample_at(target[emit_at], accepted, num_drafts, q_ids, q_probs, u[:, k]))  # [R]
    tokens = torch.where(col[None, :] < accepted[:, None], drafts, 0)  # [R, k]
    tokens = torch.cat([tokens, torch.zeros_like(emitted)[:, None]], -1)  # [R, k + 1]
    tokens.scatter_(-1, accepted[:, None], emitted[:, None])
    return tokens, accepted


def _sample_at(p_a: torch.Tensor, accepted: torch.Tensor, num_drafts: torch.Tensor, q_ids: torch.Tensor,
               q_probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R]: each sampled row's token at its emitting position a_r, whose p is p_a [R, V], by inverse CDF with u [R]:
    of the residual norm(max(0, p - q)) after a rejection, of p itself for the bonus."""
    rows, k = p_a.shape[0], q_ids.shape[1]
    if k == 0:  # no row drafted: every row takes its bonus
        return inverse_cdf(p_a, u)
    at = torch.arange(rows, device=p_a.device)  # [R]
    j = accepted.clamp(max=k - 1)  # [R]: the rejected position (clamped for rows that take the bonus)
    rejected = (accepted < num_drafts).to(p_a.dtype)[:, None]  # [R, 1]
    q_dense = torch.zeros_like(p_a).scatter_add_(-1, q_ids[at, j], q_probs[at, j].to(p_a.dtype))  # [R, V]
    residual = (p_a - rejected * q_dense).clamp_(min=0.0)  # [R, V]
    # the residual is empty only where p = q on the support, where a rejection has probability 0: then sample p
    return inverse_cdf(torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a), u)


def pack_drafts(drafts: Sequence[Sequence[int]], ids: Sequence[torch.Tensor | None],
                *probs: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """Rows of drafted tokens, their sparse distributions' ids [k_r, K_r] and any number of probability tables over
    those ids [k_r, K_r] (None for k_r = 0) -> the padded (drafts [R, k], num_drafts [R], q_ids [R, k, K], *probs
    [R, k, K]) that verify_batch takes, k = max k_r, K = max K_r; padding has id 0 and probability 0."""
    rows, k = len(drafts), max((len(d) for d in drafts), default=0)
    top_k = max((i.shape[-1] for i in ids if i is not None), default=1)
    out_drafts = torch.zeros(rows, k, dtype=torch.long)
    q_ids = torch.zeros(rows, k, top_k, dtype=torch.long)
    tables = [torch.zeros(rows, k, top_k) for _ in probs]
    for r, d in enumerate(drafts):
        if d:
            out_drafts[r, : len(d)] = torch.tensor(list(d))
            q_ids[r, : len(d), : ids[r].shape[-1]] = ids[r]
            for table, p in zip(tables, probs, strict=True):
                table[r, : len(d), : p[r].shape[-1]] = p[r]
    return (out_drafts, torch.tensor([len(d) for d in drafts]), q_ids, *tables)
