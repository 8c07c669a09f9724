"""The engine's contract on each runner backend: the same tests on the torch runner and on llama.cpp (tiny F32 GGUF
files of the same weights). The reference is always the target as that backend computes it: target-only decoding
through the same engine on the same runner."""

from __future__ import annotations

import collections
import functools
import importlib.util

import pytest
import torch

from dsde_core.config import SamplingParams
from dsde_core.sampling import TokenLogprob
from tests.tiny import VOCAB, random_prompts, tiny_engine, tiny_runners

BACKENDS = ["torch", pytest.param("llama.cpp", marks=pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed (make setup builds it)"))]
POLICIES = ["static:2", "static:5", "dsde", "dsde-goodput", "adaedl", "heuristic"]
PROMPTS = random_prompts(8, seed=11)
MAX_TOKENS = [6 + (9 * i) % 30 for i in range(len(PROMPTS))]


def _outputs(engine, params: list[SamplingParams], prompts=PROMPTS) -> list[list[int]]:
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.run()
    assert all(r.finished for r in reqs) and not engine.requests
    return [r.output_ids for r in reqs]


def _greedy() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m) for m in MAX_TOKENS]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@functools.cache
def _reference(backend: str) -> tuple[tuple[int, ...], ...]:
    engine = tiny_engine("off", batch=1, backend=backend)
    return tuple(tuple(_outputs(engine, [sp], [p])[0]) for p, sp in zip(PROMPTS, _greedy(), strict=True))


@pytest.fixture
def reference(backend: str) -> list[list[int]]:
    """Target-only greedy outputs on this backend, one request at a time."""
    return [list(out) for out in _reference(backend)]


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_speculation_is_lossless(backend: str, policy: str, reference: list[list[int]]) -> None:
    """Every policy, 8 requests through 3 slots (continuous batching, mixed lengths): target-only's tokens."""
    engine = tiny_engine(policy, batch=3, backend=backend)
    assert _outputs(engine, _greedy()) == reference
    assert sum(s.ks and max(s.ks) > 0 for s in engine.step_log) > 0  # it speculated


def test_chunked_prefill_and_a_windowed_draft_are_lossless(backend: str, reference: list[list[int]]) -> None:
    engine = tiny_engine("static:3", batch=4, backend=backend, prefill_chunk=7)
    assert _outputs(engine, _greedy()) == reference
    assert engine.prefill_chunks["target"] > 0 and engine.prefill_chunks["draft"] > 0
    assert _outputs(tiny_engine("static:3", batch=4, backend=backend, draft_window=5), _greedy()) == reference


def test_stop_tokens_logprobs_and_cancellation(backend: str, reference: list[list[int]]) -> None:
    """A stop token ends a request where target-only's output has it; each token's log-probability is the target's
    own (one plain forward of prompt + output); a cancelled request frees every slot."""
    engine = tiny_engine("static:4", batch=2, backend=backend)
    ref = reference[0]
    stop = ref[4]
    [out] = _outputs(engine, [SamplingParams(max_tokens=MAX_TOKENS[0], stop_token_ids=(stop,), logprobs=2)],
                     PROMPTS[:1])
    assert out == ref[: ref.index(stop)]
    req = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=30))
    engine.step()
    engine.cancel(req.req_id)
    engine.run()
    assert req.finish_reason == "cancelled" and len(engine.free_slots) == 2

    engine = tiny_engine("static:4", batch=1, backend=backend)
    r = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=10, logprobs=0))
    engine.run()
    target, _ = tiny_runners(1, 256, backend=backend)
    ids = PROMPTS[2] + r.output_ids
    logits = target.forward([0], [ids], [len(r.output_ids) + 1])  # [n + 1, V]
    want = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(r.output_ids)[:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in r.logprobs])
    assert all(isinstance(lp, TokenLogprob) for lp in r.logprobs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_sampling_at_temperature_one_draws_the_targets_distribution(backend: str) -> None:
    """Rejection sampling through the backend: the first two tokens of N seeded requests under static:2 are
    distributed as the target's p(x1) p(x2 | x1) (its own logits on this backend), by a chi-square test on x1 and on
    x2 after the likeliest x1."""
    from scipy.stats import chisquare

    prompt, n = PROMPTS[3], 1500
    engine = tiny_engine("static:2", batch=16, backend=backend, noise=0.3)  # a draft that is often rejected
    reqs = [engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=1.0, seed=s)) for s in range(n)]
    engine.run()
    drafted = sum(r.stats.drafted for r in reqs)
    assert drafted > 0 and sum(r.stats.accepted for r in reqs) < drafted  # both accept and reject paths ran

    target, _ = tiny_runners(2, 256, backend=backend)
    p1 = torch.softmax(target.forward([0], [prompt], [1])[0], -1)  # [V]
    x1 = collections.Counter(r.output_ids[0] for r in reqs)
    top = max(x1, key=x1.get)
    p2 = torch.softmax(target.forward([1], [prompt + [top]], [1])[0], -1)  # [V]
    x2 = collections.Counter(r.output_ids[1] for r in reqs if r.output_ids[0] == top)
    for counts, p in ((x1, p1), (x2, p2)):
        total = sum(counts.values())
        keep = [t for t in range(VOCAB) if p[t] * total >= 5]  # cells with expected counts >= 5; the rest pooled
        obs = [counts.get(t, 0) for t in keep] + [total - sum(counts.get(t, 0) for t in keep)]
        exp = [float(p[t]) * total for t in keep]
        exp.append(total - sum(exp))
        assert len(keep) >= 3 and chisquare(obs, exp).pvalue > 1e-3, (obs, [round(e, 1) for e in exp])


def test_the_draft_lost_and_back_costs_nothing(backend: str, reference: list[list[int]]) -> None:
    """A draft that raises mid-run: the engine goes on target-only, brings it back, and the output is unchanged."""
    engine = tiny_engine("static:3", batch=3, backend=backend, worker_probe_s=0.001)
    propose, calls = engine.draft.propose, [0]

    def flaky(tasks, *a):
        calls[0] += 1
        if calls[0] in (3, 4):
            raise RuntimeError("draft fault")
        return propose(tasks, *a)

    engine.draft.propose = flaky
    assert _outputs(engine, _greedy()) == reference
    assert engine.health["draft"].failures >= 1 and engine.health["draft"].recoveries >= 1
