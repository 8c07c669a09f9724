"""Greedy speculation on the llama.cpp backend with the real embedded pair: its output is the target's as llama.cpp
computes it. llama.cpp's kernels round a verify batch of several tokens differently from one token decoded alone
(other GEMM and attention paths), so where the two outputs part, the target's two candidates there must be a near-tie:
decoded exactly as target-only decoding did (the prompt, then one token a forward), their logits lie within NEAR_TIE."""

from __future__ import annotations

import importlib.util

import pytest

from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.llm import SpeculativeLLM

pytestmark = [pytest.mark.real_models,
              pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed (make setup builds it)")]

NEAR_TIE = 1.0  # logits: a verify batch's rounding moves the target's logits by up to ~0.7 on these Q4_K_M files
PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain in two sentences what a hash table is."]


@pytest.fixture(scope="module")
def llm() -> SpeculativeLLM:
    return SpeculativeLLM.load(config=EngineConfig(max_batch_size=1, backend="llama.cpp"), policy="off")


@pytest.mark.parametrize("policy", ["static:4", "dsde-goodput"])
def test_greedy_speculation_is_the_targets_output_up_to_near_ties(llm: SpeculativeLLM, policy: str) -> None:
    params = SamplingParams(max_tokens=40)
    runner = llm.engine.target.runner
    drafted = 0
    for text in PROMPTS:
        ids = llm.encode(text, chat=True)
        [ref] = llm.generate([ids], params, policy="off")
        [out] = llm.generate([ids], params, policy=policy)
        drafted += out.stats.drafted
        i = next((j for j, (a, b) in enumerate(zip(ref.token_ids, out.token_ids, strict=False)) if a != b), None)
        if i is None:
            assert out.token_ids == ref.token_ids
            continue
        runner.set_length(0, 0)  # target-only's forwards again, up to the position where the outputs part
        logits = runner.forward([0], [ids], [1])[0]
        for t in ref.token_ids[:i]:
            logits = runner.forward([0], [[t]], [1])[0]
        runner.set_length(0, 0)
        assert int(logits.argmax()) == ref.token_ids[i]  # the replay is target-only's own forward
        gap = float(logits[ref.token_ids[i]] - logits[out.token_ids[i]])
        assert 0 <= gap < NEAR_TIE, (text, i, gap)
    assert drafted > 0
