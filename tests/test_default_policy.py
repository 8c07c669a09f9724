"""The default policy (DEFAULT_POLICY, the cost-aware dsde-goodput) never costs the user: on a machine where no draft
length pays, it proposes almost nothing once it has served a request, and where drafting pays it drafts. Time is a
fake clock charged per forward and per query token, so the step costs the policy learns are exactly the ones set
here (counts, not timings)."""

from __future__ import annotations

import time

from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.engine import Engine
from dsde_core.policies import DEFAULT_POLICY, make_policy
from dsde_core.workers import DraftWorker, TargetWorker
from tests.tiny import VOCAB, FakeClock, IdTokenizer, random_prompts, tiny_runners

PROMPTS = random_prompts(6, seed=21, min_len=8, max_len=24)


def _mean_sl_after_the_first(target_s: tuple[float, float], draft_s: tuple[float, float]) -> tuple[float, float]:
    """(mean SL of the first request, mean SL of the five after it), each request alone: proposed tokens per step.
    target_s, draft_s: (seconds per forward, seconds per query token) of each model."""
    clock = FakeClock()
    perf_counter, sleep = time.perf_counter, time.sleep
    time.perf_counter, time.sleep = clock, clock.sleep
    try:
        target, draft = tiny_runners(1, 256)
        config = EngineConfig(max_batch_size=1, dtype="float32")
        engine = Engine(TargetWorker(clock.timed(target, *target_s)),
                        DraftWorker.from_config(clock.timed(draft, *draft_s), config),
                        make_policy(DEFAULT_POLICY), IdTokenizer(), config, vocab_size=VOCAB)
        sls = []
        for prompt in PROMPTS:
            req = engine.add_request(prompt, SamplingParams(max_tokens=48))
            engine.run()
            sls.append(req.stats.drafted / req.stats.steps)
    finally:
        time.perf_counter, time.sleep = perf_counter, sleep
    return sls[0], sum(sls[1:]) / len(sls[1:])


def test_where_no_draft_length_pays_the_default_proposes_almost_nothing() -> None:
    # every verified token costs half a one-token forward, and a draft forward half of one too: k = 1 costs
    # 0.02 + 0.06 = 0.08 s for at most 2 tokens, more than two target-only steps would; no k pays
    first, after = _mean_sl_after_the_first(target_s=(0.02, 0.02), draft_s=(0.02, 0.0))
    assert after <= 0.1, (first, after)


def test_where_drafting_pays_the_default_drafts() -> None:
    # a flat target forward (a GPU's, or a CPU GEMM's up to its block) and a draft at a twentieth of it
    first, after = _mean_sl_after_the_first(target_s=(0.04, 0.0), draft_s=(0.002, 0.0))
    assert after >= 2.0, (first, after)
