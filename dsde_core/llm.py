"""The Python API: load a draft/target pair, build the engine, generate text.

    llm = SpeculativeLLM.load()                      # the embedded Qwen2.5-Coder 0.5B / 1.5B pair
    [out] = llm.generate(["def fib(n):"], SamplingParams(max_tokens=64), policy="dsde")
    print(out.text, out.stats.acceptance_rate)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dsde_core.config import EngineConfig, SamplingParams, SpeculationParams
from dsde_core.engine import Engine
from dsde_core.models.backends import resolve_backend
from dsde_core.models.loader import DEFAULT_DRAFT, DEFAULT_TARGET, LoadedModel, check_compatible, load_model
from dsde_core.policies import DEFAULT_POLICY, SpeculationPolicy, make_policy
from dsde_core.request import RequestStats
from dsde_core.sampling import TokenLogprob
from dsde_core.workers import DraftWorker, TargetWorker


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per token, where SamplingParams.logprobs asks for them
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first (prompt_logprobs)
    stop_reason: int | str | None = None  # the stop_token_ids token or the stop string that ended it


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """End-of-sequence ids from the tokenizer and the model config (a chat model often has two)."""
    ids: set[int] = set()
    for value in (loaded.tokenizer.eos_token_id, getattr(loaded.hf_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt; with chat=True the prompt is one user message in the chat template."""
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


class SpeculativeLLM:
    """A target model, optionally a draft model, and the engine that runs them together in-process."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, config: EngineConfig,
                 policy: str | SpeculationPolicy = DEFAULT_POLICY) -> None:
        if all(m.backend == "llama.cpp" for m in (target, draft) if m is not None):
            # torch only samples here (small ops): its idle OpenMP threads would spin beside llama.cpp's on the cores
            torch.set_num_threads(1)
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        if draft is not None:
            check_compatible(draft, target)
        self.target, self.draft, self.config = target, draft, config
        shape = (config.max_batch_size, config.max_seq_len, config.num_threads, config.step, config.max_sl + 1)
        target_runner = target.make_runner(*shape)
        draft_worker = DraftWorker.from_config(draft.make_runner(*shape), config) if draft is not None else None
        self.engine = Engine(
            TargetWorker(target_runner), draft_worker, _policy(policy), target.tokenizer, config,
            eos_ids=eos_token_ids(target), vocab_size=target_runner.vocab_size,
        )

    @classmethod
    def load(cls, draft: str | None = DEFAULT_DRAFT, target: str = DEFAULT_TARGET,
             config: EngineConfig | None = None, policy: str | SpeculationPolicy = DEFAULT_POLICY
             ) -> SpeculativeLLM:
        """Load models by embedded name, Hugging Face directory or GGUF file. draft=None: target only."""
        config = config or EngineConfig()
        # the draft first: smaller, so a bad path fails faster
        drf = None
        if draft:
            backend = resolve_backend(config.draft_backend or config.backend, draft, config.device, config.dtype)
            drf = load_model(draft, config.torch_dtype, config.device, config.draft_quantize, backend)
        backend = resolve_backend(config.backend, target, config.device, config.dtype)
        tgt = load_model(target, config.torch_dtype, config.device, backend=backend)
        return cls(tgt, drf, config, policy)

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        policy: str | SpeculationPolicy | None = None,
        chat: bool = False,
        spec: SpeculationParams | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids) in one continuous batch; results in prompt order."""
        if policy is not None:
            self.engine.set_policy(_policy(policy))
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        reqs = []
        for prompt, p in zip(prompts, plist, strict=True):
            ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
            reqs.append(self.engine.add_request(ids, p, spec))
        self.engine.run()
        return [GenerationResult(r.text, list(r.output_ids), len(r.prompt_ids), r.finish_reason or "", r.stats,
                                 None if r.params.logprobs is None else r.logprobs, r.prompt_logprobs, r.stop_reason)
                for r in reqs]


def _policy(policy: str | SpeculationPolicy) -> SpeculationPolicy:
    return make_policy(policy) if isinstance(policy, str) else policy
