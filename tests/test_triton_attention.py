"""The Triton decode/verify attention kernel (dsde_core/models/triton_attention.py) under Triton's interpreter on
the CPU (tests/conftest.py sets TRITON_INTERPRET=1), against attention written out with a mask: ragged query and
cache lengths, GQA, sliding windows, several KV splits, rows in any slot order; the split merge on its own; and a
runner whose decode and verify rows attend through it, against transformers."""

from __future__ import annotations

import pytest
import torch

from dsde_core.errors import ConfigError
from dsde_core.models.runner import ALONE_Q
from dsde_core.models.triton_attention import decode_attention, merge
from tests.test_runner import Checked, rand_tokens


def oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: list[int], lens: list[int],
           qlens: list[int], window: int | None) -> torch.Tensor:
    """Row by row: query i of row r at position L - q + i over keys j <= pos (and j > pos - window), fp64."""
    rows, qmax, h, hd = q.shape
    g = h // k_cache.shape[1]
    out = torch.zeros(rows, qmax, h, hd, dtype=torch.float64)
    for r, (slot, length, ql) in enumerate(zip(slots, lens, qlens, strict=True)):
        keys = k_cache[slot, :, :length].double().repeat_interleave(g, 0)  # [h, L, hd]
        vals = v_cache[slot, :, :length].double().repeat_interleave(g, 0)
        pos = torch.arange(length - ql, length)[:, None]  # [q, 1]
        j = torch.arange(length)[None, :]  # [1, L]
        seen = (j <= pos) & ((j > pos - window) if window else True)  # [q, L]
        s = torch.einsum("qhd,hkd->hqk", q[r, :ql].double(), keys) * hd ** -0.5
        s = s.masked_fill(~seen, float("-inf"))
        out[r, :ql] = torch.einsum("hqk,hkd->qhd", torch.softmax(s, -1), vals)
    return out


CASES = [  # (heads, kv heads, head dim, query lengths, cache lengths, window, splits)
    (4, 2, 16, [1, 1, 1], [5, 40, 77], None, 1),  # decode, GQA 2
    (4, 2, 16, [5, 3, 1, 5], [9, 64, 33, 5], None, 2),  # verify 1 + k, ragged; a cache no longer than its queries
    (4, 4, 32, [2, 4], [70, 100], 24, 1),  # a sliding window shorter than the context
    (6, 2, 16, [5, 5], [130, 96], None, 4),  # GQA 3 (queries pad to the block), keys over four splits
    (4, 1, 16, [3], [200], 50, 3),  # one KV head for all, a window, splits the window leaves empty
]


@pytest.mark.parametrize("h, kvh, hd, qlens, lens, window, splits", CASES)
def test_the_kernel_equals_masked_attention(h, kvh, hd, qlens, lens, window, splits) -> None:
    gen = torch.Generator().manual_seed(sum(lens))
    num_slots, max_len, qmax = len(lens) + 2, 256, max(qlens)
    k_cache = torch.randn(num_slots, kvh, max_len, hd, generator=gen)
    v_cache = torch.randn(num_slots, kvh, max_len, hd, generator=gen)
    q = torch.randn(len(lens), qmax, h, hd, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[: len(lens)].tolist()  # rows in any slot order
    out = decode_attention(q, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32),
                           torch.tensor(lens, dtype=torch.int32), torch.tensor(qlens, dtype=torch.int32),
                           window=window, splits=splits, block_n=16)
    expected = oracle(q, k_cache, v_cache, slots, lens, qlens, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_merge_of_splits_equals_one_softmax() -> None:
    """Scores cut into three splits, one of them empty for a query: merging the partials is the softmax of all."""
    gen = torch.Generator().manual_seed(3)
    s, v = torch.randn(2, 12, generator=gen), torch.randn(12, 4, generator=gen)  # [BQ, N] scores, [N, D] values
    s[1, 8:] = float("-inf")  # query 1 sees nothing in the last split
    parts = [s[:, a:b] for a, b in ((0, 4), (4, 8), (8, 12))]
    m = torch.stack([p.amax(-1) for p in parts])  # [S, BQ]
    safe = torch.where(torch.isfinite(m), m, 0.0)
    e = [torch.exp(p - safe[i][:, None]) for i, p in enumerate(parts)]
    lse_sum = torch.stack([x.sum(-1) for x in e])
    acc = torch.stack([x @ v[a:b] for x, (a, b) in zip(e, ((0, 4), (4, 8), (8, 12)), strict=True)])
    torch.testing.assert_close(merge(m, lse_sum, acc), torch.softmax(s, -1) @ v)


def test_a_runner_attending_through_the_kernel_equals_transformers(arch: str, make_tiny_model) -> None:
    """Every forward checked against transformers (test_runner.Checked): ragged prefills (the torch path), then
    decode and verify rows mixed (the kernel), a rollback, a long prompt beside decoding rows (it attends alone, on
    torch), and contexts past the sliding windows (qwen2: 6 on layer 1, mistral: 8)."""
    g = torch.Generator().manual_seed(5)
    c = Checked(make_tiny_model(arch), max_seq_len=160, attention="triton")
    assert c.runner.kernel
    c.forward({0: rand_tokens(g, 11), 1: rand_tokens(g, 3), 2: rand_tokens(g, 17)})
    c.forward({3: rand_tokens(g, 2), 0: rand_tokens(g, 1), 2: rand_tokens(g, 5)}, num_logits=[2, 1, 5])
    c.rollback(2, 19)
    c.forward({2: rand_tokens(g, 4), 1: rand_tokens(g, 1)})
    c.forward({3: rand_tokens(g, ALONE_Q + 3), 0: rand_tokens(g, 1), 1: rand_tokens(g, 3)}, num_logits=[1, 1, 3])
    for _ in range(2):
        c.forward({s: rand_tokens(g, 1 + s % 3) for s in range(4)})


def test_an_unknown_attention_is_a_config_error(make_tiny_model) -> None:
    with pytest.raises(ConfigError, match="attention must be torch or triton"):
        Checked(make_tiny_model("llama"), attention="flash")
