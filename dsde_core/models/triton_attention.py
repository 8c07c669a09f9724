"""Decode and verify attention over the slot KV cache as one Triton kernel that reads the lengths at run time.

Rows of a step (sequences) each have q_r query tokens (1 when decoding, 1 + k when verifying k drafted tokens) whose
keys the cache already holds: row r's cache has L_r positions, its query i sits at position L_r - q_r + i and
attends the keys j with
    j <= pos,   and   j > pos - window   (a sliding-window layer; window 0: none).
A program takes one row x one KV head x one split of the row's keys (flash-decoding): it loads the row's q_r x G
queries of the G = h / kvh query heads that share the KV head as one [Q*G, hd] block, so a key is read once for all
of them, and streams its split's keys in blocks with an online softmax; it writes a partial (max m, sum l, acc) per
query. `merge` combines the splits: with M = max_s m_s and w_s = exp(m_s - M),
    out = sum_s w_s acc_s / sum_s w_s l_s.
Nothing in it depends on the lengths' values at launch (they are tensors read by the kernel), so a captured CUDA
graph replays it for any lengths. The torch path (llama.py: gather, mask, SDPA) is the CPU path and this kernel's
oracle: tests run the kernel under Triton's interpreter (TRITON_INTERPRET=1) against it.
"""

from __future__ import annotations

import math

import torch

try:  # Triton ships with CUDA builds of torch; on a CPU machine it is the test extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


def available() -> bool:
    """Whether Triton is importable (the kernel runs on CUDA, or anywhere under TRITON_INTERPRET=1)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, qlens_ptr, m_ptr, l_ptr, acc_ptr,
                      sq_r, sq_i, sq_h, sk_s, sk_h, sk_t, part_stride, scale, window, split_len,
                      G: tl.constexpr, HD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr):
        r, kv, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        length = tl.load(lens_ptr + r)
        qlen = tl.load(qlens_ptr + r)
        offs_m = tl.arange(0, BLOCK_Q)  # [BQ]: query token offs_m // G of head kv * G + offs_m % G
        qi, head = offs_m // G, kv * G + offs_m % G
        offs_d = tl.arange(0, BLOCK_D)
        m_ok, d_ok = qi < qlen, offs_d < HD
        q = tl.load(q_ptr + r * sq_r + qi[:, None] * sq_i + head[:, None] * sq_h + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BQ, BD]
        qpos = length - qlen + qi  # [BQ]
        start = sp * split_len
        if window > 0:  # keys below the first query's window are masked for every query: skip them
            start = tl.maximum(start, (length - qlen - window + 1) // BLOCK_N * BLOCK_N)
        end = tl.minimum(sp * split_len + split_len, length)
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
        base = slot * sk_s + kv * sk_h
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN]
            kv_ok = (offs_n < end)[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + base + offs_n[:, None] * sk_t + offs_d[None, :], mask=kv_ok, other=0.0)  # [BN, BD]
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [BQ, BN]
            seen = (offs_n[None, :] <= qpos[:, None]) & (offs_n[None, :] < end) & m_ok[:, None]
            if window > 0:
                seen = seen & (offs_n[None, :] > qpos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BQ]
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that has seen no key yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])  # [BQ, BN]
            v = tl.load(v_ptr + base + offs_n[:, None] * sk_t + offs_d[None, :], mask=kv_ok, other=0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        part = (r * tl.num_programs(1) + kv) * tl.num_programs(2) + sp
        tl.store(m_ptr + part * part_stride + offs_m, m_i)
        tl.store(l_ptr + part * part_stride + offs_m, l_i)
        tl.store(acc_ptr + (part * part_stride + offs_m[:, None]) * BLOCK_D + offs_d[None, :], acc)


def merge(m: torch.Tensor, lse_sum: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Partials of S splits -> the attention output: m, lse_sum [..., S, BQ], acc [..., S, BQ, D] -> [..., BQ, D]
    (the module doc's merge; a query no split saw comes out 0)."""
    top = m.amax(-2, keepdim=True)  # [..., 1, BQ]
    w = torch.where(torch.isfinite(m), torch.exp(m - torch.where(torch.isfinite(top), top, 0.0)), 0.0)  # [..., S, BQ]
    den = (w * lse_sum).sum(-2)  # [..., BQ]
    return (w[..., None] * acc).sum(-3) / torch.where(den > 0, den, 1.0)[..., None]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lens: torch.Tensor, qlens: torch.Tensor, window: int | None = None, scale: float | None = None,
                     splits: int = 1, block_n: int = 32) -> torch.Tensor:
    """q [R, Qmax, h, hd] (row r's first qlens[r] query tokens real), k_cache/v_cache [S, kvh, T, hd] (one layer),
    slots, lens, qlens [R] int32 on q's device (lens: the cache's length with this step's keys) -> [R, Qmax, h, hd];
    rows past qlens[r] come out 0. `splits` divides each row's keys among that many programs."""
    if triton is None:
        raise RuntimeError("decode_attention needs Triton (pip install triton)")
    rows, qmax, h, hd = q.shape
    kvh, max_len = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    block_q, block_d = max(16, triton.next_power_of_2(qmax * g)), max(16, triton.next_power_of_2(hd))
    split_len = math.ceil(max_len / splits / block_n) * block_n  # keys a split covers, whole blocks
    q = q.contiguous()
    m = torch.empty(rows, kvh, splits, block_q, device=q.device, dtype=torch.float32)
    lse_sum = torch.empty_like(m)
    acc = torch.empty(rows, kvh, splits, block_q, block_d, device=q.device, dtype=torch.float32)
    _split_kernel[(rows, kvh, splits)](
        q, k_cache, v_cache, slots, lens, qlens, m, lse_sum, acc,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_q,
        hd ** -0.5 if scale is None else scale, window or 0, split_len,
        G=g, HD=hd, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d)
    out = merge(m, lse_sum, acc)[..., : qmax * g, :hd]  # [R, kvh, Qmax * G, hd]: query i, head kv * G + j at i * G + j
    return out.view(rows, kvh, qmax, g, hd).permute(0, 2, 1, 3, 4).reshape(rows, qmax, h, hd).to(q.dtype)
