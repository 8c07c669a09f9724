"""The runner seam (Runner) and its torch backend, ModelRunner: one batched forward over ragged per-sequence query
lengths, on a slot-based KV cache. llama_cpp.LlamaCppRunner is the other backend behind the same seam."""

from __future__ import annotations

from typing import Protocol

import torch

from dsde_core.errors import ConfigError
from dsde_core.models import triton_attention
from dsde_core.models.kv_cache import KVCache
from dsde_core.models.llama import AttnGroup, Batch, LlamaModel

ALONE_Q = 64  # query tokens past which a sequence attends alone (_prepare)


class Runner(Protocol):
    """What the workers ask of a model: a batched forward over slots, and each slot's cached length.

    forward(slots, tokens, num_logits): tokens[i] are appended to slot slots[i] at positions length(slots[i]).. and
    the float32 logits of each sequence's last num_logits[i] positions come back packed, [sum(num_logits), vocab].
    With hidden=True it returns what `head` turns into those logits (final hidden states on torch, so that many rows'
    logits can be made a few at a time; the logits themselves on llama.cpp). set_length(slot, n) rolls a slot back to
    its first n positions (a rejected draft); reset(slot) empties it. ids [B] on the runner's device, where given: each
    row's one token (tokens[i] is then one placeholder), so a draft level is fed the last level's draws without
    reading them back."""

    vocab_size: int
    device: torch.device

    def length(self, slot: int) -> int: ...
    def set_length(self, slot: int, n: int) -> None: ...
    def reset(self, slot: int) -> None: ...
    def forward(self, slots: list[int], tokens: list[list[int]], num_logits: list[int],
                hidden: bool = False, ids: torch.Tensor | None = None) -> torch.Tensor: ...
    def head(self, h: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    """Prefill, single-token decode and multi-token verification, mixed freely in one `forward` call."""

    def __init__(self, model: LlamaModel, num_slots: int, max_seq_len: int, attention: str = "torch") -> None:
        """attention: "torch" (gather, mask, SDPA) or "triton" (triton_attention's kernel for the rows of up to
        ALONE_Q query tokens: on CUDA, or on the CPU under TRITON_INTERPRET=1 for tests). Triton is opt-in until the
        GPU check (docs/benchmarks.md) has timed it on a device."""
        if attention not in ("torch", "triton"):
            raise ConfigError(f"attention must be torch or triton, got {attention!r}")
        if attention == "triton" and not triton_attention.available():
            raise ConfigError("attention='triton' needs Triton installed (pip install triton)")
        a = model.args
        self.model = model
        self.vocab_size: int = a.vocab_size
        self.device = model.device
        self.cache = KVCache(a.num_layers, num_slots, max_seq_len, a.num_kv_heads, a.head_dim, model.dtype, self.device)
        self.cos, self.sin = model.rope_tables(max_seq_len)  # [max_seq_len, head_dim]
        self.windows = sorted(set(a.sliding_windows), key=lambda w: -1 if w is None else w)
        # one query a row (decode, draft levels) on the CPU in a half dtype: attention in fp32 (llama.py, Attention)
        self.upcast_single_query = self.device.type == "cpu" and model.dtype != torch.float32
        self.kernel = attention == "triton"

    def length(self, slot: int) -> int:
        return self.cache.length(slot)

    def set_length(self, slot: int, n: int) -> None:
        self.cache.set_length(slot, n)

    def reset(self, slot: int) -> None:
        self.cache.reset(slot)

    @torch.inference_mode()
    def forward(self, slots: list[int], tokens: list[list[int]], num_logits: list[int],
                hidden: bool = False, ids: torch.Tensor | None = None) -> torch.Tensor:
        """One batched forward over ragged per-sequence query lengths.

        tokens[i] (len >= 1) are appended to slot slots[i] at positions cache.length(slot).. ; lengths advance.
        Returns float32 logits packed [sum(num_logits), vocab]: for each sequence, the logits of its LAST
        num_logits[i] query positions (1 <= num_logits[i] <= len(tokens[i])), in order of `slots`. With `hidden`:
        the final-norm hidden states there instead, [sum(num_logits), D], for `head` to make logits of in parts.
        ids [B] on the device: the rows' tokens, one a row, in place of tokens' values (Runner's doc).
        """
        b = self._prepare(slots, tokens, num_logits, ids)
        out = self.model(b, self.cache.k, self.cache.v, hidden=hidden)
        for s, t in zip(slots, tokens, strict=True):
            self.cache.lengths[s] += len(t)
        return out

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, D] from forward(hidden=True) -> float32 logits [N, vocab]."""
        return self.model.head(h)

    def check(self, slots: list[int], tokens: list[list[int]], num_logits: list[int],
              ids: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
        """ConfigError unless `forward` can take these arguments (its doc); else each row's (cache length, query
        length). Checked on the host: no read of a device value (ids' values are the draft's own draws)."""
        B = len(slots)
        if ids is not None and (ids.shape != (B,) or any(len(t) != 1 for t in tokens)):
            raise ConfigError(f"ids give one token a row: shape {tuple(ids.shape)} for {B} rows, query lengths "
                              f"{[len(t) for t in tokens]}")
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
        low, high = min(min(t) for t in tokens), max(max(t) for t in tokens)
        if low < 0 or high >= self.vocab_size:
            raise ConfigError(f"token ids must be in [0, {self.vocab_size}), got min {low} max {high}")
        return starts, qlens

    def _prepare(self, slots: list[int], tokens: list[list[int]], num_logits: list[int],
                 ids: torch.Tensor | None = None) -> Batch:
        starts, qlens = self.check(slots, tokens, num_logits, ids)
        B, dev = len(slots), self.device
        flat = tokens[0] if B == 1 else [x for t in tokens for x in t]
        if ids is None:
            ids = torch.tensor(flat, dtype=torch.long).to(dev, non_blocking=True)
        offsets = [0] * B  # packed offsets of each sequence's tokens
        for i in range(1, B):
            offsets[i] = offsets[i - 1] + qlens[i - 1]
        logits_idx = torch.cat(
            [torch.arange(o + q - n, o + q) for o, q, n in zip(offsets, qlens, num_logits, strict=True)]
        ).to(dev)
        # a long query (a prompt, a chunk of one) attends alone, the rest in one group: padded beside it, each row
        # decoding in the same step would pay attention over the prompt's length
        alone = [i for i in range(B) if qlens[i] > ALONE_Q]
        rest = [i for i in range(B) if qlens[i] <= ALONE_Q]
        members = [[i] for i in alone] + ([rest] if rest else [])
        whole = len(members) == 1
        groups = [self._group(m, slots, starts, qlens, offsets, whole) for m in members]
        if B == 1:
            start, q = starts[0], qlens[0]
            cos, sin = self.cos[start : start + q][:, None], self.sin[start : start + q][:, None]
            return Batch(ids, cos, sin, groups, logits_idx, single=(slots[0], start, q))
        qlens_t = torch.tensor(qlens)
        seq_of_tok = torch.repeat_interleave(torch.arange(B), qlens_t)  # [T]
        write_pos = torch.tensor(starts)[seq_of_tok] + torch.arange(len(flat)) - torch.tensor(offsets)[seq_of_tok]
        return Batch(
            input_ids=ids,
            cos=self.cos[write_pos][:, None],
            sin=self.sin[write_pos][:, None],
            groups=groups,
            logits_idx=logits_idx,
            write_slots=torch.tensor(slots)[seq_of_tok].to(dev),
            write_pos=write_pos.to(dev),
        )

    def _group(self, members: list[int], slots: list[int], starts: list[int], qlens: list[int], offsets: list[int],
               whole: bool) -> AttnGroup:
        """The attention group of batch rows `members` (whole: they are the whole batch, so no rows to select)."""
        dev = self.device
        rows = None if whole else torch.cat([torch.arange(offsets[i], offsets[i] + qlens[i]) for i in members]).to(dev)
        if self.kernel and max(qlens[i] for i in members) <= ALONE_Q:
            return self._kernel_group(members, slots, starts, qlens, rows)
        if len(members) == 1:
            i = members[0]
            end = starts[i] + qlens[i]
            # a prompt from position 0 inside every window: SDPA's own causal mask, which skips the masked blocks
            # (faster than an explicit mask, which SDPA must read in full)
            causal = starts[i] == 0 and qlens[i] > 1 and all(w is None or end <= w for w in self.windows)
            qpos = torch.arange(starts[i], end, device=dev)[None, :]  # [1, q]
            masks = {w: None if causal else self._mask(qpos, end, w) for w in self.windows}
            return AttnGroup(qlens[i], end, masks, rows, single=(slots[i], end), causal=causal,
                             upcast=qlens[i] == 1 and self.upcast_single_query)
        qlens_g = torch.tensor([qlens[i] for i in members])  # [Bg]
        starts_g = torch.tensor([starts[i] for i in members])
        max_q, max_k = int(qlens_g.max()), int((starts_g + qlens_g).max())
        q_dest = self._q_dest(qlens_g.tolist(), max_q)
        # padded query positions [Bg, Qmax]; padding rows repeat the last real position so no row is fully masked
        qpos = (starts_g[:, None] + torch.minimum(torch.arange(max_q)[None, :], qlens_g[:, None] - 1)).to(dev)
        return AttnGroup(max_q, max_k, {w: self._mask(qpos, max_k, w) for w in self.windows}, rows,
                         slots=torch.tensor([slots[i] for i in members]).to(dev), q_dest=q_dest,
                         upcast=max_q == 1 and self.upcast_single_query)

    def _kernel_group(self, members: list[int], slots: list[int], starts: list[int], qlens: list[int],
                      rows: torch.Tensor | None) -> AttnGroup:
        """The decoding and verifying rows' group for the Triton kernel: their slots, lengths with this step's tokens
        and query lengths, and where their queries sit in the padded [Bg * Qmax] layout."""
        qlens_g = [qlens[i] for i in members]
        max_q = max(qlens_g)
        q_dest = self._q_dest(qlens_g, max_q)
        meta = torch.tensor([[slots[i] for i in members], [starts[i] + qlens[i] for i in members], qlens_g],
                            dtype=torch.int32).to(self.device)  # [3, Bg]: one copy
        end = max(starts[i] + qlens[i] for i in members)
        return AttnGroup(max_q, end, {}, rows, q_dest=q_dest, kernel=(meta[0], meta[1], meta[2]))

    def _q_dest(self, qlens: list[int], max_q: int) -> torch.Tensor | None:
        """[G]: each query token's row in the padded [Bg * Qmax] layout (sequence j's at j * Qmax on); None when
        every sequence has Qmax queries."""
        if all(q == max_q for q in qlens):
            return None
        return torch.cat([torch.arange(j * max_q, j * max_q + q) for j, q in enumerate(qlens)]).to(self.device)

    @staticmethod
    def _mask(qpos: torch.Tensor, max_k: int, window: int | None) -> torch.Tensor | None:
        """attention_mask over keys 0 .. max_k - 1; None if all True."""
        if qpos.shape[1] == 1 and qpos.shape[0] == 1 and (window is None or max_k <= window):
            return None  # one query at the end of the only sequence: attends to every key
        return attention_mask(qpos, torch.arange(max_k, device=qpos.device), window)


def attention_mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, 1, Qmax, K] bool (True = attend) for absolute query positions qpos [B, Qmax] over key positions kpos [K]:
    causal (which also excludes keys past each sequence's end), and inside the sliding window if there is one."""
    mask = kpos[None, None, :] <= qpos[:, :, None]
    if window is not None:
        mask &= kpos[None, None, :] > qpos[:, :, None] - window
    return mask[:, None]
