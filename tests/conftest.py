"""Shared fixtures: tiny random-weight Llama-family models (fp32, seeded) for fast tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Triton kernels (dsde_core/models/triton_attention.py) run under Triton's interpreter on this CPU: set before any
# kernel is decorated, i.e. before dsde_core is imported
os.environ.setdefault("TRITON_INTERPRET", "1")
# a party's bug (an AttributeError, a TypeError...) raises out of the engine's step instead of passing as the
# target-only fallback (dsde_core/recovery.py); fault tests raise the errors a party really may
os.environ.setdefault("DSDE_STRICT_FAULTS", "1")


def tiny_hf_config(arch: str, **overrides):
    """A small transformers config of one architecture: 3 layers, hidden 64, vocab 256, GQA 4/2 heads."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
    )
    if arch == "llama":
        # biases everywhere and llama3 RoPE scaling, to exercise both
        kw = dict(
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        )
        cls = LlamaConfig
    elif arch == "qwen2":
        # tied embeddings; sliding window on layers >= 1 only
        kw = dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=6, max_window_layers=1)
        cls = Qwen2Config
    elif arch == "mistral":
        kw = dict(sliding_window=8, head_dim=32)  # head_dim != hidden / heads
        cls = MistralConfig
    else:
        raise ValueError(arch)
    return cls(**{**common, **kw, **overrides})


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, **overrides)
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def arch(request) -> str:
    return request.param


@pytest.fixture
def make_tiny_model():
    """The factory `tiny_hf_model(arch, seed=0, **config_overrides)` -> a transformers model (fp32, eval)."""
    return tiny_hf_model


def tiny_tokenizer(vocab_size: int = 256, rename: dict[int, str] | None = None):
    """A whitespace word-level tokenizer over tokens "t0".."t{vocab_size-1}" (rename: id -> other token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    for i, tok in (rename or {}).items():
        del vocab[f"t{i}"]
        vocab[tok] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t2")


@pytest.fixture
def save_tiny_model(tmp_path: Path):
    """Factory: save a tiny model (transformers `save_pretrained`) + tokenizer into tmp_path/<name>; returns the dir.

    save(name, model=None, arch="qwen2", tokenizer=None, **config_overrides)
    """

    def save(name: str, model=None, arch: str = "qwen2", tokenizer=None, **overrides) -> Path:
        model = model if model is not None else tiny_hf_model(arch, **overrides)
        out = tmp_path / name
        model.save_pretrained(out)
        (tokenizer or tiny_tokenizer(model.config.vocab_size)).save_pretrained(out)
        return out

    return save


@pytest.fixture
def make_tiny_tokenizer():
    """The factory `tiny_tokenizer(vocab_size=256, rename=None)`."""
    return tiny_tokenizer


_SESSION = pytest.StashKey[pytest.Session]()


def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Once pytest has reported, a process that imported Ray leaves without interpreter finalisation, with pytest's
    own exit status. Several Ray sessions start and stop in this one process (the service and reliability tests), and
    Ray's native threads can outlive a shutdown (ray-project/ray#31145): a clean run of every test once segfaulted at
    exit (a thread executing freed memory), which failed `make test` after "410 passed". Nothing is skipped that a
    test or the report needs: results, the summary and pytest's cache are written before unconfigure."""
    session = config.stash.get(_SESSION, None)
    if session is None or "ray" not in sys.modules:
        return
    ray = sys.modules["ray"]
    if ray.is_initialized():  # what Ray's own atexit hook would do: stop a local cluster a test left running
        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))
