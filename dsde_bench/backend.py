"""What a benchmark drives: an in-process engine, a prompt encoder, and (for the external anchor) the same pair
as transformers models.

    backend = load_backend()            # the embedded Qwen2.5-Coder 0.5B / 1.5B pair, bf16
    backend = tiny_backend()            # random-weight tiny pair, fp32: smoke runs and tests, seconds
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from dsde_core.config import EngineConfig
from dsde_core.cpuinfo import cpu_info
from dsde_core.engine import Engine
from dsde_core.models.loader import DEFAULT_DRAFT, DEFAULT_TARGET
from dsde_core.policies import make_policy

TINY_VOCAB = 96


@dataclass
class Backend:
    engine: Engine
    encode: Callable[[str], list[int]]  # prompt text -> token ids (chat template applied for chat models)
    description: dict[str, Any]
    hf_pair: Callable[[], tuple[Any, Any]] | None = None  # () -> (transformers target, transformers draft)
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def max_batch(self) -> int:
        return self.engine.config.max_batch_size


def machine_info() -> dict[str, Any]:
    """The machine the figures were measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": _cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_info()[0],
        "cpu_flags": _cpu_flags(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        with open("/proc/meminfo") as fh:
            kb = int(fh.readline().split()[1])
        info["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def _cpu_count() -> int | None:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count()


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")  # what sets a CPU's bf16 and int8 speed


def _cpu_flags() -> str:
    """The CPU_FLAGS this CPU reports ('' where /proc/cpuinfo cannot be read)."""
    flags = cpu_info()[1]
    return " ".join(f for f in CPU_FLAGS if f in flags)


def load_backend(draft: str = DEFAULT_DRAFT, target: str = DEFAULT_TARGET, dtype: str = "bfloat16",
                 max_batch: int = 4, max_seq_len: int = 2048, max_sl: int = 20,
                 num_threads: int | None = None, draft_noise: float = 0.0, draft_window: int | None = None,
                 backend: str = "auto", draft_backend: str | None = None, step: str = "eager") -> Backend:
    """The real pair through dsde_core's loader (embedded name, HF directory or GGUF file). draft_noise: Gaussian
    noise on the draft's logits (a deliberately weak draft; the transformers anchor does not see it). draft_window:
    EngineConfig.draft_window (None: off, the default engine; the anchor does not see it either). backend,
    draft_backend: each model's runner (EngineConfig's); the anchor runs transformers on the torch conversion.
    step: the torch runners' step (EngineConfig.step)."""
    from dsde_core.llm import SpeculativeLLM

    config = EngineConfig(max_batch_size=max_batch, max_seq_len=max_seq_len, max_sl=max_sl, dtype=dtype,
                          num_threads=num_threads, draft_logit_noise=draft_noise, draft_window=draft_window,
                          backend=backend, draft_backend=draft_backend, step=step)
    llm = SpeculativeLLM.load(draft=draft, target=target, config=config, policy="off")

    def hf_pair() -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM

        tgt = AutoModelForCausalLM.from_pretrained(hf_dir(llm.target), dtype=config.torch_dtype).eval()
        drf = AutoModelForCausalLM.from_pretrained(hf_dir(llm.draft), dtype=config.torch_dtype).eval()
        return tgt, drf

    desc = {"draft": draft, "target": target, "dtype": dtype, "max_sl": max_sl, "max_seq_len": max_seq_len,
            "backend": llm.target.backend, "draft_backend": llm.draft.backend if llm.draft else None}
    _note_options(desc, draft_noise, draft_window, step)
    return Backend(llm.engine, lambda text: llm.encode(text, chat=True), desc, hf_pair,
                   pad_token_id=llm.tokenizer.eos_token_id)


def _note_options(desc: dict[str, Any], draft_noise: float, draft_window: int | None, step: str) -> None:
    """Name in a backend's description the engine options that are not the default's."""
    if draft_noise:
        desc["draft_noise"] = draft_noise
    if draft_window is not None:
        desc["draft_window"] = draft_window
    if step != "eager":
        desc["step"] = step


def hf_dir(loaded: Any) -> str:
    """The Hugging Face directory of a loaded model, for transformers: its own, or on llama.cpp the GGUF's one-off
    conversion (dsde_core.models.packaged)."""
    if loaded.backend != "llama.cpp":
        return loaded.path
    from dsde_core.models.packaged import EMBEDDED, ensure_embedded, ensure_gguf_file

    name = loaded.name
    return str(ensure_embedded(EMBEDDED[name]) if name in EMBEDDED else ensure_gguf_file(Path(loaded.path)))


# ---- the tiny random pair ------------------------------------------------------------------------------------
class IdTokenizer:
    """Token i reads '<i>': enough for the engine's text stream, for models without a tokenizer (random weights)."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


@lru_cache(maxsize=4)
def _tiny_hf(seed: int, noise: float) -> tuple[Any, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.25, tie_word_embeddings=False)
    target = Qwen2ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    noisy = {k: v + noise * v.std() * torch.randn(v.shape, generator=gen) if v.numel() > 1 else v.clone()
             for k, v in target.state_dict().items()}
    draft = Qwen2ForCausalLM(cfg).float().eval()
    draft.load_state_dict(noisy)
    return target, draft


def _copy(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def tiny_encode(text: str, max_tokens: int = 48) -> list[int]:
    """Bytes of the text mod the tiny vocabulary, head and tail of a long text (the tiny pair has no tokenizer)."""
    data = text.encode("utf-8")
    data = data if len(data) <= max_tokens else data[: max_tokens // 4] + data[-(max_tokens - max_tokens // 4):]
    return [b % TINY_VOCAB for b in data] or [0]


def tiny_backend(max_batch: int = 4, max_seq_len: int = 512, max_sl: int = 20, noise: float = 0.03,
                 seed: int = 0, draft_window: int | None = None, draft_noise: float = 0.0,
                 step: str = "eager") -> Backend:
    """A random-weight 2-layer Qwen2 target and a noisy copy as draft (`noise`: of its weights), fp32: every code path
    in seconds. draft_noise, step: as load_backend's."""
    from dsde_core.models.llama import LlamaModel
    from dsde_core.models.loader import torch_runner
    from dsde_core.workers import DraftWorker, TargetWorker

    hf_target, hf_draft = _tiny_hf(seed, noise)
    target = LlamaModel.from_hf(hf_target.config, _copy(hf_target), dtype=torch.float32)
    draft = LlamaModel.from_hf(hf_draft.config, _copy(hf_draft), dtype=torch.float32)
    config = EngineConfig(max_batch_size=max_batch, max_seq_len=max_seq_len, max_sl=max_sl, dtype="float32",
                          draft_window=draft_window, draft_logit_noise=draft_noise, step=step)
    shape = (max_batch, max_seq_len, step, max_sl + 1)
    engine = Engine(TargetWorker(torch_runner(target, *shape)),
                    DraftWorker.from_config(torch_runner(draft, *shape), config),
                    make_policy("off"), IdTokenizer(), config, vocab_size=TINY_VOCAB)
    desc = {"draft": f"tiny-random(noise={noise})", "target": "tiny-random", "dtype": "float32", "max_sl": max_sl,
            "max_seq_len": max_seq_len}
    _note_options(desc, draft_noise, draft_window, step)
    return Backend(engine, tiny_encode, desc, lambda: (hf_target, hf_draft), pad_token_id=0)
