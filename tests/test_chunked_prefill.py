"""Chunked prefill: a prompt longer than the step's prefill budget (EngineConfig.prefill_chunk) is fed to the target
over several steps while the running requests decode in each, and so is a speculating request's prompt to the draft.
Nothing about any output changes: greedy outputs are target-only decoding's, sampled ones the same draws (where the
draft's prefill fits the budget), and a scored prompt's log-probabilities one plain forward's."""

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
    assert engine.prefill_chunks["target"] == sum(t.partial for tasks in calls for t in tasks) > 0  # the count
    assert [r.output_ids for r in early + longs] == [r.output_ids for r in ref]  # greedy: the same tokens
    if policy == "off":
        assert all(r.stats.steps == len(r.output_ids) for r in longs)  # a chunk is not a step of the request
    elif policy != "dsde-goodput":  # (the cost-aware policy drafts where the step times it measures say it pays)
        assert sum(r.stats.drafted for r in longs) > 0  # speculation runs once a prompt is in


def _draft_feeds(engine) -> list[dict[int, int]]:
    """Record the tokens each slot feeds in every draft forward."""
    calls: list[dict[int, int]] = []
    runner = engine.draft.runner
    forward = runner.forward

    def spy(slots, tokens, ns, **kw):
        calls.append({slot: len(toks) for slot, toks in zip(slots, tokens, strict=True)})
        return forward(slots, tokens, ns, **kw)

    runner.forward = spy
    return calls


@pytest.mark.parametrize(("chunk", "window"), [(CHUNK, None), (CHUNK, 40), (None, None)])
def test_a_drafts_prefill_is_fed_in_chunks_too(chunk: int | None, window: int | None) -> None:
    """The draft takes in a long prompt at the request's first drafting step; its prefills share the same budget, so a
    draft forward never holds more than a chunk of it while the others draft and decode, and the request drafts once
    the rest fits. A windowed draft still starts at the window. Greedy outputs are target-only decoding's."""
    plain = tiny_engine("off", batch=4, max_seq_len=512, prefill_chunk=None)
    ref = [plain.add_request(p, SamplingParams(max_tokens=m)) for p, m in zip(SHORT[:2] + LONG, [80, 80, 24, 24],
                                                                                strict=True)]
    plain.run()
    engine = tiny_engine("static:4", batch=4, max_seq_len=512, prefill_chunk=chunk, draft_window=window)
    feeds = _draft_feeds(engine)
    early = [engine.add_request(p, SamplingParams(max_tokens=80)) for p in SHORT[:2]]
    engine.step()
    longs = [engine.add_request(p, SamplingParams(max_tokens=24)) for p in LONG]
    offsets = set()
    while any(r.stats.drafted == 0 for r in longs):
        before = [len(r.output_ids) for r in early]
        engine.step()
        assert all(len(r.output_ids) > n for r, n in zip(early, before, strict=True))  # each step, each of them
        offsets |= {s.offset for r in longs if (s := engine.draft.slots.get(r.slot)) is not None and s.cached}
    slots = {r.slot for r in longs}
    engine.run()
    most = max(sum(n for slot, n in call.items() if slot in slots) for call in feeds)
    if chunk is None:  # without a budget a drafting forward takes in a whole prompt
        assert most >= min(len(p) for p in LONG) - 1
        assert engine.prefill_chunks["draft"] == 0
    else:  # a chunk, or the rest that fits and the last committed token
        assert most <= chunk + 1
        # (the engine's count, exported as ray_dsde_prefill_chunks_total) each prompt's context over the budget
        # took a chunk a step before its rest fitted
        contexts = [len(p) - 1 if window is None else window for p in LONG]
        assert engine.prefill_chunks["draft"] >= sum(-(-c // chunk) - 1 for c in contexts) > 0
    assert offsets == ({0} if window is None else {len(p) - 1 - window for p in LONG})
    assert [r.output_ids for r in early + longs] == [r.output_ids for r in ref]


@pytest.mark.parametrize(("policy", "window"), [("off", None), ("static:4", 16)])
def test_sampled_outputs_draw_the_same_tokens_with_chunks(policy: str, window: int | None) -> None:
    """A chunk samples nothing, so each request's generator draws as it would with the whole prefill at once. (Where a
    draft prefill is over the budget too, the request proposes nothing until it is in: the same distribution, other
    draws; a window of 16 keeps the draft's within the 17 here.)"""
    outs = []
    for chunk in (None, 17):
        engine = tiny_engine(policy, batch=4, max_seq_len=512, prefill_chunk=chunk, draft_window=window)
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


@pytest.mark.parametrize("how", ["dies", "faults"])
def test_a_draft_lost_mid_chunks_prefills_again_and_nothing_changes(how: str) -> None:
    """The draft dies after its second chunk of the long prompt (its restart loses every cache) or raises on it: the
    prompt reaches the draft again from its start, in chunks, and the greedy outputs are target-only decoding's."""
    from dsde_core.models.runner import ModelRunner
    from dsde_core.workers import DraftWorker
    from tests.test_engine_recovery import Flaky
    from tests.tiny import tiny_pair

    plain = tiny_engine("off", batch=4, max_seq_len=512, prefill_chunk=None)
    ref = [plain.add_request(p, SamplingParams(max_tokens=m)) for p, m in ((SHORT[0], 40), (LONG[0], 30))]
    plain.run()
    engine = tiny_engine("static:4", batch=4, max_seq_len=512, prefill_chunk=CHUNK, worker_probe_s=0.001)
    draft = Flaky("draft", lambda: DraftWorker.from_config(ModelRunner(tiny_pair()[1], 4, 512), engine.config))
    draft.restart_after_probes = 2
    chunks: list[int] = []

    def fault_if(name: str, args: tuple) -> bool:
        if name != "propose" or not any(t.limit for t in args[0]):
            return False
        chunks.append(len(chunks))
        if len(chunks) == 2 and how == "dies":
            draft.kill()  # after this call: the next one finds it dead
            return False
        return len(chunks) == 2

    draft.fault_if = fault_if
    engine.draft = draft
    got = [engine.add_request(p, SamplingParams(max_tokens=m)) for p, m in ((SHORT[0], 40), (LONG[0], 30))]
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
    assert len(chunks) >= 2 + (len(LONG[0]) - 1) // CHUNK  # two before, all of them again after
    assert draft.restarts == (how == "dies")
    assert got[1].stats.drafted > 0
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
