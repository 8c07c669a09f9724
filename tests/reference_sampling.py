"""The per-row definition of the target's sampling distribution, which the tests hold sampling.batch_probs (the
batched one the engine runs, target and draft alike) to, one position at a time."""

from __future__ import annotations

import math

import torch

from dsde_core.config import SamplingParams


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
