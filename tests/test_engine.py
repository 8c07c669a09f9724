"""The engine on tiny fp32 models: greedy speculative decoding equals target-only decoding token for token,
under every policy, with continuous batching, mixed lengths and requests joining mid-batch."""

from __future__ import annotations

import itertools
import logging

import pytest

from dsde_core.config import EngineConfig, SamplingParams, SpeculationParams
from dsde_core.errors import ConfigError
from dsde_core.policies import Plan, StaticPolicy, ceiling_note
from dsde_core.workers import DraftTask, DraftWorker
from tests.tiny import VOCAB, random_prompts, tiny_engine

POLICIES = ["static:1", "static:3", "static:6", "dsde", "dsde-nocap", "dsde-paper", "dsde-goodput", "adaedl",
            "heuristic", "acceptance"]
PROMPTS = random_prompts(12, seed=3)
MAX_TOKENS = [5 + (7 * i) % 36 for i in range(len(PROMPTS))]  # 5..40, mixed short and long


def _add(engine, prompts, max_tokens, spec=None):
    return [engine.add_request(p, SamplingParams(max_tokens=m), spec) for p, m in zip(prompts, max_tokens, strict=True)]


def _run(engine, prompts, max_tokens, spec=None):
    reqs = _add(engine, prompts, max_tokens, spec)
    engine.run()
    return reqs


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Target-only greedy outputs, one request at a time (no batching at all)."""
    engine = tiny_engine("off", batch=1, with_draft=False)
    return [_run(engine, [p], [m])[0].output_ids for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_speculation_is_lossless(policy: str, reference: list[list[int]]) -> None:
    engine = tiny_engine(policy, batch=4)  # 12 requests through 4 slots: requests join as others finish
    reqs = _run(engine, PROMPTS, MAX_TOKENS)
    assert [r.output_ids for r in reqs] == reference
    assert all(r.finish_reason == "length" for r in reqs)
    drafted = sum(r.stats.drafted for r in reqs)
    accepted = sum(r.stats.accepted for r in reqs)
    assert 0 < accepted < drafted  # both the accept and the reject paths ran


@pytest.mark.parametrize("policy", ["static:3", "dsde"])
def test_a_windowed_draft_is_lossless_and_caches_only_its_window(policy: str, reference: list[list[int]]) -> None:
    """The draft takes in at most draft_window tokens of a prompt (its cache starts there, RoPE being relative): the
    output is the target's all the same, and the draft's cache holds the window plus what came after it."""
    engine = tiny_engine(policy, batch=4, draft_window=6)
    draft_runner = engine.draft.runner
    longest = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    req = engine.add_request(PROMPTS[longest], SamplingParams(max_tokens=MAX_TOKENS[longest]))
    while req.synced_draft == 0 and not req.finished:
        engine.step()
    # the window, the last committed token, the drafts
    n = len(PROMPTS[longest])
    assert n > 20 and draft_runner.length(req.slot) <= 6 + 1 + engine.config.max_sl < n
    engine.run()
    assert req.output_ids == reference[longest]
    reqs = _run(engine, PROMPTS, MAX_TOKENS)
    assert [r.output_ids for r in reqs] == reference
    assert sum(r.stats.drafted for r in reqs) > 0


def test_draft_logit_noise_weakens_the_draft_and_output_stays_the_targets(reference: list[list[int]]) -> None:
    """`dsde bench --draft-noise` (issue 7's weak draft): Gaussian noise on the draft's logits lowers acceptance, and
    the greedy output is the target's all the same."""

    def acceptance(reqs: list) -> float:
        return sum(r.stats.accepted for r in reqs) / sum(r.stats.drafted for r in reqs)

    clean, noisy = (_run(tiny_engine("static:4", batch=4, draft_logit_noise=n), PROMPTS, MAX_TOKENS) for n in (0, 8))
    assert [r.output_ids for r in clean] == [r.output_ids for r in noisy] == reference
    assert acceptance(noisy) < 0.5 * acceptance(clean), (acceptance(clean), acceptance(noisy))  # ~0.38 and ~0.01
    with pytest.raises(ConfigError, match="draft_logit_noise must be >= 0"):
        EngineConfig(draft_logit_noise=-1.0)


def test_the_draft_window_is_off_by_default_and_refuses_bad_values() -> None:
    """Off unless asked for: the draft's cache starts at the prompt's first token, as without the option; a window
    that is not a positive integer is refused by name."""
    engine = tiny_engine("static:3", batch=1)
    assert EngineConfig().draft_window is None and engine.config.draft_window is None and engine.draft.window is None
    req = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8))
    while req.synced_draft == 0 and not req.finished:
        engine.step()
    slot = engine.draft.slots[req.slot]
    assert slot.offset == 0 and slot.cached[:len(PROMPTS[0]) - 1] == PROMPTS[0][:-1]
    for bad in (0, -1, 2.5, "256", True):
        with pytest.raises(ConfigError, match="draft_window"):
            EngineConfig(draft_window=bad)


def test_requests_joining_mid_batch_are_lossless(reference: list[list[int]]) -> None:
    engine = tiny_engine("static:4", batch=3)
    first = _add(engine, PROMPTS[:2], MAX_TOKENS[:2])
    for _ in range(3):
        engine.step()
    later = _add(engine, PROMPTS[2:6], MAX_TOKENS[2:6])
    engine.run()
    assert [r.output_ids for r in first + later] == reference[:6]


def test_stats_are_consistent() -> None:
    engine = tiny_engine("static:5", batch=4)
    for r in _run(engine, PROMPTS[:4], [30] * 4):
        s = r.stats
        assert 0 < s.accepted <= s.drafted == sum(s.sl)
        assert len(r.output_ids) == 30 and s.steps <= 30
        # greedy: a token at draft position j is accepted only if position j-1 was
        assert all(a >= b for a, b in itertools.pairwise(s.accepted_at))
        assert s.ttft is not None and s.e2e is not None and s.e2e >= s.ttft
        assert s.mean_accepted_length == pytest.approx((s.accepted + s.steps) / s.steps)


def test_draft_cache_follows_the_committed_tokens() -> None:
    """After many steps the draft's cache holds a prefix of the committed tokens and proposes exactly
    what a fresh draft prefilled with those tokens proposes."""
    engine = tiny_engine("static:4", batch=2)
    req = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=60))
    for _ in range(6):
        engine.step()
    draft: DraftWorker = engine.draft
    feed = draft._sync(req.slot, req.tokens[req.synced_draft:])
    slot = draft.slots[req.slot]
    assert slot.cached == req.tokens[: len(slot.cached)] and slot.cached + feed == req.tokens
    assert draft.runner.length(req.slot) == len(slot.cached) >= req.num_tokens - 2  # accepted drafts kept
    fresh = DraftWorker(type(draft.runner)(draft.runner.model, 1, 256), draft.top_k)
    fresh.open(0, req.params)
    expected = fresh.propose([DraftTask(0, req.tokens, 4)])[0].tokens
    got = draft.propose([DraftTask(req.slot, [], 4)])[0].tokens
    assert got == expected


def test_eos_ends_a_request_before_the_eos_token(reference: list[list[int]]) -> None:
    eos = reference[1][3]
    engine = tiny_engine("static:3", batch=2, eos=(eos,))
    [req] = _run(engine, [PROMPTS[1]], [MAX_TOKENS[1]])
    cut = reference[1].index(eos)
    assert req.output_ids == reference[1][:cut] and req.finish_reason == "stop"


def test_extra_eos_ids_end_a_request_as_the_models_eos_does(reference: list[list[int]]) -> None:
    eos = reference[1][3]
    engine = tiny_engine("static:3", batch=2, extra_eos_ids=(eos,))
    [req] = _run(engine, [PROMPTS[1]], [MAX_TOKENS[1]])
    assert req.output_ids == reference[1][: reference[1].index(eos)] and req.finish_reason == "stop"


def test_draft_catch_up_feeds_a_sequence_that_never_drafts_every_step(reference: list[list[int]]) -> None:
    """By default a sequence that has never drafted defers its draft prefill until it drafts; with draft_catch_up the
    draft takes in its tokens every step all the same (and the output is the target's either way)."""
    for catch_up in (False, True):
        engine = tiny_engine("static:4", batch=2, draft_catch_up=catch_up)
        req = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS[0]), SpeculationParams(enabled=False))
        for _ in range(4):
            engine.step()
            cached = engine.draft.runner.length(req.slot)  # a k = 0 feed leaves the last committed token for the next
            if catch_up:  # step, which this step's own token joins
                assert req.num_tokens - 2 <= cached <= req.synced_draft < req.num_tokens, (cached, req.num_tokens)
            else:
                assert req.synced_draft == 0 and cached == 0
        engine.run()
        assert req.output_ids == reference[0] and req.stats.drafted == 0


def test_stop_string_ends_a_request(reference: list[list[int]]) -> None:
    stop = f"<{reference[2][4]}>"
    engine = tiny_engine("static:3", batch=2)
    req = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS[2], stop=(stop,)))
    engine.run()
    assert req.finish_reason == "stop" and stop not in req.text and req.stop_reason == stop
    assert req.text == "".join(f"<{t}>" for t in reference[2])[: len(req.text)]
    # the tokens end with the one that completes the stop string, as target-only decoding ends (not with the rest of
    # the step's accepted drafts)
    assert req.output_ids == reference[2][: reference[2].index(reference[2][4]) + 1]
    kept = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS[2], stop=(stop,),
                                                         include_stop_str_in_output=True))
    engine.run()
    assert kept.output_ids == req.output_ids and kept.text == req.text + stop  # vLLM's include_stop_str_in_output


def test_speculation_off_per_request_and_max_sl() -> None:
    engine = tiny_engine("static:6", batch=2)
    off, capped = (engine.add_request(PROMPTS[0], SamplingParams(max_tokens=20), SpeculationParams(enabled=False)),
                   engine.add_request(PROMPTS[1], SamplingParams(max_tokens=20), SpeculationParams(max_sl=2)))
    engine.run()
    assert off.stats.drafted == 0 and off.stats.steps == 20
    assert max(capped.stats.sl) == 2


def test_a_policy_asking_above_max_sl_is_lowered_to_it_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dsde_core.engine"):
        engine = tiny_engine("static:12", batch=1, max_sl=5)
    assert [r.getMessage() for r in caplog.records] == [ceiling_note(engine.policy, 5)]
    assert "static:12 plans k up to 12, above the engine's max_sl 5" in caplog.records[0].getMessage()
    [req] = _run(engine, [PROMPTS[0]], [20])
    assert max(req.stats.sl) == 5
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsde_core.engine"):
        engine.set_policy(StaticPolicy(5))
        engine.set_policy(StaticPolicy(9))
    assert [r.getMessage() for r in caplog.records] == [ceiling_note(StaticPolicy(9), 5)]


def test_never_drafts_past_max_tokens() -> None:
    engine = tiny_engine("static:8", batch=2)
    [req] = _run(engine, [PROMPTS[0]], [3])
    assert len(req.output_ids) == 3 and max(req.stats.sl) <= 2


def test_cancel_frees_slot_and_all_state() -> None:
    engine = tiny_engine("dsde", batch=2)
    outs = []
    reqs = [engine.add_request(p, SamplingParams(max_tokens=50), on_output=outs.append) for p in PROMPTS[:4]]
    for _ in range(3):
        engine.step()
    engine.cancel(reqs[0].req_id)  # running
    engine.cancel(reqs[3].req_id)  # still waiting
    engine.step()
    assert reqs[0].finish_reason == "cancelled" and reqs[3].finish_reason == "cancelled"
    assert {o.req_id for o in outs if o.finish_reason == "cancelled"} == {reqs[0].req_id, reqs[3].req_id}
    engine.run()
    assert engine.policy.num_tracked() == 0
    assert engine.target.num_open() == 0 and engine.draft.num_open() == 0
    assert len(engine.free_slots) == 2 and not engine.requests


def test_cancel_after_the_final_output_leaves_no_id_behind() -> None:
    # a consumer sees the final output before the step frees its request (the async server's race), and a request
    # cancelled and then ended another way (an error) must not leave its id to an idle engine's next step either
    engine = tiny_engine("dsde", batch=2)
    cancels = []

    def close_on_final(out) -> None:
        if out.finished:
            cancels.append(engine.cancel(out.req_id))

    req = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4), on_output=close_on_final)
    engine.run()
    assert req.finish_reason == "length" and cancels == [False]
    assert engine.cancel(req.req_id) is False and engine.cancel("no-such-request") is False
    assert engine.state()["cancelling"] == 0
    other = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.cancel(other.req_id) is True and engine.state()["cancelling"] == 1
    engine.fail_running("step failed")
    assert other.finish_reason == "error" and engine.state()["cancelling"] == 0 and not engine.requests


def test_temperature_sampling_is_seeded_and_accepts_an_identical_draft() -> None:
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=7)
    eng = tiny_engine("static:4", noise=0.0, draft_top_k=VOCAB)
    r1 = eng.add_request(PROMPTS[0], params)
    eng.run()
    eng2 = tiny_engine("static:4", noise=0.0, draft_top_k=VOCAB)
    r2 = eng2.add_request(PROMPTS[0], params)
    eng2.run()
    assert r1.output_ids == r2.output_ids  # same seed, same output
    assert r1.stats.acceptance_rate > 0.95  # p == q up to rounding: min(1, p/q) ~ 1


@pytest.mark.parametrize(("prompt", "params", "field"), [
    ([], SamplingParams(), "prompt"),
    ([VOCAB + 5], SamplingParams(), "prompt"),
    ([1], SamplingParams(logit_bias=((VOCAB, 1.0),)), "logit_bias"),
    ([1], SamplingParams(stop_token_ids=(VOCAB,)), "stop_token_ids"),
    (list(range(50)), SamplingParams(max_tokens=250), "max_tokens"),  # 50 + 250 > max_seq_len 256
])
def test_bad_requests_are_refused_with_a_clear_error(prompt, params, field) -> None:
    engine = tiny_engine("dsde", batch=1)
    with pytest.raises(ConfigError) as e:
        engine.add_request(prompt, params)
    assert e.value.field == field  # the input at fault, which a server names (the API's `param`)
    assert not engine.has_unfinished()


def test_min_confidence_stops_the_draft_early() -> None:
    class EarlyStop(StaticPolicy):
        def plan(self, seqs, costs=None, waiting=0):  # almost no draft token is that confident
            return [Plan(min(8, s.max_k), min_confidence=0.999) for s in seqs]

    engine = tiny_engine(EarlyStop(8), batch=2)
    reqs = _run(engine, PROMPTS[:2], [20, 20])
    assert all(set(r.stats.sl) <= {0, 1} for r in reqs)  # the draft stopped after its first token every step


def test_adaedl_lossless_and_shortens_drafts(reference: list[list[int]]) -> None:
    engine = tiny_engine("adaedl", batch=4)
    reqs = _run(engine, PROMPTS, MAX_TOKENS)
    assert [r.output_ids for r in reqs] == reference
    assert any(0 < k < 10 for r in reqs for k in r.stats.sl[:-1])


def test_the_policy_is_told_how_many_requests_wait_for_a_slot() -> None:
    """plan(..., waiting): the requests queued behind a full batch, 0 once the batch only shrinks."""
    seen: list[tuple[int, int]] = []  # per plan: (running, waiting)

    class Record(StaticPolicy):
        def plan(self, seqs, costs=None, waiting=0):
            seen.append((len(seqs), waiting))
            return super().plan(seqs, costs, waiting)

    engine = tiny_engine(Record(), batch=2)
    _add(engine, random_prompts(3, seed=2), [4, 12, 12])
    while engine.has_unfinished():
        engine.step()
    assert seen[0] == (2, 1)  # the third request waits until the first finishes
    assert (2, 0) in seen and seen[-1][1] == 0 and all(w in (0, 1) for _, w in seen)
    assert seen.index((2, 0)) > 0 and all(w == 1 for _, w in seen[:seen.index((2, 0))])


def test_the_policy_is_told_what_the_draft_has_not_seen() -> None:
    """SeqInfo.draft_lag: a sequence whose draft cache is empty would prefill its whole context (all tokens but the
    last) once it drafts; one that has drafted is in step with its draft (0). The draft's prefill is deferred to
    the first step that drafts, so a sequence planned target-only keeps its lag."""
    seen: list[list[int]] = []  # per plan: each sequence's draft_lag

    class Alternate(StaticPolicy):
        def plan(self, seqs, costs=None, waiting=0):
            seen.append([s.draft_lag for s in seqs])
            return [Plan(k=2 if len(seen) % 3 == 0 and s.max_k else 0) for s in seqs]

    engine = tiny_engine(Alternate(), batch=2)
    prompts = random_prompts(2, seed=5, min_len=6, max_len=12)
    reqs = _add(engine, prompts, [12, 12])
    lens = []
    while engine.has_unfinished():
        lens.append([r.num_tokens for r in reqs])
        engine.step()
    assert seen[0] == [len(p) - 1 for p in prompts] and seen[1] == [n - 1 for n in lens[1]]
    assert seen[2] == [n - 1 for n in lens[2]]  # the third plan drafts: the draft takes the contexts in
    assert all(lag == 0 for plan in seen[3:] for lag in plan)  # from then on the draft cache is warm
