"""ModelRunner: one batched forward over ragged per-sequence query lengths, on a slot-based KV cache."""

from __future__ import annotations

import torch

from dsde_core.errors import ConfigError
from dsde_core.models.kv_cache import KVCache
from dsde_core.models.llama import Batch, LlamaModel


class ModelRunner:
    """Prefill, single-token decode and multi-token verification, mixed freely in one `forward` call."""

    def __init__(self, model: LlamaModel, num_slots: int, max_seq_len: int) -> None:
        a = model.args
        self.model = model
        self.vocab_size: int = a.vocab_size
        self.device = model.device
        self.cache = KVCache(a.num_layers, num_slots, max_seq_len, a.num_kv_heads, a.head_dim, model.dtype, self.device)
        self.cos, self.sin = model.rope_tables(max_seq_len)  # [max_seq_len, head_dim]
        self.windows = sorted(set(a.sliding_windows), key=lambda w: -1 if w is None else w)
        # one query a row (decode, draft levels) on the CPU in a half dtype: attention in fp32 (llama.py, Attention)
        self.upcast_single_query = self.device.type == "cpu" and model.dtype != torch.float32

    def length(self, slot: int) -> int:
        return self.cache.length(slot)

    def set_length(self, slot: int, n: int) -> None:
        self.cache.set_length(slot, n)

    def reset(self, slot: int) -> None:
        self.cache.reset(slot)

    @torch.inference_mode()
    def forward(self, slots: list[int], tokens: list[list[int]], num_logits: list[int],
                hidden: bool = False) -> torch.Tensor:
        """One batched forward over ragged per-sequence query lengths.

        tokens[i] (len >= 1) are appended to slot slots[i] at positions cache.length(slot).. ; lengths advance.
        Returns float32 logits packed [sum(num_logits), vocab]: for each sequence, the logits of its LAST
        num_logits[i] query positions (1 <= num_logits[i] <= len(tokens[i])), in order of `slots`. With `hidden`:
        the final-norm hidden states there instead, [sum(num_logits), D], for `head` to make logits of in parts.
        """
        b = self._prepare(slots, tokens, num_logits)
        out = self.model(b, self.cache.k, self.cache.v, hidden=hidden)
        for s, t in zip(slots, tokens, strict=True):
            self.cache.lengths[s] += len(t)
        return out

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, D] from forward(hidden=True) -> float32 logits [N, vocab]."""
        return self.model.head(h)

    def _prepare(self, slots: list[int], tokens: list[list[int]], num_logits: list[int]) -> Batch:
        B = len(slots)
        if B == 0 or len(tokens) != B or len(num_logits) != B:
            raise ConfigError(
                f"forward needs one token list and one num_logits per slot and at least one slot: "
                f"got {B} slots, {len(tokens)} token lists, {len(num_logits)} num_logits"
            )
        if len(set(slots)) != B:
            raise ConfigError(f"forward got a slot twice: {slots}")
        starts, qlens = [], []
        for s, t, n in zip(slots, tokens, num_logits, strict=True):
            q = len(t)
            if q < 1:
                raise ConfigError(f"slot {s}: empty token list")
            if not 1 <= n <= q:
                raise ConfigError(f"slot {s}: num_logits {n} must be in [1, {q}] (its query length)")
            self.cache.check_room(s, q)
            starts.append(self.cache.lengths[s])
            qlens.append(q)
        dev = self.device
        flat = tokens[0] if B == 1 else [x for t in tokens for x in t]
        ids = torch.tensor(flat, dtype=torch.long)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ConfigError(f"token ids must be in [0, {self.vocab_size}), got min {ids.min()} max {ids.max()}")
        ids = ids.to(dev, non_blocking=True)
        max_q, max_k = max(qlens), max(s + q for s, q in zip(starts, qlens, strict=True))

        if B == 1:
            start, q, n = starts[0], qlens[0], num_logits[0]
            cos, sin = self.cos[start : start + q], self.sin[start : start + q]
            qpos = torch.arange(start, start + q, device=dev)[None, :]  # [1, q]
            masks = {w: self._mask(qpos, max_k, w) for w in self.windows}
            return Batch(
                input_ids=ids,
                cos=cos[:, None],
                sin=sin[:, None],
                num_seqs=1,
                max_q=q,
                max_k=max_k,
                masks=masks,
                logits_idx=torch.arange(q - n, q, device=dev),
                single=(slots[0], start, q),
                upcast=q == 1 and self.upcast_single_query,
            )

        # packed offsets of each sequence's tokens
        offsets = [0] * B
        for i in range(1, B):
            offsets[i] = offsets[i - 1] + qlens[i - 1]
        qlens_t = torch.tensor(qlens)
        seq_of_tok = torch.repeat_interleave(torch.arange(B), qlens_t)  # [T]
        idx_in_seq = torch.arange(len(flat)) - torch.tensor(offsets)[seq_of_tok]  # [T]
        write_pos = torch.tensor(starts)[seq_of_tok] + idx_in_seq  # [T]
        slots_t = torch.tensor(slots)
        uniform = all(q == max_q for q in qlens)
        q_dest = None if uniform else seq_of_tok * max_q + idx_in_seq
        # padded query positions [B, Qmax]; padding rows repeat the last real position so no row is fully masked
        j = torch.arange(max_q)[None, :]
        qpos = torch.tensor(starts)[:, None] + torch.minimum(j, qlens_t[:, None] - 1)
        logits_idx = torch.cat(
            [torch.arange(o + q - n, o + q) for o, q, n in zip(offsets, qlens, num_logits, strict=True)]
        )
        write_pos = write_pos.to(dev)
        qpos = qpos.to(dev)
        return Batch(
            input_ids=ids,
            cos=self.cos[write_pos][:, None],
            sin=self.sin[write_pos][:, None],
            num_seqs=B,
            max_q=max_q,
            max_k=max_k,
            masks={w: self._mask(qpos, max_k, w) for w in self.windows},
            logits_idx=logits_idx.to(dev),
            slots=slots_t.to(dev),
            write_slots=slots_t[seq_of_tok].to(dev),
            write_pos=write_pos,
            q_dest=None if q_dest is None else q_dest.to(dev),
            upcast=max_q == 1 and self.upcast_single_query,
        )

    @staticmethod
    def _mask(qpos: torch.Tensor, max_k: int, window: int | None) -> torch.Tensor | None:
        """[B, 1, Qmax, Kmax] bool (True = attend) for absolute query positions qpos [B, Qmax]; None if all True."""
        if qpos.shape[1] == 1 and qpos.shape[0] == 1 and (window is None or max_k <= window):
            return None  # one query at the end of the only sequence: attends to every key
        kpos = torch.arange(max_k, device=qpos.device)
        mask = kpos[None, None, :] <= qpos[:, :, None]  # causal; also excludes keys past each sequence's end
        if window is not None:
            mask &= kpos[None, None, :] > qpos[:, :, None] - window
        return mask[:, None]
