"""Slot-based KV cache: each sequence owns a slot and a length; rollback is setting the length back."""

from __future__ import annotations

import torch

from dsde_core.errors import ConfigError


class KVCache:
    """k, v: [num_layers, num_slots, num_kv_heads, max_seq_len, head_dim].

    Head-major per slot, so that one sequence's keys [kvh, 0:n, hd] are a strided view SDPA reads directly.
    Lengths live on the host (Python ints): positions [length(slot), ...) hold stale data and are overwritten.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        if num_slots < 1 or max_seq_len < 1:
            raise ConfigError(f"KVCache needs num_slots >= 1 and max_seq_len >= 1, got {num_slots}, {max_seq_len}")
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.lengths = [0] * num_slots

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ConfigError(f"slot {slot} out of range [0, {self.num_slots})")

    def length(self, slot: int) -> int:
        self._check_slot(slot)
        return self.lengths[slot]

    def set_length(self, slot: int, n: int) -> None:
        """Roll slot back to its first n tokens (0 <= n <= current length)."""
        self._check_slot(slot)
        if not 0 <= n <= self.lengths[slot]:
            raise ConfigError(
                f"set_length(slot={slot}, n={n}): n must be in [0, {self.lengths[slot]}] (the current length)"
            )
        self.lengths[slot] = n

    def reset(self, slot: int) -> None:
        self._check_slot(slot)
        self.lengths[slot] = 0

    def check_room(self, slot: int, n: int) -> None:
        """ConfigError when appending n tokens to slot would exceed max_seq_len."""
        self._check_slot(slot)
        if self.lengths[slot] + n > self.max_seq_len:
            raise ConfigError(
                f"slot {slot}: {self.lengths[slot]} cached + {n} new tokens = {self.lengths[slot] + n} "
                f"exceeds max_seq_len {self.max_seq_len}"
            )
