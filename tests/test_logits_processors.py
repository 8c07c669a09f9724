"""Logit bias and presence, frequency and repetition penalties: greedy output with speculation equals target-only
decoding with the same processing, and both equal a plain greedy loop over transformers' own model that processes its
logits densely."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsde_core.config import SamplingParams
from dsde_core.errors import ConfigError
from tests.tiny import DEVICE, VOCAB, hf_target, random_prompts, tiny_engine

PROMPTS = random_prompts(6, seed=11)
MAX_TOKENS = 24
PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.8, repetition_penalty=1.5)


def _reference(prompt: list[int], params: SamplingParams, eos: tuple[int, ...] = ()) -> list[int]:
    """Greedy, one token at a time: the target's logits after prompt + output, stop tokens held off under min_tokens,
    biased then penalized over the whole vocabulary; an end-of-sequence or stop token ends it (not output)."""
    out: list[int] = []
    stops = set(params.stop_token_ids) | set(eos)
    r = params.repetition_penalty
    bias = torch.zeros(VOCAB)
    for i, b in params.logit_bias:
        bias[i] = b
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = hf_target()(torch.tensor([prompt + out], device=DEVICE)).logits[0, -1].float().cpu() + bias  # [V]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB).float()  # [V]
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[prompt + out] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
        if len(out) < params.min_tokens:
            logits[list(stops)] = float("-inf")
        token = int(logits.argmax())
        if token in stops:
            return out
        out.append(token)
    return out


def _generate(policy: str, params: SamplingParams, eos: tuple[int, ...] = ()) -> list:
    engine = tiny_engine(policy, eos=eos)
    reqs = [engine.add_request(p, params) for p in PROMPTS]
    engine.run()
    return reqs


@pytest.mark.parametrize("policy", ["off", "static:4", "dsde"])
def test_penalized_greedy_output_is_the_targets_penalized_greedy_output(policy: str) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, **PENALTIES)
    reqs = _generate(policy, params)
    assert [r.output_ids for r in reqs] == [_reference(p, params) for p in PROMPTS]
    plain = _generate("off", SamplingParams(max_tokens=MAX_TOKENS))
    assert sum(a.output_ids != b.output_ids for a, b in zip(reqs, plain, strict=True)) >= len(PROMPTS) // 2
    if policy != "off":
        assert sum(r.stats.accepted for r in reqs) > 0


@pytest.mark.parametrize("penalty", [dict(presence_penalty=2.0), dict(frequency_penalty=-2.0),
                                     dict(repetition_penalty=0.5), dict(logit_bias={3: 4.0, 17: -3.0, 40: 2.5}),
                                     dict(logit_bias={5: 2.0}, frequency_penalty=1.0)])
def test_each_penalty_alone_stays_lossless(penalty: dict) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, **penalty)
    reqs = _generate("static:4", params)
    assert [r.output_ids for r in reqs[:3]] == [_reference(p, params) for p in PROMPTS[:3]]
    assert [r.output_ids for r in reqs] == [r.output_ids for r in _generate("off", params)]


def test_the_draft_proposes_under_the_same_penalties() -> None:
    """The draft penalizes its own logits for the output and the tokens it drafted this step, so it keeps proposing
    what the penalized target picks: its acceptance stays near the unpenalized one's (a draft that ignored the
    penalties would keep proposing the repeats the target now avoids)."""
    rate = {}
    for name, params in [("plain", SamplingParams(max_tokens=MAX_TOKENS)),
                         ("penalized", SamplingParams(max_tokens=MAX_TOKENS, **PENALTIES))]:
        reqs = _generate("static:4", params)
        rate[name] = sum(r.stats.accepted for r in reqs) / sum(r.stats.drafted for r in reqs)
    assert rate["penalized"] > 0.8 * rate["plain"], rate


def test_a_logit_bias_of_100_forces_its_token_and_minus_100_bans_it() -> None:
    plain = _generate("off", SamplingParams(max_tokens=MAX_TOKENS))
    banned = plain[0].output_ids[0]
    reqs = _generate("static:4", SamplingParams(max_tokens=MAX_TOKENS, logit_bias={banned: -100.0}))
    assert all(banned not in r.output_ids for r in reqs)
    forced = _generate("static:4", SamplingParams(max_tokens=MAX_TOKENS, logit_bias={7: 100.0}))
    assert all(r.output_ids == [7] * MAX_TOKENS for r in forced)
    assert sum(r.stats.accepted for r in forced) == sum(r.stats.drafted for r in forced) > 0  # the draft is biased too


def test_logit_bias_is_checked() -> None:
    assert SamplingParams(logit_bias={9: 1, 2: -0.5}).logit_bias == ((2, -0.5), (9, 1.0))
    for bad in [{1: 101.0}, {-1: 1.0}, {"1": 1.0}, {1: float("nan")}, {i: 1.0 for i in range(1025)}, 5]:
        with pytest.raises(ConfigError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ConfigError, match=f"logit_bias token ids must be in \\[0, {VOCAB}\\)"):
        tiny_engine("off").add_request(PROMPTS[0], SamplingParams(logit_bias={VOCAB: 1.0}))


def test_stop_token_ids_end_the_request_where_target_only_decoding_ends() -> None:
    plain = _generate("off", SamplingParams(max_tokens=MAX_TOKENS))
    stop = plain[0].output_ids[5]
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop])
    reqs = _generate("static:4", params)
    assert reqs[0].output_ids == plain[0].output_ids[: plain[0].output_ids.index(stop)]
    assert reqs[0].finish_reason == "stop" and reqs[0].stop_reason == stop  # vLLM's stop_reason: the token
    assert [r.output_ids for r in reqs] == [_reference(p, params) for p in PROMPTS]
    kept = _generate("static:4", replace(params, include_stop_str_in_output=True))  # vLLM's: the token stays
    for r, dropped in zip(kept, reqs, strict=True):
        assert r.output_ids == dropped.output_ids + ([stop] if dropped.stop_reason == stop else [])
    assert kept[0].text == "".join(f"<{t}>" for t in kept[0].output_ids) and kept[0].text.endswith(f"<{stop}>")


@pytest.mark.parametrize("policy", ["off", "static:4"])
def test_min_tokens_holds_the_end_of_sequence_off(policy: str) -> None:
    """An eos the output would reach after 3 tokens waits until 12: both workers hold it off for those positions."""
    plain = _generate("off", SamplingParams(max_tokens=MAX_TOKENS))
    eos = (plain[0].output_ids[3],)
    early = _generate(policy, SamplingParams(max_tokens=MAX_TOKENS), eos=eos)
    assert len(early[0].output_ids) == 3 and early[0].finish_reason == "stop"
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=12)
    held = _generate(policy, params, eos=eos)
    assert all(len(r.output_ids) >= 12 for r in held)
    assert [r.output_ids for r in held] == [_reference(p, params, eos) for p in PROMPTS]
    if policy != "off":
        assert sum(r.stats.accepted for r in held) > 0
    ignoring = _generate(policy, SamplingParams(max_tokens=MAX_TOKENS, min_tokens=12, ignore_eos=True), eos=eos)
    assert len(ignoring[0].output_ids) == MAX_TOKENS


def test_stop_token_checks() -> None:
    assert SamplingParams(stop_token_ids=[9, 2, 9]).stop_token_ids == (2, 9)
    for bad in [dict(stop_token_ids=[-1]), dict(stop_token_ids=list(range(65))), dict(min_tokens=-1),
                dict(max_tokens=4, min_tokens=5), dict(min_p=1.5)]:
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    with pytest.raises(ConfigError, match="stop_token_ids must be in"):
        tiny_engine("off").add_request(PROMPTS[0], SamplingParams(stop_token_ids=[VOCAB]))


@pytest.mark.parametrize("policy", ["off", "static:4"])
def test_min_tokens_holds_a_stop_string_off(policy: str) -> None:
    """A stop string completed by a token under min_tokens does not end the request (vLLM's rule)."""
    plain = _generate("off", SamplingParams(max_tokens=MAX_TOKENS))[0].output_ids
    stop = (f"<{plain[2]}>",)  # the test tokenizer decodes token i to "<i>"
    assert _generate(policy, SamplingParams(max_tokens=MAX_TOKENS, stop=stop))[0].output_ids == plain[:3]
    held = _generate(policy, SamplingParams(max_tokens=MAX_TOKENS, stop=stop, min_tokens=6))[0]
    later = [j for j in range(5, MAX_TOKENS) if plain[j] == plain[2]]  # where a completion would count
    assert held.output_ids == plain[: later[0] + 1] if later else held.output_ids == plain


def test_sampled_output_under_penalties_repeats_as_often_with_speculation_as_without() -> None:
    """T > 0: speculation keeps the output's distribution (the target's p and the draft's q are both processed).
    A statistic the penalty moves a lot: how often four sampled tokens repeat one (three tokens biased up, then a
    frequency penalty). 2000 seeded requests each: target-only repeats in 11%, 27% without the penalty; a target that
    forgot the drafts' counts repeats in 22% with static:3."""
    prompt = random_prompts(1, seed=3)[0]

    def repeat_rate(policy: str, **processing: object) -> float:
        engine = tiny_engine(policy, batch=64)
        reqs = [engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.7, seed=i, **processing))
                for i in range(2000)]
        engine.run()
        return sum(len(set(r.output_ids)) < len(r.output_ids) for r in reqs) / len(reqs)

    bias = {1: 3.0, 2: 3.0, 3: 3.0}
    target_only = repeat_rate("off", logit_bias=bias, frequency_penalty=1.5)
    assert repeat_rate("off", logit_bias=bias) > target_only + 0.1  # the statistic sees the penalty
    assert abs(repeat_rate("static:3", logit_bias=bias, frequency_penalty=1.5) - target_only) < 0.04  # 4 sigma
