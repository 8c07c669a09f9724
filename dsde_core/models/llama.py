"""A compact forward pass for the Llama family (Llama, Qwen2, Mistral) over a slot-based KV cache.

Query tokens of all sequences are packed into one [T, hidden] tensor for the linear layers. Attention runs per
group of sequences (runner.py forms them: a long prompt apart from the rows decoding beside it): it scatters the
group's queries into a padded [Bg, Qmax] layout, gathers each sequence's keys [0 : len + q_len] from the cache and
runs SDPA with a boolean mask (in fp32 where every row has one query, on the CPU: Attention.forward). A runner made
with attention="triton" runs the decoding and verifying rows' group through triton_attention.py's kernel instead,
which reads each row's length at run time and needs neither the gather nor a mask.
The logits are computed only at the rows the caller asks for.
Weights use transformers' names (model.layers.N.self_attn.q_proj.weight, ...); q/k/v and gate/up are fused
at load time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsde_core.errors import ConfigError, ModelLoadError, UnsupportedArchitectureError
from dsde_core.models.quant import Int8Linear, int8_supported
from dsde_core.models.triton_attention import decode_attention

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# RoPE types whose frequencies change with the sequence length: not implemented.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass
class ModelArgs:
    """The architecture, read from a transformers config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    rope_type: str
    rope_theta: float

    @classmethod
    def from_hf(cls, config) -> ModelArgs:
        model_type = getattr(config, "model_type", None)
        check_supported(model_type)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            attn_bias = bool(getattr(config, "attention_bias", False))
            qkv_bias, o_bias, mlp_bias = attn_bias, attn_bias, bool(getattr(config, "mlp_bias", False))
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if window is None:
            windows: tuple[int | None, ...] = (None,) * config.num_hidden_layers
        elif layer_types is not None:  # qwen2: only "sliding_attention" layers (>= max_window_layers)
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:  # mistral: every layer
            windows = (window,) * config.num_hidden_layers
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if "rope_theta" not in rope:
            raise UnsupportedArchitectureError(
                f"{model_type}: rope_parameters {rope!r} has no flat rope_theta (per-layer RoPE is not supported)"
            )
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise UnsupportedArchitectureError(
                f"{model_type}: RoPE type {rope_type!r} is not supported (its frequencies depend on the length)"
            )
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            hidden_act=getattr(config, "hidden_act", "silu"),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_windows=windows,
            rope_type=rope_type,
            rope_theta=float(rope["rope_theta"]),
        )


def check_supported(model_type: str | None) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def rope_inv_freq(args: ModelArgs, config=None) -> tuple[Tensor, float]:
    """inv_freq [head_dim // 2] (float32, cpu) and the attention scaling applied to cos/sin."""
    if args.rope_type == "default":
        dim = args.head_dim
        return 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if args.rope_type not in ROPE_INIT_FUNCTIONS or config is None:
        raise UnsupportedArchitectureError(f"RoPE type {args.rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[args.rope_type](config, torch.device("cpu"))
    return inv_freq.float().cpu(), float(scaling)


@dataclass
class AttnGroup:
    """Sequences whose attention is one SDPA call, their queries padded to the group's longest. G = the group's
    query tokens, Bg its sequences."""

    max_q: int  # Qmax of the group
    max_k: int  # Kmax = max(len + q_len) over the group
    masks: dict[int | None, Tensor | None]  # window -> [Bg, 1, Qmax, Kmax] bool (True = attend); None: no mask
    rows: Tensor | None = None  # [G] rows of T in the group, in order; None: every row of T
    single: tuple[int, int] | None = None  # one sequence: (slot, len + q_len), its keys read by slicing
    slots: Tensor | None = None  # [Bg] long; more than one sequence: their keys gathered
    q_dest: Tensor | None = None  # [G] row in the padded [Bg * Qmax] layout; None when every q_len == Qmax
    upcast: bool = False  # attention in fp32 (Attention.forward): one query a row, a half dtype, on the CPU
    causal: bool = False  # one sequence from position 0, no mask: SDPA's is_causal
    kernel: tuple[Tensor, Tensor, Tensor] | None = None  # (slots, lens, qlens) [Bg] int32: the Triton kernel attends
    # (triton_attention.decode_attention reads the lengths at run time; no masks are built)


@dataclass
class Batch:
    """Per-call metadata shared by every layer. T = packed query tokens, B = sequences, N = logits rows."""

    input_ids: Tensor  # [T] long
    cos: Tensor  # [T, 1, head_dim] model dtype
    sin: Tensor  # [T, 1, head_dim]
    groups: list[AttnGroup]  # attention: one SDPA call each (a long prompt apart from the rows decoding beside it)
    logits_idx: Tensor  # [N] rows of T whose logits are returned
    # the cache's writes: B == 1 by slicing (slot, start, q_len); B > 1 by index
    single: tuple[int, int, int] | None = None
    write_slots: Tensor | None = None  # [T] slot of each query token
    write_pos: Tensor | None = None  # [T] cache position of each query token


class PackedLinear(nn.Module):
    """A CPU Linear whose weight is pre-packed into oneDNN's blocked layout: the same result, faster than `F.linear`
    from batch-1 decode (GEMV) to prefill, as the weight is not re-laid out at every call. Inference only: the packed
    weight is opaque (no state_dict, no `.to()`)."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 1)  # opaque, plain attribute
        self.bias = None if lin.bias is None else lin.bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN weight packing is available for Linear layers of this dtype on this device."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return bool(ops._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [T, D] -> weight * x / rms(x), in transformers' op order: normalize in fp32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + residual, its rms_norm): a residual add and the norm after it."""
    x = x + residual
    return x, rms_norm(x, weight, eps)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(qk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """qk [T, heads, hd] rotated by its positions' cos, sin [T, 1, hd]."""
    return qk * cos + rotate_half(qk) * sin


def act_mul(gate_up: Tensor, act: nn.Module) -> Tensor:
    """[T, 2 * I] (gate ; up) -> act(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


@dataclass(frozen=True)
class SmallOps:
    """The per-layer small ops between the matmuls. Eager by default; LlamaModel.fuse swaps in fused_ops()'s, each
    compiled by torch.compile into a kernel or two (on a GPU: a few launches a layer fewer, under a captured graph)."""

    rms_norm: Callable[..., Tensor] = rms_norm
    add_rms_norm: Callable[..., tuple[Tensor, Tensor]] = add_rms_norm
    rope: Callable[..., Tensor] = rope
    act_mul: Callable[..., Tensor] = act_mul


EAGER = SmallOps()


@lru_cache(maxsize=1)
def fused_ops() -> SmallOps:
    """SmallOps compiled once a process (dynamic in the token count, so every bucket shares one compilation)."""
    return SmallOps(*(torch.compile(f, dynamic=True) for f in (rms_norm, add_rms_norm, rope, act_mul)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = EAGER

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, window: int | None) -> None:
        super().__init__()
        self.h, self.kvh, self.hd = a.num_heads, a.num_kv_heads, a.head_dim
        self.window = window
        self.wqkv = nn.Linear(a.hidden_size, (self.h + 2 * self.kvh) * self.hd, bias=a.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.hd, a.hidden_size, bias=a.o_bias)
        self.ops = EAGER

    def forward(self, x: Tensor, b: Batch, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        # x [T, D]; k_cache, v_cache [num_slots, kvh, max_seq_len, hd] (this layer)
        T, h, kvh, hd = x.shape[0], self.h, self.kvh, self.hd
        qkv = self.wqkv(x)
        qk = qkv[:, : (h + kvh) * hd].view(T, h + kvh, hd)
        qk = self.ops.rope(qk, b.cos, b.sin)  # RoPE on q and k at once
        q, k = qk[:, :h], qk[:, h:]  # [T, h, hd], [T, kvh, hd]
        v = qkv[:, (h + kvh) * hd :].view(T, kvh, hd)
        if b.single is not None:
            slot, start, n = b.single
            k_cache[slot, :, start : start + n] = k.transpose(0, 1)
            v_cache[slot, :, start : start + n] = v.transpose(0, 1)
        else:
            k_cache[b.write_slots, :, b.write_pos] = k
            v_cache[b.write_slots, :, b.write_pos] = v
        if len(b.groups) == 1:
            return self.o_proj(self._attend(q, b.groups[0], k_cache, v_cache))
        o = q.new_empty(T, h * hd)
        for g in b.groups:
            o.index_copy_(0, g.rows, self._attend(q.index_select(0, g.rows), g, k_cache, v_cache))
        return self.o_proj(o)

    def _attend(self, q: Tensor, g: AttnGroup, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """q [G, h, hd], the group's queries, after the cache holds their keys -> attention output [G, h * hd]."""
        h, hd, Qm = q.shape[1], q.shape[2], g.max_q
        if g.kernel is not None:
            Bg = g.kernel[0].shape[0]
        elif g.single is not None:
            (slot, end), Bg = g.single, 1
            keys, vals = k_cache[slot : slot + 1, :, :end], v_cache[slot : slot + 1, :, :end]  # [1, kvh, K, hd]
        else:
            Bg = g.slots.shape[0]
            keys = k_cache[:, :, : g.max_k].index_select(0, g.slots)  # [Bg, kvh, Kmax, hd]
            vals = v_cache[:, :, : g.max_k].index_select(0, g.slots)
        if g.q_dest is not None:
            q = q.new_zeros(Bg * Qm, h, hd).index_copy_(0, g.q_dest, q)
        if g.kernel is not None:
            o = decode_attention(q.view(Bg, Qm, h, hd), k_cache, v_cache, *g.kernel, window=self.window)
            o = o.reshape(Bg * Qm, h * hd)  # [Bg * Qmax, h * hd]
            return o if g.q_dest is None else o.index_select(0, g.q_dest)
        qp = q.view(Bg, Qm, h, hd).transpose(1, 2)  # [Bg, h, Qmax, hd]
        mask, gqa = g.masks[self.window], self.kvh != h
        if g.upcast:
            # PyTorch's CPU SDPA in bf16 takes a slow path for one query row, several times slower than two rows or
            # than this fp32 call with its casts. Decode and draft steps are one row.
            o = F.scaled_dot_product_attention(qp.float(), keys.float(), vals.float(), attn_mask=mask, enable_gqa=gqa)
            o = o.to(q.dtype)
        else:
            o = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=mask, is_causal=g.causal, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(Bg * Qm, h * hd)  # [Bg * Qmax, h * hd]
        return o if g.q_dest is None else o.index_select(0, g.q_dest)  # [G, h * hd]


class MLP(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.act = ACT2FN[a.hidden_act]
        self.w13 = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)  # gate ; up
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        self.ops = EAGER

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.ops.act_mul(self.w13(x), self.act))


class Block(nn.Module):
    def __init__(self, a: ModelArgs, window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a, window)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)
        self.ops = EAGER

    def forward(self, x: Tensor, b: Batch, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        norm = self.post_attention_layernorm
        x, h = self.ops.add_rms_norm(x, self.self_attn(self.input_layernorm(x), b, k_cache, v_cache), norm.weight,
                                     norm.eps)
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    """Llama / Qwen2 / Mistral decoder + lm_head. Build with `from_hf(config, state_dict)`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, w) for w in args.sliding_windows)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.inv_freq = torch.empty(0)  # [head_dim // 2] float32 cpu, set by from_hf
        self.attention_scaling = 1.0
        self.packed = False  # Linears swapped for PackedLinear (see prepack)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @classmethod
    def from_hf(
        cls,
        config,
        state_dict: dict[str, Tensor],
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        prepack: bool | None = None,
        quantize: str | None = None,
    ) -> LlamaModel:
        """Build from a transformers config and a state dict in transformers' names.

        Entries are popped from `state_dict` as they are consumed, so the caller's dict does not keep a
        second copy of the weights alive. prepack: pack the Linear weights for oneDNN (see `prepack`);
        None = when available (CPU), True = required, False = keep plain `nn.Linear`s.
        """
        args = ModelArgs.from_hf(config)
        with torch.device("meta"):
            model = cls(args)
        sd = _fuse_hf_state_dict(args, state_dict, dtype, torch.device(device))
        model.load_state_dict(sd, strict=True, assign=True)
        if args.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.inv_freq, model.attention_scaling = rope_inv_freq(args, config)
        model.eval().requires_grad_(False)
        if quantize is not None:
            model.quantize(quantize)  # on the plain weights, before packing
        if prepack is None or prepack:
            model.prepack(required=bool(prepack))
        return model

    def linears(self) -> list[tuple[nn.Module, str]]:
        """(parent, attribute) of every Linear-like layer: 4 per block and the lm_head."""
        out: list[tuple[nn.Module, str]] = []
        for block in self.layers:
            attn, mlp = block.self_attn, block.mlp
            out += [(attn, "wqkv"), (attn, "o_proj"), (mlp, "w13"), (mlp, "down_proj")]
        return out + [(self, "lm_head")]

    def quantize(self, kind: str) -> None:
        """Weight-only int8 for batch-small decode (see quant.py); for a draft model only, never the target.
        Must run on the plain weights: call it before `prepack` packs them (from_hf keeps both in order)."""
        if kind != "int8":
            raise ConfigError(f"quantize must be 'int8', got {kind!r}")
        if not int8_supported(self.device):
            raise ConfigError(f"int8 weight-only kernels are not available on {self.device}")
        if self.packed:
            raise ConfigError("quantize() needs the plain weights: call it before prepack()")
        for parent, name in self.linears():
            lin = getattr(parent, name)
            setattr(parent, name, Int8Linear(lin, fallback=lin))

    def prepack(self, required: bool = False) -> bool:
        """Swap every Linear for a PackedLinear (CPU, oneDNN). Returns whether it did; checks one layer's result
        against `F.linear` first and keeps plain Linears when packing is unavailable or disagrees."""
        if self.packed:
            return True
        ok = can_prepack(self.dtype, self.device)
        if ok:
            lin = self.layers[0].self_attn.wqkv
            lin = lin.fallback if isinstance(lin, Int8Linear) else lin
            x = torch.randn(3, lin.in_features, dtype=self.dtype, device=self.device)
            try:
                with torch.inference_mode():
                    ok = torch.allclose(PackedLinear(lin)(x).float(), lin(x).float(), rtol=1e-2, atol=1e-2)
            except RuntimeError:
                ok = False
        if not ok:
            if required:
                raise ConfigError(f"oneDNN weight packing is not available for {self.dtype} on {self.device}")
            return False
        for parent, name in self.linears():
            layer = getattr(parent, name)
            if isinstance(layer, Int8Linear):
                layer.fallback = PackedLinear(layer.fallback)  # the bf16 path for many rows
            else:
                setattr(parent, name, PackedLinear(layer))
        self.packed = True
        return True

    def fuse(self, on: bool = True) -> None:
        """Run the small ops between the matmuls compiled (fused_ops) or, with on=False, eager again. For a GPU,
        under the static step's captured graphs (static_step.py); the first call of each op compiles it (seconds)."""
        ops = fused_ops() if on else EAGER
        for m in self.modules():
            if isinstance(getattr(m, "ops", None), SmallOps):
                m.ops = ops

    def rope_tables(self, max_seq_len: int) -> tuple[Tensor, Tensor]:
        """cos, sin [max_seq_len, head_dim] in the model's dtype, computed as transformers does (fp32, then cast)."""
        pos = torch.arange(max_seq_len, dtype=torch.float, device=self.device)
        freqs = pos[:, None] * self.inv_freq.to(self.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(self.dtype), sin.to(self.dtype)

    def forward(self, b: Batch, k_cache: Tensor, v_cache: Tensor, hidden: bool = False) -> Tensor:
        """Returns float32 logits [N, vocab] at rows b.logits_idx, or with `hidden` the final-norm hidden states
        [N, D] there (`head` makes their logits, a few rows at a time). k_cache, v_cache [L, S, kvh, M, hd]."""
        x = self.embed_tokens(b.input_ids)  # [T, D]
        for i, layer in enumerate(self.layers):
            x = layer(x, b, k_cache[i], v_cache[i])
        if b.logits_idx.shape[0] != x.shape[0]:
            x = x.index_select(0, b.logits_idx)  # [N, D]: the lm_head only where asked
        x = self.norm(x)
        return x if hidden else self.head(x)

    def head(self, h: Tensor) -> Tensor:
        """Final-norm hidden states [N, D] -> float32 logits [N, vocab]."""
        return self.lm_head(h).float()


def _fuse_hf_state_dict(
    args: ModelArgs, sd: dict[str, Tensor], dtype: torch.dtype, device: torch.device
) -> dict[str, Tensor]:
    """transformers' names -> ours (fused wqkv and w13), as fresh copies in dtype on device; consumes `sd`.

    Copying also moves weights that transformers left memory-mapped from the checkpoint file into ordinary
    memory (a few % faster decode on CPU) and lets the caller's model free them tensor by tensor.
    """
    sd = {k.removeprefix("model."): sd.pop(k) for k in list(sd)}  # empties the caller's dict
    missing: list[str] = []

    def take(name: str, copy: bool = True) -> Tensor:
        if name not in sd:
            missing.append(name)
            return torch.empty(0, device=device, dtype=dtype)
        return sd.pop(name).to(device=device, dtype=dtype, copy=copy)

    def cat(*names: str) -> Tensor:
        return torch.cat([take(n, copy=False) for n in names], dim=0)

    out: dict[str, Tensor] = {"embed_tokens.weight": take("embed_tokens.weight")}
    for i in range(args.num_layers):
        p, a, m = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        out[a + "wqkv.weight"] = cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
        if args.qkv_bias:
            out[a + "wqkv.bias"] = cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
        out[a + "o_proj.weight"] = take(a + "o_proj.weight")
        if args.o_bias:
            out[a + "o_proj.bias"] = take(a + "o_proj.bias")
        out[m + "w13.weight"] = cat(m + "gate_proj.weight", m + "up_proj.weight")
        out[m + "down_proj.weight"] = take(m + "down_proj.weight")
        if args.mlp_bias:
            out[m + "w13.bias"] = cat(m + "gate_proj.bias", m + "up_proj.bias")
            out[m + "down_proj.bias"] = take(m + "down_proj.bias")
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = take(p + n)
    out["norm.weight"] = take("norm.weight")
    head = sd.pop("lm_head.weight", None)
    if args.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    elif head is None:
        missing.append("lm_head.weight")
    else:
        out["lm_head.weight"] = head.to(device=device, dtype=dtype, copy=True)
    if missing:
        raise ModelLoadError(f"state dict lacks {len(missing)} weights, e.g. {missing[:3]}")
    unused = [k for k in sd if "rotary_emb" not in k]
    if unused:
        raise ModelLoadError(f"state dict has {len(unused)} weights the model does not use, e.g. {unused[:3]}")
    return out
