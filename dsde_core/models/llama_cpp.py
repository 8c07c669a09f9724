"""LlamaCppRunner: the engine's runner seam (models/runner.Runner) over llama.cpp, running a GGUF file as it is.

Why a second backend: a CPU decode step reads every weight once, and llama.cpp's quantized kernels read a Q4_K_M
file's ~4.5 bits a weight where the torch forward reads a bf16 conversion's 16. The workers speak only the seam:
`vocab_size`, `device`, `cache.max_seq_len`, `length(slot)`, `set_length(slot, n)`, `reset(slot)`,
`forward(slots, tokens, num_logits, hidden)` and `head(h)`. It goes through llama-cpp-python's low-level ctypes
module (`llama_cpp.llama_cpp`, the C API of llama.h); the high-level `Llama` class holds one sequence only.

How the seam maps onto llama.cpp:
- one context, one sequence id per slot, and a unified KV cache (`kv_unified`): n_ctx = num_slots * max_seq_len
  cells shared by every sequence, each cell tagged with its sequence and position. Without it each sequence gets a
  stream of its own, and llama.cpp cuts a batch into ubatches with the same number of tokens per sequence and
  consecutive sequence ids: a ragged batch (verifying 5 tokens in one slot beside decoding 1 in another) would become
  several graph runs. A slot holds at most max_seq_len positions, checked here as KVCache does, so the cells never
  run out. `swa_full` keeps a sliding-window model's keys past its window, which a rollback may need again.
- forward: one `llama_decode` over the packed tokens, seq_id = slot, pos = length(slot) + j, an output only at each
  sequence's last num_logits positions (llama.cpp runs the head at those rows only, and itself splits the batch
  into ubatches of n_ubatch tokens). A forward of more than n_batch tokens, or asking for more than max_outputs
  rows, takes several decodes, in order. The logits rows come back contiguous in batch order; each decode's are
  copied once into the float32 result.
- rollback: `llama_memory_seq_rm(mem, slot, n, -1)` drops positions n..; reset drops the whole sequence.
- numerics: llama.cpp's kernels depend on the batch's shape (a forward of 4+ tokens of one sequence takes other
  GEMM and attention paths than one token does), so a verified position's logits round differently from the same
  position decoded alone, as bf16 matmuls do on torch: greedy speculation equals target-only decoding except where
  the target's two likeliest tokens lie within that rounding (a near-tie).
- hidden=True: llama.cpp hands out logits, not final hidden states (its embeddings mode outputs every position and
  pools), so forward(hidden=True) returns the same logits and `head` is the identity. The cost is in the prompt
  log-probabilities, the one caller that asks for many rows: P positions hold P x V x 4 bytes in the returned tensor
  (vocabulary 151,936: 0.6 MB a position, 2.5 GB for a 4,096-token chunk). llama.cpp's own output buffer, which
  stays at its largest size for the context's life, holds at most max_outputs rows (512: 311 MB).

The batch's arrays are numpy buffers this object owns (a llama_batch struct pointing at them), filled by whole-array
writes: llama_batch_init's per-token seq_id arrays would take a Python loop per token. llama.cpp's log goes nowhere
by default (quiet); its error lines are kept and quoted when a decode fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dsde_core.cpuinfo import cpu_info
from dsde_core.errors import ConfigError, DSDEError, ModelLoadError
from dsde_core.models.packaged import EMBEDDED, PackagedModel, cache_root, join_parts, locate_parts

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

INSTALL_HINT = "pip install llama-cpp-python==0.3.36 (it builds llama.cpp from source: several minutes)"
PLAIN_PREFILL = 48  # query tokens of a fresh prompt from which the plain layout's GEMM beats the repacked one
MAX_SEQUENCES = 256  # LLAMA_MAX_SEQ of llama.cpp: sequence ids (slots) of one context
KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30}  # ggml_type of the K and V cache
FLASH_ATTN = {None: -1, False: 0, True: 1}  # llama_flash_attn_type: auto (llama.cpp decides), off, on
_ERROR, _CONT = 4, 5  # ggml_log_level: an error; the continuation of the previous message


class LlamaCppError(DSDEError, RuntimeError):
    """llama.cpp failed to load a model, make a context or decode a batch."""


def _lib() -> Any:
    """llama-cpp-python's ctypes module (imported on first use: the package is optional)."""
    try:
        import llama_cpp.llama_cpp as lib
    except ImportError as e:
        raise ModelLoadError(f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}") from e
    return lib


class _Log:
    """The process-wide llama.cpp log callback: silent, or to stderr; keeps the last error lines either way."""

    def __init__(self) -> None:
        self.errors: deque[str] = deque(maxlen=8)
        self.quiet = True
        self.in_error = False  # the last message was an error (a CONT message continues it)
        self.callback: Any = None  # the ctypes function object: llama.cpp holds a bare pointer to it

    def install(self, lib: Any, quiet: bool) -> None:
        self.quiet = quiet
        if self.callback is None:
            self.callback = lib.llama_log_callback(self._log)
        lib.llama_log_set(self.callback, ctypes.c_void_p(0))

    def _log(self, level: int, text: bytes, user_data: Any) -> None:
        msg = text.decode("utf-8", "replace").strip() if text else ""
        if level == _ERROR:
            self.errors.append(msg)
        elif level == _CONT and self.in_error and self.errors:
            self.errors[-1] = f"{self.errors[-1]} {msg}"
        self.in_error = level == _ERROR or (level == _CONT and self.in_error)
        if not self.quiet:
            os.write(2, text or b"")

    def take(self) -> str:
        """The error lines logged since the last take, joined ('' if none)."""
        out = "; ".join(e for e in self.errors if e)
        self.errors.clear()
        return out


_LOG = _Log()
_BACKEND_READY = False


def cpu_has_amx() -> bool:
    """Whether this CPU reports AMX int8 tiles (False where /proc/cpuinfo cannot be read)."""
    return "amx_int8" in cpu_info()[1]


class _BuftOverride(ctypes.Structure):
    """llama_model_tensor_buft_override: tensors whose name matches `pattern` are placed in buffer type `buft`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _repack_q4k(path: Path) -> ctypes.Array | None:
    """Overrides that put every 2-D Q4_K weight but the embeddings into llama.cpp's CPU_REPACK buffer type (its
    interleaved blocks, multiplied by GEMM kernels that read a weight block once for several tokens), one exact-name
    pattern a tensor (libstdc++'s regex recurses per alternative: one long pattern overflows its stack). None where
    this build has no CPU_REPACK buffer type or the file no Q4_K weight."""
    from gguf import GGUFReader

    buft = _cpu_repack_buft()
    if buft is None:
        return None
    names = [t.name for t in GGUFReader(path).tensors
             if t.tensor_type.name == "Q4_K" and len(t.shape) == 2 and t.name != "token_embd.weight"]
    if not names:
        return None
    return (_BuftOverride * (len(names) + 1))(*[_BuftOverride(f"^{re.escape(n)}$".encode(), buft) for n in names],
                                              _BuftOverride(None, None))


def _cpu_repack_buft() -> int | None:
    """The CPU device's CPU_REPACK buffer type, through ggml's backend registry (libggml in llama-cpp-python's lib/)."""
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    try:
        ggml = ctypes.CDLL(str(lib_dir / "libggml.so"))
        base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    except OSError:
        return None
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    base.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    base.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    fn = dev and base.ggml_backend_reg_get_proc_address(base.ggml_backend_dev_backend_reg(dev),
                                                       b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return None
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)  # NULL-terminated
    i = 0
    while bufts[i]:
        if base.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return bufts[i]
        i += 1
    return None


@dataclass
class SeqLengths:
    """Each slot's cached length and the cap on it (KVCache's bookkeeping without the tensors: llama.cpp holds the
    keys and values). `max_seq_len` is what the simulator reads."""

    num_slots: int
    max_seq_len: int

    def __post_init__(self) -> None:
        self.lengths = [0] * self.num_slots

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ConfigError(f"slot {slot} out of range [0, {self.num_slots})")

    def check_room(self, slot: int, n: int) -> None:
        """ConfigError when appending n tokens to slot would exceed max_seq_len."""
        self.check_slot(slot)
        if self.lengths[slot] + n > self.max_seq_len:
            raise ConfigError(
                f"slot {slot}: {self.lengths[slot]} cached + {n} new tokens = {self.lengths[slot] + n} "
                f"exceeds max_seq_len {self.max_seq_len}"
            )


class LlamaCppRunner:
    """Prefill, single-token decode and multi-token verification over one llama.cpp context, mixed freely in one
    `forward` call, as ModelRunner does them."""

    def __init__(self, path: str | Path, num_slots: int, max_seq_len: int, threads: int | None = None,
                 n_batch: int = 4096, n_ubatch: int = 512, max_outputs: int = 512, kv_type: str = "f16",
                 flash_attn: bool | None = None, extra_buffers: bool | None = None, n_gpu_layers: int = 0,
                 quiet: bool = True) -> None:
        """path: a .gguf file. n_batch: the most tokens one llama_decode takes; max_outputs: the most logits rows
        (a forward past either takes several); n_ubatch: the most tokens llama.cpp computes in one graph run (its
        compute buffers grow with it). threads: default
        every core this process may run on. kv_type: "f16" (llama.cpp's default), "bf16" or "f32". flash_attn: None
        lets llama.cpp choose (on the CPU: on; it computes attention with f16 keys and values). extra_buffers:
        llama.cpp's weight layouts for its special CPU kernels (AMX tiles, repacked blocks); None: on, unless the CPU
        has AMX, whose matmul segfaults on the first decode of these Q4_K_M files (llama.cpp issue 20824): there the
        Q4_K matmul weights alone go to the repacked layout (_repack_q4k), which multi-token forwards gain most from."""
        if not 1 <= num_slots <= MAX_SEQUENCES:
            raise ConfigError(f"num_slots must be in [1, {MAX_SEQUENCES}] (llama.cpp's sequences), got {num_slots}")
        if min(max_seq_len, n_batch, n_ubatch, max_outputs) < 1:
            raise ConfigError(f"max_seq_len, n_batch, n_ubatch and max_outputs must be >= 1, got {max_seq_len}, "
                              f"{n_batch}, {n_ubatch}, {max_outputs}")
        if kv_type not in KV_TYPES:
            raise ConfigError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        path = Path(os.path.expanduser(str(path)))
        if not path.is_file():
            raise ModelLoadError(f"no GGUF file at {path}")
        lib = self._lib = _lib()
        _LOG.install(lib, quiet)
        global _BACKEND_READY
        if not _BACKEND_READY:
            lib.llama_backend_init()
            _BACKEND_READY = True
        self._model = self._ctx = None
        self.path = path
        self.threads = threads or len(os.sched_getaffinity(0))
        self.device = torch.device("cpu")  # where the logits are returned
        self.cache = SeqLengths(num_slots, max_seq_len)

        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        amx = cpu_has_amx()
        mp.use_extra_bufts = not amx if extra_buffers is None else extra_buffers
        self._overrides = _repack_q4k(path) if extra_buffers is None and amx else None  # kept alive with the model
        if self._overrides is not None:
            mp.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        self._model = lib.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {path}: {_LOG.take() or 'no reason given'}")
        self.vocab_size: int = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))

        cp = lib.llama_context_default_params()
        cp.n_ctx = num_slots * max_seq_len  # llama.cpp rounds it up to a multiple of 256
        cp.n_batch = min(n_batch, cp.n_ctx)
        cp.n_ubatch = min(n_ubatch, cp.n_batch)
        cp.n_seq_max = num_slots
        cp.n_threads = cp.n_threads_batch = self.threads  # one-token batches use n_threads, the rest n_threads_batch
        cp.kv_unified = True
        cp.swa_full = True
        cp.type_k = cp.type_v = KV_TYPES[kv_type]
        cp.flash_attn_type = FLASH_ATTN[flash_attn]
        cp.embeddings = False  # logits only, and only at the rows asked for
        cp.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise LlamaCppError(f"llama.cpp could not make a context for {path} ({num_slots} x {max_seq_len} "
                                f"positions): {_LOG.take() or 'no reason given'}")
        self._mem = lib.llama_get_memory(self._ctx)
        # the repacked model's prompts go through a plain-layout copy (its weights are the file's pages, mmap'd once)
        self._plain = None if self._overrides is None else LlamaCppRunner(
            path, 1, max_seq_len, threads, n_batch, n_ubatch, max_outputs, kv_type, flash_attn, extra_buffers=False,
            quiet=quiet)
        self.n_ctx: int = lib.llama_n_ctx(self._ctx)
        self.n_batch: int = lib.llama_n_batch(self._ctx)
        self.max_outputs = max_outputs

        # the batch: llama_batch's arrays are these buffers, rewritten by every decode
        nb = self.n_batch
        self._token = np.zeros(nb, np.int32)  # [n_batch] token ids
        self._pos = np.zeros(nb, np.int32)  # [n_batch] position of each token in its sequence
        self._n_seq = np.ones(nb, np.int32)  # [n_batch] sequences a token belongs to: always 1
        self._seq_ids = np.arange(num_slots, dtype=np.int32)  # [num_slots] slot s's sequence id (s), pointed at
        self._seq_ptr = np.zeros(nb, np.uintp)  # [n_batch] address of the token's sequence id in _seq_ids
        self._output = np.zeros(nb, np.int8)  # [n_batch] 1: return this token's logits
        b = self._batch = lib.llama_batch()
        b.token = self._token.ctypes.data_as(ctypes.POINTER(lib.llama_token))
        b.embd = None
        b.pos = self._pos.ctypes.data_as(ctypes.POINTER(lib.llama_pos))
        b.n_seq_id = self._n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self._seq_ptr.ctypes.data, ctypes.POINTER(ctypes.POINTER(lib.llama_seq_id)))
        b.logits = self._output.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def length(self, slot: int) -> int:
        self.cache.check_slot(slot)
        return self.cache.lengths[slot]

    def set_length(self, slot: int, n: int) -> None:
        """Roll slot back to its first n tokens (0 <= n <= current length)."""
        cur = self.length(slot)
        if not 0 <= n <= cur:
            raise ConfigError(f"set_length(slot={slot}, n={n}): n must be in [0, {cur}] (the current length)")
        if n < cur:
            self._remove(slot, n)
        self.cache.lengths[slot] = n

    def reset(self, slot: int) -> None:
        self.cache.check_slot(slot)
        self._remove(slot, -1)
        self.cache.lengths[slot] = 0

    def forward(self, slots: list[int], tokens: list[list[int]], num_logits: list[int],
                hidden: bool = False, ids: torch.Tensor | None = None) -> torch.Tensor:
        """One batched forward over ragged per-sequence query lengths.

        tokens[i] (len >= 1) are appended to slot slots[i] at positions length(slot).. ; lengths advance.
        Returns float32 logits packed [sum(num_logits), vocab]: for each sequence, the logits of its LAST
        num_logits[i] query positions (1 <= num_logits[i] <= len(tokens[i])), in order of `slots`. `hidden`: the
        same logits (llama.cpp gives no hidden states; `head` is the identity). With repacked weights, a fresh
        prompt of PLAIN_PREFILL tokens or more is prefilled apart (_prefill_plain). ids [B]: the rows' tokens, one a
        row (Runner's doc; on the host here, so read as they are).
        """
        if ids is not None:
            if ids.shape != (len(slots),):
                raise ConfigError(f"ids give one token a row: shape {tuple(ids.shape)} for {len(slots)} rows")
            tokens = [[x] for x in ids.tolist()]
        self._pack(slots, tokens, num_logits)  # every input checked before any row runs
        apart = [i for i, (s, t) in enumerate(zip(slots, tokens, strict=True))
                 if self._plain is not None and len(t) >= PLAIN_PREFILL and self.cache.lengths[s] == 0]
        if not apart:
            return self._decode(slots, tokens, num_logits)
        rest = [i for i in range(len(slots)) if i not in apart]
        parts = {i: self._prefill_plain(slots[i], tokens[i], num_logits[i]) for i in apart}
        if rest:
            out = self._decode([slots[i] for i in rest], [tokens[i] for i in rest], [num_logits[i] for i in rest])
            ends = np.cumsum([num_logits[i] for i in rest])
            parts.update({i: out[e - num_logits[i] : e] for i, e in zip(rest, ends, strict=True)})
        return torch.cat([parts[i] for i in range(len(slots))])

    def _prefill_plain(self, slot: int, tokens: list[int], num_logits: int) -> torch.Tensor:
        """A fresh prompt through the plain-layout copy of the model (llama.cpp's repacked GEMM kernels are faster
        for a few tokens a sequence, slower for a prompt's hundreds), its keys and values then copied into this
        context's slot as llama.cpp's sequence state (prompt x layers x K and V: megabytes)."""
        lib, plain = self._lib, self._plain
        plain.reset(0)
        logits = plain._decode([0], [tokens], [num_logits])  # [num_logits, V]
        size = lib.llama_state_seq_get_size(plain._ctx, 0)
        state = (ctypes.c_ubyte * size)()
        if lib.llama_state_seq_get_data(plain._ctx, state, size, 0) != size:
            raise LlamaCppError(f"llama.cpp could not read back slot {slot}'s prefilled state: {_LOG.take()}")
        plain.reset(0)
        self._remove(slot, -1)
        if lib.llama_state_seq_set_data(self._ctx, state, size, slot) != size:
            self._remove(slot, -1)
            raise LlamaCppError(f"llama.cpp could not take slot {slot}'s prefilled state: {_LOG.take()}")
        self.cache.lengths[slot] = len(tokens)
        return logits

    def _decode(self, slots: list[int], tokens: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        """forward's rows on this context: one llama_decode unless they exceed n_batch tokens or max_outputs rows."""
        lib = self._lib
        flat, pos, ptr, out = self._pack(slots, tokens, num_logits)
        T, V = len(flat), self.vocab_size
        logits = torch.empty(int(out.sum()), V, dtype=torch.float32)  # [N, V]
        n_out = np.cumsum(out)  # [T] outputs up to and including each token
        row = c0 = 0
        while c0 < T:  # one decode unless the forward exceeds n_batch tokens or max_outputs rows
            c1 = min(c0 + self.n_batch, T, int(np.searchsorted(n_out, row + self.max_outputs, side="right")))
            n = c1 - c0
            self._token[:n], self._pos[:n], self._seq_ptr[:n], self._output[:n] = (
                flat[c0:c1], pos[c0:c1], ptr[c0:c1], out[c0:c1])
            self._batch.n_tokens = n
            rc = lib.llama_decode(self._ctx, self._batch)
            if rc != 0:
                for s in slots:  # positions this forward added, in this decode or an earlier one
                    self._remove(s, self.cache.lengths[s])
                raise LlamaCppError(self._decode_failure(rc, slots, tokens))
            k = int(n_out[c1 - 1]) - row
            if k:
                rows = np.ctypeslib.as_array(lib.llama_get_logits(self._ctx), shape=(k, V))  # [k, V] view of C memory
                logits[row : row + k].copy_(torch.from_numpy(rows))
                row += k
            c0 = c1
        for s, t in zip(slots, tokens, strict=True):
            self.cache.lengths[s] += len(t)
        return logits

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The rows of forward(hidden=True) [N, V] are logits already: returned as they are."""
        return h

    def close(self) -> None:
        """Free the llama.cpp context and model (the batch's buffers are numpy's)."""
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if getattr(self, "_plain", None) is not None:
            self._plain.close()
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
        self._ctx = self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown the library may be gone already
            self.close()

    def _remove(self, slot: int, p0: int) -> None:
        """Drop slot's positions p0.. from the KV cache (p0 = -1: the whole sequence)."""
        if not self._lib.llama_memory_seq_rm(self._mem, slot, p0, -1):
            raise LlamaCppError(f"llama.cpp could not remove positions {p0}.. of slot {slot}")

    def _pack(self, slots: list[int], tokens: list[list[int]],
              num_logits: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Validate a forward's inputs (as ModelRunner does) and lay out its T tokens: ids [T] int32, positions [T]
        int32, the address of each token's sequence id [T] uintp, output flags [T] int8."""
        B = len(slots)
        if B == 0 or len(tokens) != B or len(num_logits) != B:
            raise ConfigError(
                f"forward needs one token list and one num_logits per slot and at least one slot: "
                f"got {B} slots, {len(tokens)} token lists, {len(num_logits)} num_logits"
            )
        if len(set(slots)) != B:
            raise ConfigError(f"forward got a slot twice: {slots}")
        for s, t, n in zip(slots, tokens, num_logits, strict=True):
            q = len(t)
            if q < 1:
                raise ConfigError(f"slot {s}: empty token list")
            if not 1 <= n <= q:
                raise ConfigError(f"slot {s}: num_logits {n} must be in [1, {q}] (its query length)")
            self.cache.check_room(s, q)
        flat = np.fromiter((x for t in tokens for x in t), dtype=np.int64)  # [T]
        if flat.min() < 0 or flat.max() >= self.vocab_size:
            raise ConfigError(f"token ids must be in [0, {self.vocab_size}), got min {flat.min()} max {flat.max()}")
        qlens = np.array([len(t) for t in tokens])  # [B]
        ends = np.cumsum(qlens)  # [B] packed end of each sequence's tokens
        seq = np.repeat(np.arange(B), qlens)  # [T] batch row of each token
        j = np.arange(len(flat)) - (ends - qlens)[seq]  # [T] index of the token inside its sequence's query
        starts = np.array([self.cache.lengths[s] for s in slots])  # [B]
        slot_of = np.array(slots)[seq]  # [T]
        ptr = self._seq_ids.ctypes.data + slot_of.astype(np.uintp) * self._seq_ids.itemsize  # [T]
        out = (j >= (qlens - np.array(num_logits))[seq]).astype(np.int8)  # [T] the last num_logits of each
        return flat.astype(np.int32), (starts[seq] + j).astype(np.int32), ptr, out

    def _decode_failure(self, rc: int, slots: list[int], tokens: list[list[int]]) -> str:
        what = {1: "no free KV cache cells for the batch", 2: "aborted", -1: "invalid input batch"}.get(
            rc, "fatal error")
        detail = _LOG.take()
        return (f"llama_decode returned {rc} ({what}) on {sum(map(len, tokens))} tokens of slots {slots}"
                + (f": {detail}" if detail else "") + "; the slots keep their lengths from before this forward")


def embedded_gguf(spec: PackagedModel | str, root: Path | None = None) -> Path:
    """The joined GGUF file of an embedded model (llama.cpp reads one file; the parts are byte ranges of it), joined
    and verified once into <cache root>/joined/<file name>; the converted safetensors cache is not needed."""
    spec = EMBEDDED[spec] if isinstance(spec, str) else spec
    out_dir = (root or cache_root()) / "joined"
    dest, marker = out_dir / spec.file_name, out_dir / f"{spec.file_name}.sha256"
    if dest.is_file() and marker.is_file() and marker.read_text().strip() == spec.sha256:
        return dest
    parts = locate_parts(spec)  # fail on a missing part before writing anything
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{spec.file_name}.{os.getpid()}.tmp"
    join_parts(parts, tmp, spec.sha256, desc=f"joining {spec.name}")  # removes tmp on a hash mismatch
    os.replace(tmp, dest)  # atomic: a reader sees the old file or the whole new one
    marker.write_text(spec.sha256)
    return dest


def resolve_gguf(source: str, root: Path | None = None) -> Path:
    """An embedded model name or a local .gguf path -> the GGUF file llama.cpp loads."""
    if source in EMBEDDED:
        return embedded_gguf(EMBEDDED[source], root)
    path = Path(os.path.expanduser(source))
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    raise ModelLoadError(f"the llama.cpp backend runs GGUF files: {source!r} is neither an embedded model name "
                         f"({', '.join(EMBEDDED)}) nor a local .gguf file")


@dataclass
class GGUFInfo:
    """What LoadedModel carries besides the torch weights: the tokenizer and config the engine reads."""

    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    name: str  # the embedded name, or the path as given
    path: str  # the GGUF file


def gguf_info(source: str, root: Path | None = None) -> GGUFInfo:
    """Tokenizer and config of an embedded model or a .gguf file, read from the GGUF metadata by transformers (the
    same reading convert_gguf saves into the converted cache, so the same tokenizer), without reading a weight."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = resolve_gguf(source, root)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"{source}: could not read the tokenizer and config of {path}: "
                             f"{type(e).__name__}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    return GGUFInfo(tokenizer=tokenizer, hf_config=config, name=source, path=str(path))
