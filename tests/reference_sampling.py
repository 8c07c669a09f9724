"""The per-row definitions the tests hold the batched code the engine runs to, one row at a time: the target's
sampling distribution (sampling.batch_probs, target and draft alike) and the per-request logits processors (stop
tokens held, logit bias, penalties: processors.process)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsde_core.config import SamplingParams
from dsde_core.processors import HELD


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
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


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution p: logits [n, V] fp32 -> probs [n, V] (temperature > 0 only)."""
    assert params.temperature > 0, "greedy requests are verified on the argmax"
    return torch.softmax(filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p), dim=-1)


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


def process_row(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                drafts: Sequence[int], first: int = 0) -> torch.Tensor:
    """logits [n, V] of one request, row j after prompt + output + drafts[:first + j] -> what it samples from: stop
    tokens held under min_tokens, its logit bias, then its penalties (vLLM's order)."""
    logits = add_bias(hold_stops(logits, params, len(output) + first), params)
    return penalize(logits, History.of(prompt, output), drafts, params, first)
