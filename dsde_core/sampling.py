"""Sampling: the sampling filters and the draft's sparse top-K distribution (the per-request logits processors:
dsde_core/processors.py; verification: dsde_core/verify.py).

Shapes: V = vocabulary, K = draft top-K (what crosses from draft to target), k = draft tokens this step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dsde_core.config import SamplingParams
from dsde_core.packet import Packet, Part


def signal_temperature(params: SamplingParams) -> float:
    """Temperature of the distributions the KLD signal compares: the sampling one, 1 for greedy requests."""
    return params.temperature if params.temperature > 0 else 1.0


def make_generator(seed: int | None, stream: int, device: str = "cpu", emitted: int = 0) -> torch.Generator:
    """A per-request generator; draft and target draw from different streams of the same seed. A slot opened again
    after the request emitted tokens (a worker restarted or raised) starts a stream of its own: from the seed's first,
    the draws after the restart would repeat the first steps' random numbers and tie the later tokens to the first."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    elif emitted == 0:
        gen.manual_seed((seed * 1_000_003 + stream) % (1 << 63))
    else:
        gen.manual_seed(hash((seed, stream, emitted)) % (1 << 63))
    return gen


def batch_probs(logits: torch.Tensor, temperature: Sequence[float] | torch.Tensor, top_k: Sequence[int] | torch.Tensor,
                top_p: Sequence[float] | torch.Tensor, min_p: Sequence[float] | torch.Tensor,
                filtered: bool | None = None) -> torch.Tensor:
    """The target's sampling distribution p at N positions at once, each with its request's parameters: logits [N, V]
    fp32 and the parameters per position (temperature > 0; top_k 0, top_p 1 and min_p 0 filter nothing), host
    values or [N] tensors on the logits' device (a step's packet) -> probs [N, V]. The filters as dense ops on one
    descending sort: z = logits / T; top-k keeps z >= the k-th largest; top-p drops a token once the mass before it in
    the sorted order reaches top_p; min-p drops z < z_max + log(min_p). Where no position filters (known on the host:
    `filtered`, else read off host values by `filters`), no sort: softmax(z)."""
    dev, v = logits.device, logits.shape[-1]
    t, k, top_p_t, min_p_t = (torch.as_tensor(x, dtype=d, device=dev)
                              for x, d in ((temperature, logits.dtype), (top_k, torch.long), (top_p, logits.dtype),
                                           (min_p, logits.dtype)))  # [N] each
    z = logits / t[:, None]  # [N, V]
    if not (filters(top_k, top_p, min_p, v) if filtered is None else filtered):
        return torch.softmax(z, dim=-1)
    ranked, order = torch.sort(z, dim=-1, descending=True)  # [N, V]
    k = torch.where((k > 0) & (k < v), k, v)  # [N]: 0 keeps all
    ranked = ranked.masked_fill(ranked < ranked.gather(-1, (k - 1)[:, None]), float("-inf"))  # top-k
    probs = torch.softmax(ranked, dim=-1)
    top_p_t, min_p_t = top_p_t[:, None], min_p_t[:, None]  # [N, 1] each
    drop = ((probs.cumsum(-1) - probs) >= top_p_t) & (top_p_t < 1.0)
    drop[:, 0] = False  # the first token always stays
    drop |= (ranked < ranked[:, :1] + torch.log(min_p_t.clamp(min=1e-30))) & (min_p_t > 0)
    return torch.zeros_like(z).scatter_(-1, order, torch.softmax(ranked.masked_fill(drop, float("-inf")), dim=-1))


def filters(top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float], v: int) -> bool:
    """Whether any position's top-k, top-p or min-p removes a token of a vocabulary of v (host values)."""
    return not all((k == 0 or k >= v) and p >= 1.0 and m == 0.0 for k, p, m in zip(top_k, top_p, min_p, strict=True))


def filter_inputs(params: Sequence[SamplingParams], v: int, pk: Packet) -> tuple[list[Part], bool]:
    """batch_probs' inputs for positions sampled with `params` over a vocabulary of v: their temperature, top_k, top_p
    and min_p into the packet ([S] each), and whether any position filters."""
    temp, top_k, top_p, min_p = ([getattr(p, f) for p in params] for f in ("temperature", "top_k", "top_p", "min_p"))
    return [pk.floats(temp), pk.ints(top_k), pk.floats(top_p), pk.floats(min_p)], filters(top_k, top_p, min_p, v)


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the target's own distribution (its logits at temperature 1, before
    top-k / top-p: what the model believes, whatever the request samples with), and the n likeliest tokens at its
    position, likeliest first. Speculation changes none of it: the target's logits at a verified position are those
    of the same prefix decoded target-only."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)


LOGPROB_ROWS = 256  # rows log-softmaxed at once: a prompt's [P, V] log-probabilities never exist whole


def token_logprobs(rows: torch.Tensor, tokens: list[int], n: int,
                   head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[TokenLogprob]:
    """rows [m, V] of logits at the positions that produced `tokens` (m >= len(tokens)) -> each token's log p and the
    top n. With `head`, rows are hidden states [m, D] and head makes their logits: a long prompt's [m, V] logits are
    never held whole, only LOGPROB_ROWS rows of them at a time."""
    out: list[TokenLogprob] = []
    for start in range(0, len(tokens), LOGPROB_ROWS):
        part = tokens[start : start + LOGPROB_ROWS]
        chunk = rows[start : start + len(part)]  # [t, V] or [t, D]
        lp = torch.log_softmax((chunk if head is None else head(chunk)).float(), dim=-1)  # [t, V]
        chosen = lp.gather(-1, torch.tensor(part, device=lp.device)[:, None])[:, 0].tolist()  # [t]
        if n == 0:
            out += [TokenLogprob(c) for c in chosen]
            continue
        top = lp.topk(n, dim=-1)  # [t, n]
        out += [TokenLogprob(c, tuple(zip(ids, vals, strict=True)))
                for c, ids, vals in zip(chosen, top.indices.tolist(), top.values.tolist(), strict=True)]
    return out


@dataclass
class DraftDist:
    """The draft's distribution at one position, sparse. ids [K]; both prob vectors [K] fp32."""

    ids: torch.Tensor  # [K] int64: the draft's top-K tokens by logit
    q_sample: torch.Tensor  # [K]: the distribution the draft sampled from (top-K-truncated, processed), sums to 1
    q_signal: torch.Tensor  # [K]: untruncated probabilities at the signal temperature (rest mass = 1 - sum)
    entropy: float  # nats, full draft distribution at the signal temperature (nan when not computed)


@dataclass
class DraftLevel:
    """The draft's distributions at one level for B rows at once: DraftDist's fields as [B, ...] tensors."""

    ids: torch.Tensor  # [B, K] int64
    q_sample: torch.Tensor  # [B, K]
    q_signal: torch.Tensor  # [B, K]
    entropy: torch.Tensor  # [B] (nan where not asked for)


@dataclass(frozen=True)
class DraftInputs:
    """What a draft level's distributions read on the device (draft_inputs), as parts of the level's packet."""

    t_sig: Part  # [B] the rows' signal temperatures
    unit: bool  # every row's signal temperature is 1 (no division)
    entropy: Part | None  # [B] whether a row asks for its entropy; None: no row does
    sampled: Part | None  # [S] the rows that sample (the rest are greedy); None: every row is greedy
    sampling: list[Part]  # the sampled rows' [temperature, top_k, top_p, min_p] [S] each
    filtered: bool  # a sampled row filters its K top logits


def draft_inputs(params: Sequence[SamplingParams], with_entropy: Sequence[bool], top_k: int,
                 pk: Packet) -> DraftInputs:
    """The host half of draft_dists: the rows' parameters into the packet (top_k: the K of the level's distributions,
    min(the worker's top-K, V))."""
    t_sig = [signal_temperature(p) for p in params]
    sampled = [r for r, p in enumerate(params) if not p.greedy]
    columns, filtered = filter_inputs([params[r] for r in sampled], top_k, pk)
    return DraftInputs(pk.floats(t_sig), all(x == 1.0 for x in t_sig),
                       pk.bools(list(with_entropy)) if any(with_entropy) else None,
                       pk.ints(sampled) if sampled else None, columns, filtered)


def draft_dists(logits: torch.Tensor, params: Sequence[SamplingParams], top_k: int,
                with_entropy: Sequence[bool]) -> DraftLevel:
    """logits [B, V] fp32 of one draft level, row r processed for params[r] -> the rows' sparse distributions
    (draft_inputs, then draft_level, with a packet of their own)."""
    pk = Packet()
    inputs = draft_inputs(params, with_entropy, min(top_k, logits.shape[-1]), pk)
    pk.send(logits.device)
    return draft_level(logits, inputs, pk, top_k)


def draft_level(logits: torch.Tensor, inputs: DraftInputs, pk: Packet, top_k: int) -> DraftLevel:
    """The device half of draft_dists. With T_r the signal temperature, z = logits / T_r and lse = logsumexp(z):
        ids, top = the K largest logits;  q_signal = exp(top / T_r - lse)  (untruncated: the rest holds 1 - sum)
        entropy H = -sum p log p = lse - sum softmax(z) z  (a second pass over V, only where a row asks for it)
        q_sample: one-hot on ids[0] for a greedy row; else the request's temperature, top-k, top-p and min-p over
        the K top logits (batch_probs), which is exactly what the draft samples from and ships to the verifier."""
    top, ids = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)  # [B, K]
    t = pk[inputs.t_sig].to(logits.dtype)[:, None]  # [B, 1]
    z = logits if inputs.unit else logits / t  # [B, V]
    lse = torch.logsumexp(z, dim=-1, keepdim=True)  # [B, 1]
    q_signal = (top / t - lse).exp()  # [B, K]
    entropy = torch.full((logits.shape[0],), float("nan"), device=logits.device)
    if inputs.entropy is not None:
        h = lse[:, 0] - (torch.softmax(z, dim=-1) * z).sum(-1)  # [B]
        entropy = torch.where(pk[inputs.entropy], h, entropy)
    q_sample = torch.zeros_like(top)
    q_sample[:, 0] = 1.0  # greedy rows: one-hot on the argmax
    if inputs.sampled is not None:
        sampled = pk[inputs.sampled]  # [S]
        probs = batch_probs(top.index_select(0, sampled), *(pk[x] for x in inputs.sampling),
                            filtered=inputs.filtered)  # [S, K]
        q_sample = q_sample.index_copy(0, sampled, probs)
    return DraftLevel(ids, q_sample, q_signal, entropy)


def draft_dist(logits: torch.Tensor, params: SamplingParams, top_k: int, with_entropy: bool = True) -> DraftDist:
    """logits [V] fp32 of one draft position -> its sparse distribution (draft_dists for one row)."""
    d = draft_dists(logits[None], [params], top_k, [with_entropy])
    return DraftDist(d.ids[0], d.q_sample[0], d.q_signal[0], float(d.entropy[0]))


def draft_uniforms(gens: Sequence[torch.Generator | None]) -> torch.Tensor:
    """[B]: a draft level's uniform of each row from its request's generator (host; 0 for a greedy row, None)."""
    return torch.cat([torch.zeros(1) if g is None else torch.rand(1, generator=g) for g in gens])


def sample_level(level: DraftLevel, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's draft token from exactly the distribution shipped to the verifier, by inverse CDF of q_sample with
    u [B] on the level's device (a greedy row's one-hot gives ids[0] for any u) -> (tokens [B] int64, their q_signal:
    the confidence [B])."""
    j = inverse_cdf(level.q_sample, u)[:, None]  # [B, 1]: index into the K ids
    return level.ids.gather(-1, j)[:, 0], level.q_signal.gather(-1, j)[:, 0]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [..., V] (non-negative, not necessarily normalised), u [...] in [0, 1) -> [...] int64: the first token
    whose cumulative mass exceeds u times the row's total, so never a token of zero mass (where u * total rounds up
    to the total, the last token with mass)."""
    cdf = probs.cumsum(-1)  # [..., V]
    target = (u.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)  # [..., 1]
    last = (probs > 0).cumsum(-1).argmax(-1)  # [...]: the first index of the highest count, the last with mass
    return torch.minimum(torch.searchsorted(cdf, target, right=True).squeeze(-1), last)
