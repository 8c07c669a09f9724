"""load_model: an embedded model name, a local Hugging Face directory or a local .gguf file -> LlamaModel + tokenizer.

- Embedded names (DEFAULT_DRAFT, DEFAULT_TARGET): joined from their part packages, verified and converted once
  into $XDG_CACHE_HOME/dsde/models/<name>/ (see packaged.py); later loads read that directory.
- A .gguf file: converted once through transformers into $XDG_CACHE_HOME/dsde/models/gguf/<stem>-<key>/, the key
  being a hash of the file's absolute path, size and mtime (a changed file is converted again).
- A directory: read with transformers (never with remote code).

With backend="llama.cpp" (models/backends.py) an embedded name or a .gguf file is not converted: the GGUF is run as
it is by llama.cpp, and only its tokenizer and config are read (from the GGUF's metadata, by transformers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dsde_core.errors import ConfigError, ModelLoadError, UnsupportedArchitectureError, VocabularyMismatchError
from dsde_core.models.llama import SUPPORTED_MODEL_TYPES, LlamaModel, check_supported
from dsde_core.models.packaged import EMBEDDED, ensure_embedded, ensure_gguf_file

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from dsde_core.models.runner import Runner

DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"

# general.architecture values of GGUF files we can run (Mistral GGUFs usually say "llama")
_GGUF_ARCHS = ("llama", "qwen2", "mistral")


@dataclass
class LoadedModel:
    model: LlamaModel | None  # the torch weights; None on the llama.cpp backend (the GGUF file holds them)
    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    name: str  # the embedded name, or the path as given
    path: str = ""  # the Hugging Face directory the weights were read from, or the GGUF file llama.cpp runs
    backend: str = "torch"  # "torch" or "llama.cpp" (models/backends.py)

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits."""
        return self.model.args.vocab_size if self.model is not None else int(self.hf_config.vocab_size)

    def make_runner(self, num_slots: int, max_seq_len: int, threads: int | None = None, step: str = "eager",
                    max_query: int = 1) -> Runner:
        """The runner of this model over num_slots KV slots of max_seq_len positions each. threads: llama.cpp's
        (default: every core this process may use; torch's are set process-wide by the caller). step "static" (torch
        only): the static step with query buckets up to max_query (1 + max_sl); on CUDA with the Triton attention
        kernel, fused small ops and every bucket captured as a CUDA graph here, at start-up."""
        if self.backend == "llama.cpp":
            if step != "eager":
                raise ConfigError(f"step {step!r} runs the torch forward; {self.name} runs on llama.cpp", "step")
            from dsde_core.models.llama_cpp import LlamaCppRunner

            return LlamaCppRunner(self.path, num_slots, max_seq_len, threads=threads)
        assert self.model is not None
        return torch_runner(self.model, num_slots, max_seq_len, step, max_query)


def torch_runner(model: LlamaModel, num_slots: int, max_seq_len: int, step: str = "eager",
                 max_query: int = 1) -> Runner:
    """The torch runner of `model` for `step` (EngineConfig.step): the eager ModelRunner, or the static step with query
    buckets up to max_query; on CUDA that one runs the Triton attention kernel and fused small ops, every bucket
    captured as a CUDA graph here, at start-up."""
    from dsde_core.models.runner import ModelRunner

    if step == "eager":
        return ModelRunner(model, num_slots, max_seq_len)
    from dsde_core.models import triton_attention
    from dsde_core.models.static_step import StaticRunner

    cuda = model.device.type == "cuda"
    runner = StaticRunner(model, num_slots, max_seq_len, max_query,
                          attention="triton" if cuda and triton_attention.available() else "torch",
                          graphs=cuda, fuse=cuda)
    runner.capture()
    return runner


def load_model(
    source: str, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", quantize: str | None = None,
    backend: str = "torch",
) -> LoadedModel:
    """Load an embedded model by name, a local HF model directory or a local .gguf file.
    quantize="int8": weight-only int8 (models/quant.py) — for a torch draft model only. backend: "torch" or
    "llama.cpp" (resolved: models/backends.py); llama.cpp takes the GGUF as it is, whatever dtype and quantize say."""
    if backend == "llama.cpp":
        from dsde_core.models.llama_cpp import gguf_info

        info = gguf_info(source)
        return LoadedModel(None, info.tokenizer, info.hf_config, info.name, info.path, backend="llama.cpp")
    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ModelLoadError(f"dtype {dtype} is not supported; use torch.bfloat16 or torch.float32")
    check_device(device)
    if source in EMBEDDED:
        return load_hf_dir(ensure_embedded(EMBEDDED[source]), dtype, device, name=source, quantize=quantize)
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        return load_hf_dir(path, dtype, device, name=source, quantize=quantize)
    if path.is_file() and path.suffix.lower() == ".gguf":
        check_gguf_arch(path)
        try:
            hf_dir = ensure_gguf_file(path)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"could not convert GGUF file {source}: {type(e).__name__}: {e}") from e
        return load_hf_dir(hf_dir, dtype, device, name=source, quantize=quantize)
    raise ModelLoadError(
        f"cannot load model {source!r}: it is not an embedded model name ({', '.join(EMBEDDED)}), "
        f"not a local Hugging Face model directory and not a local .gguf file"
    )


def model_source_exists(source: str) -> bool:
    """Whether load_model finds something to load at `source`: an embedded name, or a Hugging Face directory or a
    .gguf file on this machine (its three kinds, checked before any model loads)."""
    path = Path(os.path.expanduser(source))
    return source in EMBEDDED or path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")


def check_device(device: str) -> None:
    """ModelLoadError, before any weights are read, unless this process can place tensors on `device`."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "this process sees no CUDA GPU"
        raise ModelLoadError(f"device {device!r}: {why}; use device 'cpu'")
    index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
    if index >= count:
        raise ModelLoadError(f"device {device!r}: this process sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")


def check_gguf_arch(path: Path) -> None:
    """UnsupportedArchitectureError before converting a GGUF whose general.architecture we cannot run."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except Exception as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from e
    if arch not in _GGUF_ARCHS:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_GGUF_ARCHS)}"
        )


def load_hf_dir(
    path: str | Path, dtype: torch.dtype, device: str, name: str, quantize: str | None = None
) -> LoadedModel:
    """Config first (architecture check before any weight is read), then weights into our LlamaModel."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = str(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"{name}: no usable config.json in {path}: {type(e).__name__}: {e}") from e
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{name}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"{name}: no usable tokenizer in {path}: {type(e).__name__}: {e}") from e
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"{name}: could not read the weights in {path}: {type(e).__name__}: {e}") from e
    hf_config = hf.config
    check_supported(hf_config.model_type)
    state_dict = hf.state_dict()
    del hf  # from here on `state_dict` holds the only reference; from_hf consumes it
    model = LlamaModel.from_hf(hf_config, state_dict, dtype=dtype, device=device, quantize=quantize)
    return LoadedModel(model=model, tokenizer=tokenizer, hf_config=hf_config, name=name, path=path)


def check_compatible(draft: LoadedModel, target: LoadedModel) -> None:
    """VocabularyMismatchError unless draft and target have the same logits width and the same tokens."""
    dv, tv = draft.vocab_size, target.vocab_size
    if dv != tv:
        raise VocabularyMismatchError(
            f"draft {draft.name} has vocab size {dv}, target {target.name} has {tv}: "
            f"speculative decoding needs the same vocabulary"
        )
    d_tok = {i: t for t, i in draft.tokenizer.get_vocab().items()}
    t_tok = {i: t for t, i in target.tokenizer.get_vocab().items()}
    if d_tok != t_tok:
        diff = sorted(i for i in d_tok.keys() | t_tok.keys() if d_tok.get(i) != t_tok.get(i))
        i = diff[0]
        raise VocabularyMismatchError(
            f"draft {draft.name} and target {target.name} tokenizers differ at {len(diff)} token ids, first at id "
            f"{i}: draft {d_tok.get(i)!r} vs target {t_tok.get(i)!r}"
        )
