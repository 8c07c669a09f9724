"""Sampling: logits processors and the draft's sparse top-K distribution (verification: dsde_core/verify.py).

Shapes: V = vocabulary, K = draft top-K (what crosses from draft to target), k = draft tokens this step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dsde_core.config import SamplingParams


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


HELD = -1e9  # the logit of a token held off (min_tokens): finite, so 0 * logit stays 0 in an entropy


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """logits [..., N] -> logits with -inf outside the top-k, outside the smallest top-p nucleus, and where
    p_t < min_p * p_max, i.e. z_t < z_max + log(min_p) (free of the normalisation: the same over the draft's top-K)."""
    n = logits.shape[-1]
    if top_k and top_k < n:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the first token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[..., 0] = False  # also when top_p rounds to 0 in the logits' dtype (a top_p of 1e-300)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        logits = logits.masked_fill(logits < logits.max(-1, keepdim=True).values + math.log(min_p), float("-inf"))
    return logits


def add_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> logits [n, V] + the request's logit_bias (OpenAI's: l_t <- l_t + b_t at every position)."""
    if not params.logit_bias:
        return logits
    ids = torch.tensor([i for i, _ in params.logit_bias], device=logits.device)  # [b]
    out = logits.clone()
    out[:, ids] += torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=out.device)
    return out


def hold_stops(logits: torch.Tensor, params: SamplingParams, produced: int) -> torch.Tensor:
    """logits [n, V], row j after `produced` + j output tokens -> the rows under min_tokens with the request's stop
    token ids (the engine adds the end-of-sequence ids) at HELD, so they cannot end the request early."""
    rows = min(logits.shape[0], params.min_tokens - produced)
    if rows <= 0 or not params.stop_token_ids:
        return logits
    out = logits.clone()
    out[:rows, list(params.stop_token_ids)] = HELD
    return out


@dataclass(frozen=True)
class History:
    """What penalties count before a step's drafts: every distinct token of the prompt and the output, sorted, and how
    many times the output holds each (0 for a token only the prompt holds)."""

    ids: torch.Tensor  # [m] int64
    counts: torch.Tensor  # [m] fp32

    @classmethod
    def of(cls, prompt: Sequence[int], output: Sequence[int]) -> History:
        ids = torch.tensor([*prompt, *output], dtype=torch.long).unique()  # [m], sorted
        out_ids, out_counts = torch.tensor(list(output), dtype=torch.long).unique(return_counts=True)  # [u]
        counts = torch.zeros(len(ids))
        counts[torch.searchsorted(ids, out_ids)] = out_counts.float()
        return cls(ids, counts)


def penalize(logits: torch.Tensor, history: History, drafts: Sequence[int], params: SamplingParams,
             first: int = 0) -> torch.Tensor:
    """logits [n, V] at n consecutive positions, row j after the history and drafts[:first + j] -> penalized [n, V].

    With c_t the number of times token t occurs in the output so far (drafts included), in this order:
        repetition (CTRL; as transformers and vLLM), each t in prompt or output:  l_t <- l_t / r if l_t > 0 else l_t * r
        frequency and presence (OpenAI's):  l_t <- l_t - c_t * frequency_penalty - [c_t > 0] * presence_penalty
    A verified row is penalized for exactly the output target-only decoding has at its position (the drafts before it
    accepted), so a step stays lossless. Only the logits of tokens seen change; `logits` is kept (a new tensor).
    """
    if not params.penalized:
        return logits
    r, freq, pres = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    n = logits.shape[0]
    d = torch.tensor(list(drafts[: first + n - 1]), dtype=torch.long)  # [e]: every draft some row follows
    new = d[~torch.isin(d, history.ids)].unique()  # drafted tokens the history lacks
    ids = torch.cat([history.ids, new])  # [m]: the only columns that change
    before = (torch.arange(len(d) + 1)[:, None] > torch.arange(len(d))[None, :]).float()  # [e+1, e]: i sees d[:i]
    in_drafts = before @ (d[:, None] == ids[None, :]).float()  # [e+1, m]: count of each id in drafts[:i]
    c = torch.cat([history.counts, torch.zeros(len(new))]) + in_drafts[first : first + n]  # [n, m]
    seen = (torch.arange(len(ids)) < len(history.ids)) | (c > 0)  # [n, m]: in the prompt, the output or the drafts
    cols = logits[:, ids].float()  # [n, m]
    if r != 1.0:
        cols = torch.where(seen, torch.where(cols > 0, cols / r, cols * r), cols)
    cols = cols - freq * c - pres * (c > 0).float()
    out = logits.clone()
    out[:, ids] = cols.to(out.dtype)
    return out


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution p: logits [n, V] fp32 -> probs [n, V] (temperature > 0 only). One row's
    definition of what batch_probs computes for a batch (the verifier's path; tests hold the two equal)."""
    assert params.temperature > 0, "greedy requests are verified on the argmax"
    return torch.softmax(_filter(logits / params.temperature, params.top_k, params.top_p, params.min_p), dim=-1)


def batch_probs(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
                min_p: Sequence[float]) -> torch.Tensor:
    """target_probs for N positions at once, each with its request's parameters: logits [N, V] fp32 and the
    parameters per position, host values (temperature > 0; top_k 0, top_p 1 and min_p 0 filter nothing) -> probs
    [N, V]. _filter's filters as dense ops on one descending sort: z = logits / T; top-k keeps z >= the k-th largest;
    top-p drops a token once the mass before it in the sorted order reaches top_p; min-p drops z < z_max + log(min_p).
    Where no position filters (known on the host), no sort: softmax(z)."""
    dev, v = logits.device, logits.shape[-1]
    z = logits / torch.tensor(temperature, dtype=logits.dtype, device=dev)[:, None]  # [N, V]
    if all((k == 0 or k >= v) and p >= 1.0 and m == 0.0 for k, p, m in zip(top_k, top_p, min_p, strict=True)):
        return torch.softmax(z, dim=-1)
    ranked, order = torch.sort(z, dim=-1, descending=True)  # [N, V]
    k = torch.tensor([x if 0 < x < v else v for x in top_k], device=dev)  # [N]
    ranked = ranked.masked_fill(ranked < ranked.gather(-1, (k - 1)[:, None]), float("-inf"))  # top-k
    probs = torch.softmax(ranked, dim=-1)
    top_p_t = torch.tensor(top_p, dtype=probs.dtype, device=dev)[:, None]  # [N, 1]
    drop = ((probs.cumsum(-1) - probs) >= top_p_t) & (top_p_t < 1.0)
    drop[:, 0] = False  # the first token always stays
    min_p_t = torch.tensor(min_p, dtype=z.dtype, device=dev)[:, None]  # [N, 1]
    drop |= (ranked < ranked[:, :1] + torch.log(min_p_t.clamp(min=1e-30))) & (min_p_t > 0)
    return torch.zeros_like(z).scatter_(-1, order, torch.softmax(ranked.masked_fill(drop, float("-inf")), dim=-1))


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


def draft_dist(logits: torch.Tensor, params: SamplingParams, top_k: int, with_entropy: bool = True) -> DraftDist:
    """logits [V] fp32 of one draft position -> its sparse distribution (what crosses to the target).
    One logsumexp pass over V gives q_signal; the entropy (a second pass) only when asked for."""
    t_sig = signal_temperature(params)
    top_logits, ids = torch.topk(logits, min(top_k, logits.shape[-1]))  # [K]
    z = logits if t_sig == 1.0 else logits / t_sig  # [V]
    lse = torch.logsumexp(z, dim=-1)
    q_signal = (top_logits / t_sig - lse).exp()  # [K], untruncated: the rest bin holds 1 - sum
    # H = -sum p log p = lse - sum p z, with p = softmax(z)
    entropy = float(lse - torch.dot(torch.softmax(z, dim=-1), z)) if with_entropy else float("nan")
    if params.greedy:
        q_sample = torch.zeros_like(top_logits)
        q_sample[0] = 1.0  # greedy draft: one-hot on its argmax
    else:
        filtered = _filter(top_logits / params.temperature, params.top_k, params.top_p, params.min_p)
        q_sample = torch.softmax(filtered, dim=-1)
    return DraftDist(ids, q_sample, q_signal, entropy)


def sample_draft(dist: DraftDist, gen: torch.Generator) -> int:
    """Draw the draft token from exactly the distribution that is shipped to the verifier."""
    j = torch.multinomial(dist.q_sample, 1, generator=gen).item()
    return int(dist.ids[j])
