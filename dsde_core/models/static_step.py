"""The static step: decode and verify forwards of a few fixed shapes over persistent device buffers, so that a CUDA
graph captured once per shape replays them with one launch.

A call of B rows of q_r query tokens (a decode step, a draft level, the verification of 1 + k tokens) is padded up
to a bucket (Bb, Qb): Bb the least batch bucket >= B (1, 2, 4, 8, then steps of 16 up to the slot count), Qb the
least query bucket >= max q_r (1 .. 1 + the engine's max_sl). The host writes every value the forward reads into one
packet (pinned on CUDA) and copies it to the device buffers in one copy:
    tokens, wslot, wpos [Tb]   the padded [Bb, Qb] layout's token ids, row-major (Tb = Bb * Qb), and the cache slot
                               and position each token's key and value go to (the position is also its RoPE's)
    out [N]                    the layout's rows whose outputs the caller asked for
    slots, lens, qlens [Bb]    each row's slot, cache length with this step's tokens, and query count
Padding (a row's tokens past q_r, the rows past B) writes to the scratch slot, the cache's last, which no request
owns, at positions 0 .. Qb - 1; its outputs are never read. Attention reads lens and qlens at run time: the Triton
kernel where the runner has it (triton_attention.py), else SDPA over the whole cache length with a mask made from them
on the device (static shapes as well; a fallback that pays for the cache's full length, and the CPU's test of the
layout). Nothing in a forward depends on the packet's values on the host, so a graph captured for a bucket replays
every step of its shape. A call that fits no bucket (a prefill, a catch-up longer than the longest query bucket)
runs the eager ModelRunner.forward on the same cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from dsde_core.errors import ConfigError
from dsde_core.models.kv_cache import KVCache
from dsde_core.models.llama import AttnGroup, Batch, LlamaModel
from dsde_core.models.runner import ModelRunner, attention_mask

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepBuckets:
    """The static shapes: batch sizes up to max_batch and query lengths up to max_query."""

    max_batch: int
    max_query: int  # 1 + the most tokens a step drafts (the engine's max_sl)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_query < 1:
            raise ConfigError(f"buckets need max_batch >= 1 and max_query >= 1, got {self.max_batch}, "
                              f"{self.max_query}")

    @property
    def batches(self) -> tuple[int, ...]:
        """1, 2, 4, 8, then steps of 16, and max_batch last."""
        small = [b for b in (1, 2, 4, 8) if b < self.max_batch]
        return (*small, *range(16, self.max_batch, 16), self.max_batch)

    @property
    def queries(self) -> tuple[int, ...]:
        return tuple(range(1, self.max_query + 1))

    def fit(self, rows: int, max_q: int) -> tuple[int, int] | None:
        """The least bucket (Bb, Qb) holding `rows` rows of up to max_q queries; None beyond the largest."""
        if rows > self.max_batch or max_q > self.max_query:
            return None
        return next(b for b in self.batches if b >= rows), max_q


class StaticRunner:
    """A Runner (runner.Runner) whose decode and verify calls run the static step; on CUDA with graphs=True,
    `capture` records each bucket's forward as a CUDA graph, which `forward` replays; with fuse=True the model's small
    ops run compiled (LlamaModel.fuse; `capture` compiles them first). Everything else runs ModelRunner's eager
    forward over the same cache (num_slots + 1 slots: the last is the scratch slot)."""

    def __init__(self, model: LlamaModel, num_slots: int, max_seq_len: int, max_query: int,
                 attention: str = "torch", graphs: bool = False, fuse: bool = False) -> None:
        if max_query > max_seq_len:
            raise ConfigError(f"max_query {max_query} exceeds max_seq_len {max_seq_len}")
        if graphs and model.device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA device, the model is on {model.device}")
        self.eager = ModelRunner(model, num_slots + 1, max_seq_len, attention)
        self.model, self.vocab_size, self.device = model, self.eager.vocab_size, self.eager.device
        self.num_slots, self.scratch = num_slots, num_slots
        self.buckets = StepBuckets(num_slots, max_query)
        self.graphs_on, self.fuse = graphs, fuse
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = self.compile_s = 0.0
        self.calls = {"static": 0, "eager": 0}  # forwards of each kind since the start
        t_max, b_max = num_slots * max_query, num_slots
        # the packet and its device copy: four [Tb] regions then three [Bb] ones, at fixed offsets
        self._at = {"tokens": 0, "wslot": t_max, "wpos": 2 * t_max, "out": 3 * t_max, "slots": 4 * t_max,
                    "lens": 4 * t_max + b_max, "qlens": 4 * t_max + 2 * b_max}
        size = 4 * t_max + 3 * b_max
        cuda = self.device.type == "cuda"
        self.packet = torch.zeros(size, dtype=torch.long, pin_memory=cuda)
        self._host = self.packet.numpy()  # the packet's memory, written with NumPy (no torch call, no sync)
        self.buf = torch.zeros(size, dtype=torch.long, device=self.device)
        self._copied = torch.cuda.Event() if cuda else None  # the last copy out of the packet has finished
        self._col = torch.arange(max_query, device=self.device)  # [Qmax]
        self._kpos = torch.arange(max_seq_len, device=self.device)  # [M]
        self._all = torch.arange(t_max, device=self.device)  # [Tmax]: every row of the layout

    # ---- the Runner seam ----------------------------------------------------------------------------
    @property
    def cache(self) -> KVCache:
        """The KV cache (num_slots + 1 slots: the last is the scratch slot)."""
        return self.eager.cache

    def length(self, slot: int) -> int:
        return self.eager.length(self._slot(slot))

    def set_length(self, slot: int, n: int) -> None:
        self.eager.set_length(self._slot(slot), n)

    def reset(self, slot: int) -> None:
        self.eager.reset(self._slot(slot))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.eager.head(h)

    @torch.inference_mode()
    def forward(self, slots: list[int], tokens: list[list[int]], num_logits: list[int],
                hidden: bool = False, ids: torch.Tensor | None = None) -> torch.Tensor:
        """ModelRunner.forward's contract: the static step where the call fits a bucket, the eager forward else."""
        for s in slots:
            self._slot(s)
        bucket = self.buckets.fit(len(slots), max((len(t) for t in tokens), default=0))
        if bucket is None:
            self.calls["eager"] += 1
            return self.eager.forward(slots, tokens, num_logits, hidden, ids)
        starts, qlens = self.eager.check(slots, tokens, num_logits, ids)
        self.calls["static"] += 1
        n = self._fill(bucket, slots, tokens, num_logits, starts, qlens)
        self.buf.copy_(self.packet, non_blocking=True)  # [size]: the one copy of the step's inputs
        if ids is not None:  # the rows' tokens from the device: column 0 of each row of the layout [Bb, Qb]
            bb, qb = bucket
            self._view("tokens", bb * qb).view(bb, qb)[: len(slots), 0].copy_(ids)
        if self._copied is not None:
            self._copied.record()
        h = self._replay(bucket)  # [Bb * Qb, D]
        for s, q in zip(slots, qlens, strict=True):
            self.eager.cache.lengths[s] += q
        h = h.index_select(0, self._view("out", n))  # [N, D]
        return h if hidden else self.eager.head(h)

    # ---- the static step ----------------------------------------------------------------------------
    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise ConfigError(f"slot {slot} out of range [0, {self.num_slots})")
        return slot

    def _view(self, name: str, n: int) -> torch.Tensor:
        return self.buf[self._at[name] : self._at[name] + n]

    def _fill(self, bucket: tuple[int, int], slots: list[int], tokens: list[list[int]], num_logits: list[int],
              starts: list[int], qlens: list[int]) -> int:
        """Write the packet for this call in bucket (Bb, Qb) (the module doc's layout); returns N, the rows asked."""
        bb, qb = bucket
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the packet (it has: the caller read its output)
        p, at, t = self._host, self._at, bb * qb
        col = np.tile(np.arange(qb), bb)  # [Tb]: each token's column in the layout
        p[at["tokens"] : at["tokens"] + t] = 0
        p[at["wslot"] : at["wslot"] + t] = self.scratch
        p[at["wpos"] : at["wpos"] + t] = col
        p[at["slots"] : at["slots"] + bb] = self.scratch
        p[at["lens"] : at["lens"] + bb] = 1
        p[at["qlens"] : at["qlens"] + bb] = 1
        out = at["out"]
        for r, (slot, toks, n, start, q) in enumerate(zip(slots, tokens, num_logits, starts, qlens, strict=True)):
            row = r * qb
            p[at["tokens"] + row : at["tokens"] + row + q] = toks
            p[at["wslot"] + row : at["wslot"] + row + q] = slot
            p[at["wpos"] + row : at["wpos"] + row + q] = np.arange(start, start + q)
            p[out : out + n] = np.arange(row + q - n, row + q)
            out += n
            p[at["slots"] + r], p[at["lens"] + r], p[at["qlens"] + r] = slot, start + q, q
        return out - at["out"]

    def _pad(self, bucket: tuple[int, int]) -> None:
        """A packet of bucket (Bb, Qb) with every row padding (what a capture runs on: only the scratch slot is
        written), copied to the buffers."""
        self._fill(bucket, [], [], [], [], [])
        self.buf.copy_(self.packet)

    def _run(self, bucket: tuple[int, int]) -> torch.Tensor:
        """The bucket's forward over the buffers -> final-norm hidden states of the whole layout [Bb * Qb, D]."""
        bb, qb = bucket
        t = bb * qb
        wslot, wpos = self._view("wslot", t), self._view("wpos", t)
        slots, lens, qlens = self._view("slots", bb), self._view("lens", bb), self._view("qlens", bb)
        runner = self.eager
        if runner.kernel:
            group = AttnGroup(qb, 0, {}, kernel=(slots.int(), lens.int(), qlens.int()))
        else:
            # query i of row r sits at lens - qlens + i (padding queries repeat the last real one: never all masked)
            qpos = lens[:, None] - qlens[:, None] + torch.minimum(self._col[:qb][None, :], qlens[:, None] - 1)
            masks = {w: attention_mask(qpos, self._kpos, w) for w in runner.windows}  # [Bb, 1, Qb, M] each
            group = AttnGroup(qb, self._kpos.shape[0], masks, slots=slots,
                              upcast=qb == 1 and runner.upcast_single_query)
        b = Batch(self._view("tokens", t), runner.cos[wpos][:, None], runner.sin[wpos][:, None], [group],
                  self._all[:t], write_slots=wslot, write_pos=wpos)
        return self.model(b, runner.cache.k, runner.cache.v, hidden=True)

    def _replay(self, bucket: tuple[int, int]) -> torch.Tensor:
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._run(bucket)
        graph[0].replay()
        return graph[1]

    def capture(self) -> float:
        """Make the static step ready: with fuse, compile the small ops (a forward of the smallest and of the largest
        bucket; compile_s); with graphs, capture every bucket's forward as a CUDA graph, the largest first, into one
        memory pool (as nano-vllm's runner does: the smaller graphs reuse the largest one's memory). Returns the
        seconds the capture took (capture_s). Both run on padding rows only, so no request's cache is touched."""
        if self.fuse and not self.compile_s:
            t0 = time.perf_counter()
            self.model.fuse()
            with torch.inference_mode():
                for bucket in ((1, 1), (self.buckets.max_batch, self.buckets.max_query)):
                    self._pad(bucket)
                    self._run(bucket)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.compile_s = time.perf_counter() - t0
            log.info("compiled the small ops in %.1f s", self.compile_s)
        if not self.graphs_on or self.graphs:
            return self.capture_s
        t0, pool = time.perf_counter(), None
        with torch.inference_mode():
            for bb in reversed(self.buckets.batches):
                for qb in reversed(self.buckets.queries):
                    self._pad((bb, qb))
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):  # a warm-up outside the graph: lazy initialisation, autotuning
                        self._run((bb, qb))
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._run((bb, qb))
                    pool = graph.pool() if pool is None else pool
                    self.graphs[(bb, qb)] = (graph, out)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d CUDA graphs (batches %s, queries 1-%d) in %.1f s", len(self.graphs),
                 self.buckets.batches, self.buckets.max_query, self.capture_s)
        return self.capture_s
