"""Tiny random Qwen2 models as GGUF files, for the llama.cpp backend's tests: the same weights as a transformers
state dict, written as F32 tensors under llama.cpp's qwen2 names (no Q/K permutation: qwen2 uses NeoX RoPE, as
transformers does)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# transformers' per-layer names -> llama.cpp's (blk.N.<name>)
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
          **{f"self_attn.{p}_proj.{w}": f"attn_{p}.{w}" for p in "qkv" for w in ("weight", "bias")}}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def write_qwen2_gguf(path: Path, config, state: dict[str, torch.Tensor], tokens: list[str] = (),
                     merges: list[str] = (), specials: int = 0, tokenizer_of: Path | None = None) -> Path:
    """A Qwen2 `config` + `state` as an F32 GGUF at `path`, with a byte-level BPE vocabulary of `tokens` (the last
    `specials` of them control tokens) and `merges` (llama.cpp needs a vocabulary to load a model, though the engine
    never asks it to tokenize), or with every tokenizer field of the GGUF file `tokenizer_of` (a real tokenizer and
    chat template, which transformers reads back)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer_of is not None:
        for key, field in gguf.GGUFReader(tokenizer_of).fields.items():
            if key.startswith("tokenizer."):
                w.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - specials) + [gguf.TokenType.CONTROL] * specials)
        w.add_token_merges(list(merges))
        if config.eos_token_id is not None:
            w.add_eos_token_id(config.eos_token_id)
            w.add_bos_token_id(config.bos_token_id if config.bos_token_id is not None else config.eos_token_id)
        w.add_add_bos_token(False)
    for k, v in state.items():
        if k in _TOP:
            name = _TOP[k]
        else:
            _, _, layer, rest = k.split(".", 3)  # model.layers.N.<rest>
            name = f"blk.{layer}.{_LAYER[rest]}"
        w.add_tensor(name, v.detach().cpu().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
