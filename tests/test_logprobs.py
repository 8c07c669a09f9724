"""Log-probabilities: each output token's log p under the target and its n likeliest alternatives, exactly what one
plain forward of the target (transformers' own model) over prompt + output gives, whether the tokens were drafted
and verified or decoded target-only, greedy or sampled."""

from __future__ import annotations

import pytest
import torch

from dsde_core.config import SamplingParams
from dsde_core.errors import ConfigError
from dsde_core.request import RequestOutput
from dsde_core.sampling import TokenLogprob
from tests.tiny import DEVICE, hf_target, random_prompts, tiny_engine

PROMPTS = random_prompts(6, seed=5)
MAX_TOKENS, TOP = 24, 3


def _reference(prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: log-softmax of the target's logits at each output position, one forward over everything."""
    with torch.no_grad():
        logits = hf_target()(torch.tensor([prompt + output], device=DEVICE)).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).cpu()


@pytest.mark.parametrize(("policy", "temperature"), [("off", 0.0), ("static:4", 0.0), ("dsde", 0.0),
                                                     ("static:4", 1.0)])
def test_each_output_token_carries_the_targets_log_probability_and_its_likeliest_alternatives(
        policy: str, temperature: float) -> None:
    engine = tiny_engine(policy)
    streamed: dict[str, list[RequestOutput]] = {}
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=i, logprobs=TOP),
                               on_output=lambda out: streamed.setdefault(out.req_id, []).append(out))
            for i, p in enumerate(PROMPTS)]
    engine.run()
    for r in reqs:
        assert len(r.logprobs) == len(r.output_ids) == MAX_TOKENS
        ref = _reference(r.prompt_ids, r.output_ids)
        for j, (token, lp) in enumerate(zip(r.output_ids, r.logprobs, strict=True)):
            assert lp.logprob == pytest.approx(ref[j, token].item(), abs=1e-4)
            assert len(lp.top) == TOP  # likeliest first; each its own log p (ties may order either way)
            assert [v for _, v in lp.top] == pytest.approx(ref[j].topk(TOP).values.tolist(), abs=1e-4)
            assert all(v == pytest.approx(ref[j, i].item(), abs=1e-4) for i, v in lp.top)
            if temperature == 0:
                assert token == lp.top[0][0] and lp.logprob == lp.top[0][1]  # greedy: the likeliest token
        outs = streamed[r.req_id]  # each output carries its own tokens' log-probabilities, in order
        assert all(len(o.logprobs or []) == len(o.token_ids) for o in outs)
        assert [lp for o in outs for lp in o.logprobs or []] == r.logprobs
    if policy != "off":
        assert sum(r.stats.drafted for r in reqs) > 0 and sum(r.stats.accepted for r in reqs) > 0


def test_without_the_ask_no_log_probability_is_computed_or_sent() -> None:
    engine = tiny_engine("static:4")
    outs: list[RequestOutput] = []
    r = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8), on_output=outs.append)
    bare = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8, logprobs=0))
    engine.run()
    assert r.logprobs == [] and all(o.logprobs is None for o in outs)
    assert len(bare.logprobs) == 8 and all(isinstance(lp, TokenLogprob) and lp.top == () for lp in bare.logprobs)


def test_an_eos_cuts_the_log_probabilities_with_the_tokens() -> None:
    """A step's tokens after an end-of-sequence token are dropped, and so are their log-probabilities."""
    ref_engine = tiny_engine("off")
    first = ref_engine.add_request(PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS))
    ref_engine.run()
    eos = first.output_ids[10]  # stops the request at the first occurrence of this token
    engine = tiny_engine("static:4", eos=(eos,))
    r = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS, logprobs=1))
    engine.run()
    assert r.finish_reason == "stop" and eos not in r.output_ids and len(r.logprobs) == len(r.output_ids)
    ref = _reference(r.prompt_ids, r.output_ids)
    assert [lp.logprob for lp in r.logprobs] == pytest.approx([ref[j, t].item() for j, t in enumerate(r.output_ids)],
                                                              abs=1e-4)


@pytest.mark.parametrize("n", [-1, 21, 1.5])
@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_a_bad_logprobs_count_is_refused(name: str, n: object) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be an integer in"):
        SamplingParams(**{name: n})


@pytest.mark.parametrize("policy", ["off", "static:4"])
def test_prompt_log_probabilities_are_the_targets_at_each_prompt_position(policy: str) -> None:
    """prompt_logprobs: each prompt token after the first gets its log p given the tokens before it and the n
    likeliest there, on the request's first output, once; the output is the same as without them."""
    engine = tiny_engine(policy)
    streamed: dict[str, list[RequestOutput]] = {}
    asks = [engine.add_request(p, SamplingParams(max_tokens=12, prompt_logprobs=TOP), on_output=lambda out:
                               streamed.setdefault(out.req_id, []).append(out)) for p in PROMPTS[:3]]
    plain = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in PROMPTS[:3]]
    engine.run()
    for r, same in zip(asks, plain, strict=True):
        assert r.output_ids == same.output_ids and same.prompt_logprobs is None
        with torch.no_grad():
            logits = hf_target()(torch.tensor([r.prompt_ids], device=DEVICE)).logits[0].float()
        ref = torch.log_softmax(logits[:-1], dim=-1).cpu()  # [P-1, V]: row i predicts prompt token i + 1
        assert len(r.prompt_logprobs) == len(r.prompt_ids) - 1
        for j, (token, lp) in enumerate(zip(r.prompt_ids[1:], r.prompt_logprobs, strict=True)):
            assert lp.logprob == pytest.approx(ref[j, token].item(), abs=1e-4)
            assert [v for _, v in lp.top] == pytest.approx(ref[j].topk(TOP).values.tolist(), abs=1e-4)
        outs = streamed[r.req_id]
        assert outs[0].prompt_logprobs == r.prompt_logprobs and all(o.prompt_logprobs is None for o in outs[1:])


def test_a_one_token_prompt_has_no_prompt_log_probabilities() -> None:
    engine = tiny_engine("static:4")
    r = engine.add_request([5], SamplingParams(max_tokens=4, prompt_logprobs=2))
    engine.run()
    assert r.prompt_logprobs == [] and len(r.output_ids) == 4


def test_log_probabilities_are_the_same_computed_in_row_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt's log-probabilities are log-softmaxed LOGPROB_ROWS rows at a time: the same numbers."""
    from dsde_core import sampling

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(70, 50, generator=gen)  # [m, V]
    tokens = torch.randint(0, 50, (60,), generator=gen).tolist()
    whole = sampling.token_logprobs(logits, tokens, 3)
    monkeypatch.setattr(sampling, "LOGPROB_ROWS", 7)
    assert sampling.token_logprobs(logits, tokens, 3) == whole and len(whole) == 60
    assert sampling.token_logprobs(logits, [], 3) == []


def test_a_long_prompts_log_probabilities_never_hold_its_whole_logits() -> None:
    """The target's head makes a scored prompt's logits LOGPROB_ROWS rows at a time (a [P, V] matrix is V * 4 bytes a
    prompt token: 0.6 MB with Qwen's vocabulary); the numbers are one plain forward's. Speculation still runs."""
    from dsde_core.sampling import LOGPROB_ROWS

    prompt = random_prompts(1, seed=11, min_len=600, max_len=600)[0]
    engine = tiny_engine("static:4", batch=2, max_seq_len=1024)
    heads: list[int] = []
    engine.target.runner.model.lm_head.register_forward_hook(lambda _m, args, _o: heads.append(args[0].shape[0]))
    r = engine.add_request(prompt, SamplingParams(max_tokens=8, prompt_logprobs=TOP))
    plain = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8))
    engine.run()
    assert max(heads) <= LOGPROB_ROWS and len(heads) > 3  # three chunks for 599 positions, then the decode steps
    with torch.no_grad():
        logits = hf_target()(torch.tensor([prompt], device=DEVICE)).logits[0].float()
    ref = torch.log_softmax(logits[:-1], dim=-1).cpu()  # [P-1, V]
    assert len(r.prompt_logprobs) == len(prompt) - 1
    for j, (token, lp) in enumerate(zip(prompt[1:], r.prompt_logprobs, strict=True)):
        assert lp.logprob == pytest.approx(ref[j, token].item(), abs=1e-4)
        assert [v for _, v in lp.top] == pytest.approx(ref[j].topk(TOP).values.tolist(), abs=1e-4)
    assert len(r.output_ids) == len(plain.output_ids) == 8 and r.stats.drafted > 0
