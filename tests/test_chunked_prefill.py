"""Chunked prefill: a prompt longer than the step's prefill budget (EngineConfig.prefill_chunk) is fed to the target
over several steps while the running requests decode in each, and nothing about any output changes: greedy outputs
are target-only decoding's, sampled ones the same draws, and a scored prompt's log-probabilities one plain forward's."""

from __future__ import annotations

import pytest
import torch

from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.errors import ConfigError
from dsde_core.workers import VerifyTask
from tests.tiny import DEVICE, hf_target, random_prompts, tiny_engine

LONG = random_prompts(2, seed=21, min_len=150, max_len=200)
SHORT = random_prompts(4, seed=22, min_len=3, max_len=12)
CHUNK = 32


def _spy(engine) -> list[list[VerifyTask]]:
    """Record every target call's tasks."""
    calls: list[list[VerifyTask]] = []
    verify = engine.target.verify

    def spy(tasks: list[VerifyTask]):
        calls.append(tasks)
        return verify(tasks)

    engine.target.verify = spy
    return calls


def _prefilled(tasks: list[VerifyTask]) -> int:
    """Context tokens of the long prompts' prefills in one call: chunks, and a last part over 21 tokens (a decoding
    row feeds a step's committed tokens, at most max_sl + 1 = 21; a short prompt at most 12)."""
    return sum(len(t.new_tokens) for t in tasks if t.partial or len(t.new_tokens) > 21)


@pytest.mark.parametrize("policy", ["off", "static:4", "dsde", "dsde-goodput"])
def test_long_prompts_are_fed_in_chunks_while_the_others_decode(policy: str) -> None:
    lengths = [80, 80, 24, 24]  # the short requests decode all through the long prompts' chunks
    plain = tiny_engine(policy, batch=4, max_seq_len=512, prefill_chunk=None)
    ref = [plain.add_request(p, SamplingParams(max_tokens=m)) for p, m in zip(SHORT[:2] + LONG, lengths, strict=True)]
    plain.run()
    engine = tiny_engine(policy, batch=4, max_seq_len=512, prefill_chunk=CHUNK)
    calls = _spy(engine)
    early = [engine.add_request(p, SamplingParams(max_tokens=80)) for p in SHORT[:2]]
    engine.step()  # the short prompts' prefill: they decode from here on
    longs = [engine.add_request(p, SamplingParams(max_tokens=24)) for p in LONG]
    steps = 0
    while any(r.output_ids == [] for r in longs):
        before = [len(r.output_ids) for r in early]
        engine.step()
        steps += 1
        assert all(len(r.output_ids) > n for r, n in zip(early, before, strict=True))  # each step, each of them
    assert steps >= sum(len(p) for p in LONG) // CHUNK  # the long prompts took that many steps
    engine.run()
    assert max(_prefilled(tasks) for tasks in calls) <= CHUNK
    assert any(t.partial for tasks in calls for t in tasks)
    assert [r.output_ids for r in early + longs] == [r.output_ids for r in ref]  # greedy: the same tokens
    if policy == "off":
        assert all(r.stats.steps == len(r.output_ids) for r in longs)  # a chunk is not a step of the request
    else:
        assert sum(r.stats.drafted for r in longs) > 0  # speculation runs once a prompt is in


def test_sampled_outputs_draw_the_same_tokens_with_chunks() -> None:
    """A chunk samples nothing, so each request's generator draws as it would with the whole prefill at once."""
    outs = []
    for chunk in (None, 17):
        engine = tiny_engine("static:4", batch=4, max_seq_len=512, prefill_chunk=chunk)
        reqs = [engine.add_request(p, SamplingParams(max_tokens=20, temperature=1.0, seed=i))
                for i, p in enumerate(SHORT[:2] + LONG)]
        engine.run()
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]


def test_a_chunked_prompts_log_probabilities_are_one_plain_forwards() -> None:
    """Each chunk scores its tokens, its first with the previous chunk's last position."""
    engine = tiny_engine("static:4", batch=2, max_seq_len=512, prefill_chunk=CHUNK)
    calls = _spy(engine)
    r = engine.add_request(LONG[0], SamplingParams(max_tokens=4, prompt_logprobs=2))
    engine.run()
    assert sum(t.partial for tasks in calls for t in tasks) == (len(LONG[0]) - 1) // CHUNK
    with torch.no_grad():
        logits = hf_target()(torch.tensor([LONG[0]], device=DEVICE)).logits[0].float()
    ref = torch.log_softmax(logits[:-1], dim=-1).cpu()  # [P-1, V]: row i predicts prompt token i + 1
    assert len(r.prompt_logprobs) == len(LONG[0]) - 1
    for j, (token, lp) in enumerate(zip(LONG[0][1:], r.prompt_logprobs, strict=True)):
        assert lp.logprob == pytest.approx(ref[j, token].item(), abs=1e-4)
        assert [v for _, v in lp.top] == pytest.approx(ref[j].topk(2).values.tolist(), abs=1e-4)


def test_prefill_chunk_is_checked() -> None:
    for bad in (0, -3, 2.5):
        with pytest.raises(ConfigError, match="prefill_chunk"):
            EngineConfig(prefill_chunk=bad)
    assert EngineConfig(prefill_chunk=None).prefill_chunk is None


@pytest.mark.parametrize("how", ["dies", "faults"])
def test_a_target_lost_mid_chunks_prefills_again_and_nothing_changes(how: str) -> None:
    """The target dies (a restart loses every cache) or raises on the third call, while the long prompt is in
    chunks: it is fed again from its first token, its prompt log-probabilities are not counted twice."""
    from dsde_core.models.runner import ModelRunner
    from dsde_core.workers import TargetWorker
    from tests.test_engine_recovery import Flaky
    from tests.tiny import tiny_pair

    def run(flaky: bool) -> list:
        engine = tiny_engine("static:4", batch=4, max_seq_len=512, prefill_chunk=CHUNK, worker_probe_s=0.001)
        if flaky:
            target = Flaky("target", lambda: TargetWorker(ModelRunner(tiny_pair()[0], 4, 512)))
            target.restart_after_probes = 2
            if how == "dies":
                target.kill_at = ("verify", 3)
            else:
                target.fault_at = ("verify", 3)
            engine.target = target
        reqs = [engine.add_request(SHORT[0], SamplingParams(max_tokens=30)),
                engine.add_request(LONG[0], SamplingParams(max_tokens=12, prompt_logprobs=1))]
        for _ in range(500):
            if not engine.has_unfinished():
                break
            engine.step()
        assert not flaky or target.calls["verify"] > 3 and (how == "faults" or target.restarts == 1)
        return reqs

    ref, got = run(False), run(True)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [lp.logprob for lp in got[1].prompt_logprobs] == pytest.approx([lp.logprob for lp in ref[1].prompt_logprobs],
                                                                          abs=1e-5)
