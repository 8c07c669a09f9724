"""Weight-only int8 for the draft model: half the bytes of bf16 read per decode step.

Batch-1 decode on a CPU is bound by memory bandwidth, so a draft whose weights are half the size runs
close to twice as fast. Only the draft is ever quantized: its distribution is whatever it is, and the
rejection sampler (or the greedy argmax check) makes the output the target's all the same. The target
stays exact.

Per output channel, symmetric: w[n, :] ~= scale[n] * q[n, :], q int8 in [-127, 127],
scale[n] = max|w[n, :]| / 127. Rows above `max_rows` (prefill, large batches) are compute-bound, where
the int8 kernel is slower than oneDNN's bf16 GEMM: they go through the bf16 layer kept beside it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

INT8_MAX_ROWS = 2  # up to this many rows per call: the int8 GEMV path; above: the bf16 fallback


def quantize_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] float -> (q [N, K] int8, scale [N] float32) with w ~= scale[:, None] * q."""
    scale = w.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_supported(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """y = x @ (scale * q).T + b for few rows; larger inputs use `fallback` (the unquantized layer)."""

    def __init__(self, lin: nn.Linear, fallback: nn.Module, max_rows: int = INT8_MAX_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        q, scale = quantize_per_channel(lin.weight.detach())
        self.q = q  # [N, K] int8
        self.scale = scale.to(lin.weight.dtype)  # [N], in the activation dtype the kernel expects
        self.bias = None if lin.bias is None else lin.bias.detach()
        self.fallback = fallback
        self.max_rows = max_rows

    def forward(self, x: Tensor) -> Tensor:  # x [M, K]
        if x.shape[0] > self.max_rows:
            return self.fallback(x)
        y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)  # [M, N]
        return y if self.bias is None else y + self.bias
