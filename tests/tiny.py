"""Tiny random-weight models for fast engine tests: a target and a draft that is the target plus noise,
so that draft and target agree often but not always (every accept/reject path runs)."""

from __future__ import annotations

import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dsde_bench.backend import IdTokenizer
from dsde_core.config import EngineConfig
from dsde_core.engine import Engine
from dsde_core.models.llama import LlamaModel
from dsde_core.models.runner import ModelRunner, Runner
from dsde_core.models.static_step import StaticRunner
from dsde_core.policies import SpeculationPolicy, make_policy
from dsde_core.workers import DraftWorker, TargetWorker

VOCAB = 96
DEVICE = os.environ.get("DSDE_TEST_DEVICE", "cpu")  # "cuda": the engine tests on a GPU (benchmarks/gpu_check.sh)


@lru_cache(maxsize=4)
def tiny_state(seed: int = 0) -> tuple[Qwen2Config, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.25, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).float().eval()
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}


@lru_cache(maxsize=1)
def hf_target() -> Qwen2ForCausalLM:
    """The tiny target as transformers' own model: the independent reference for the engine's outputs."""
    config, state = tiny_state()
    model = Qwen2ForCausalLM(config).float().eval()
    model.load_state_dict(state)
    return model.to(DEVICE)


def tiny_pair(noise: float = 0.03, seed: int = 0) -> tuple[LlamaModel, LlamaModel]:
    """(target, draft) in fp32; the draft is the target with Gaussian noise added to every weight."""
    config, state = tiny_state(seed)
    target = LlamaModel.from_hf(config, dict(state), dtype=torch.float32, device=DEVICE)
    draft = LlamaModel.from_hf(config, noisy_state(noise, seed), dtype=torch.float32, device=DEVICE)
    return target, draft


def noisy_state(noise: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny target's weights with Gaussian noise on every weight: the draft's."""
    _, state = tiny_state(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return {k: v + noise * v.std() * torch.randn(v.shape, generator=gen) if v.numel() > 1 else v.clone()
            for k, v in state.items()}


@lru_cache(maxsize=8)
def tiny_gguf_pair(noise: float = 0.03, seed: int = 0) -> tuple[Path, Path]:
    """(target, draft) of tiny_pair as F32 GGUF files, for the llama.cpp backend (written once per process)."""
    from tests.tiny_gguf import write_qwen2_gguf

    config, state = tiny_state(seed)
    out = Path(tempfile.mkdtemp(prefix="dsde-tiny-gguf-"))
    tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(VOCAB)]  # any distinct names; one merge
    return (write_qwen2_gguf(out / "target.gguf", config, state, tokens, merges=["a a"]),
            write_qwen2_gguf(out / "draft.gguf", config, noisy_state(noise, seed), tokens, merges=["a a"]))


def tiny_runners(batch: int, max_seq_len: int, noise: float = 0.03, backend: str = "torch") -> tuple[Runner, Runner]:
    """(target, draft) runners of the tiny pair on one backend: "torch" (fp32) or "llama.cpp" (F32 GGUF, one thread:
    the tiny forwards are too small to share)."""
    if backend == "llama.cpp":
        from dsde_core.models.llama_cpp import LlamaCppRunner

        return tuple(LlamaCppRunner(p, batch, max_seq_len, threads=1) for p in tiny_gguf_pair(noise))
    target, draft = tiny_pair(noise)
    return ModelRunner(target, batch, max_seq_len), ModelRunner(draft, batch, max_seq_len)


def tiny_engine(policy: str | SpeculationPolicy = "dsde", batch: int = 4, max_seq_len: int = 256,
                noise: float = 0.03, eos: tuple[int, ...] = (), with_draft: bool = True, backend: str = "torch",
                **cfg) -> Engine:
    target, draft = tiny_runners(batch, max_seq_len, noise, backend)
    config = EngineConfig(max_batch_size=batch, max_seq_len=max_seq_len, dtype="float32", device=DEVICE,
                          backend=backend, **cfg)
    draft_worker = DraftWorker.from_config(draft, config) if with_draft else None
    pol = make_policy(policy) if isinstance(policy, str) else policy
    return Engine(TargetWorker(target), draft_worker, pol, IdTokenizer(), config, eos_ids=eos, vocab_size=VOCAB)


def static_engine(policy: str, batch: int = 4, max_seq_len: int = 128, max_sl: int = 4) -> Engine:
    """An engine of the tiny pair (fp32, on the CPU) whose workers run the static step (StaticRunner)."""
    target, draft = tiny_pair()
    config = EngineConfig(max_batch_size=batch, max_seq_len=max_seq_len, dtype="float32", max_sl=max_sl)
    return Engine(TargetWorker(StaticRunner(target, batch, max_seq_len, max_sl + 1)),
                  DraftWorker.from_config(StaticRunner(draft, batch, max_seq_len, max_sl + 1), config),
                  make_policy(policy), IdTokenizer(), config, vocab_size=VOCAB)


def random_prompts(n: int, seed: int = 0, min_len: int = 2, max_len: int = 40) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (m,), generator=gen).tolist() for m in lens]


class FakeClock:
    """time.perf_counter that moves only when a model runs or the engine sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s

    def timed(self, runner: Runner, fixed_s: float, per_token_s: float) -> Runner:
        """The runner, its forward charging fixed_s + per_token_s per query token."""
        forward = runner.forward

        def run(slots: list[int], tokens: list[list[int]], num_logits: list[int], **kw: Any) -> Any:
            self.now += fixed_s + per_token_s * sum(len(t) for t in tokens)
            return forward(slots, tokens, num_logits, **kw)

        runner.forward = run
        return runner
