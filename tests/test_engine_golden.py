"""A fixed seed gives the same tokens and the same step log: fixed scenarios on the tiny fp32 models of tests/tiny.py
(five policies, greedy and seeded T=1 requests, continuous batching with more requests than slots, chunked prefills,
cancellation, stop strings, log-probabilities, scripted draft, target and policy faults) against the outputs, streams,
step logs (batch, ks, emitted, prefill, contexts), engine.state() and worker calls in tests/data/engine_golden.json.

Time is a fake clock that moves only when a model runs (a fixed cost per forward and per token) or the engine sleeps,
so the step times, the costs the cost-aware policy (dsde-goodput) plans with, and the recovery waits are the same on
every run. After a deliberate change of behaviour, write the file again: `python -m tests.test_engine_golden`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dsde_core.config import EngineConfig, SamplingParams, SpeculationParams
from dsde_core.engine import Engine
from dsde_core.models.runner import ModelRunner
from dsde_core.policies import make_policy
from dsde_core.request import Request, RequestOutput
from dsde_core.sampling import TokenLogprob
from dsde_core.workers import DraftWorker, TargetWorker
from tests.test_engine_recovery import Flaky
from tests.tiny import DEVICE, FakeClock, IdTokenizer, random_prompts, tiny_pair

GOLDEN = Path(__file__).parent / "data" / "engine_golden.json"
POLICIES = ("off", "static:3", "dsde", "dsde-goodput", "adaedl")
FAULTS = ("draft-batch-fault", "draft-one-request", "draft-dies", "target-batch-fault", "target-one-request",
          "target-dies", "policy-faults", "commit-fault")
SCENARIOS = ([f"policy:{p}" for p in POLICIES] + [f"chunked:{p}" for p in ("static:3", "dsde-goodput")]
             + ["features"] + [f"fault:{f}" for f in FAULTS])


def _engine(clock: FakeClock, policy: str, batch: int = 3, seq: int = 256, eos: tuple[int, ...] = (),
            **cfg: Any) -> tuple[Engine, dict[str, Flaky]]:
    """An engine over the tiny pair whose three parties can be scripted to fault, die and restart (Flaky)."""
    target_model, draft_model = tiny_pair()
    config = EngineConfig(max_batch_size=batch, max_seq_len=seq, dtype="float32", device="cpu", **cfg)
    parties = {
        "target": Flaky("target", lambda: TargetWorker(clock.timed(ModelRunner(target_model, batch, seq), 0.02, 2e-4))),
        "draft": Flaky("draft", lambda: DraftWorker.from_config(
            clock.timed(ModelRunner(draft_model, batch, seq), 0.004, 1e-4), config)),
        "policy": Flaky("policy", lambda: make_policy(policy)),
    }
    engine = Engine(parties["target"], parties["draft"], parties["policy"], IdTokenizer(), config, eos_ids=eos,
                    vocab_size=96)
    return engine, parties


def _lp(lps: list[TokenLogprob] | None) -> list[Any] | None:
    return None if lps is None else [[lp.logprob, [list(t) for t in lp.top]] for lp in lps]


class Run:
    """One scenario: its requests, each output in the order the engine emitted it, and what the engine ends with."""

    def __init__(self, engine: Engine, parties: dict[str, Flaky]) -> None:
        self.engine, self.parties = engine, parties
        self.reqs: list[Request] = []
        self.stream: list[list[Any]] = []

    def add(self, prompt: list[int], params: SamplingParams, spec: SpeculationParams | None = None) -> Request:
        def sink(o: RequestOutput) -> None:
            self.stream.append([o.req_id, list(o.token_ids), o.text, o.finished, o.finish_reason, o.error,
                                o.error_type, o.stop_reason, _lp(o.logprobs), _lp(o.prompt_logprobs)])

        r = self.engine.add_request(prompt, params, spec, on_output=sink)
        self.reqs.append(r)
        return r

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.engine.step()

    def finish(self, limit: int = 3000) -> dict[str, Any]:
        for _ in range(limit):
            if not self.engine.has_unfinished():
                break
            self.engine.step()
        assert not self.engine.has_unfinished()
        e = self.engine
        return {
            "requests": [{"id": r.req_id, "output": r.output_ids, "text": r.text, "finish": r.finish_reason,
                          "stop_reason": r.stop_reason, "error": r.error, "sl": r.stats.sl, "steps": r.stats.steps,
                          "accepted": r.stats.accepted, "draft_off": r.draft_off, "logprobs": _lp(r.logprobs),
                          "prompt_logprobs": _lp(r.prompt_logprobs)} for r in self.reqs],
            "stream": self.stream,
            "step_log": [{"batch": s.batch, "ks": s.ks, "emitted": s.emitted, "prefill": s.prefill,
                          "contexts": s.contexts} for s in e.step_log],
            "step_times": [[s.draft_s, s.target_s, s.total_s] for s in e.step_log],  # the fake clock's
            "state": e.state(),
            "prefill_chunks": dict(e.prefill_chunks),
            "costs_observed": e.costs.observed,
            "calls": {role: dict(sorted(p.calls.items())) for role, p in self.parties.items()},
            "probes": {role: p.probes for role, p in self.parties.items()},
            "free_slots": sorted(e.free_slots),
        }


def _mixed(run: Run, n: int, seed: int, max_len: int = 30) -> None:
    """n requests: even ones greedy, odd ones T=1 seeded (every third with top-p)."""
    for i, p in enumerate(random_prompts(n, seed=seed, max_len=max_len)):
        t = 0.0 if i % 2 == 0 else 1.0
        run.add(p, SamplingParams(max_tokens=10 + 3 * i, temperature=t, seed=i if t else None,
                                  top_p=0.9 if i % 3 == 0 and t else 1.0))


def policy_run(clock: FakeClock, policy: str) -> dict[str, Any]:
    """More requests than slots, greedy and seeded T=1, two of them added mid-run."""
    run = Run(*_engine(clock, policy, batch=3))
    _mixed(run, 5, seed=5)
    run.steps(3)
    for i, p in enumerate(random_prompts(2, seed=6)):
        run.add(p, SamplingParams(max_tokens=14, temperature=1.0 if i else 0.0, seed=50 + i))
    return run.finish()


def chunked_run(clock: FakeClock, policy: str) -> dict[str, Any]:
    """Long prompts over a small prefill budget for both models while short ones decode; one scores its prompt."""
    run = Run(*_engine(clock, policy, batch=4, seq=512, prefill_chunk=16))
    for p in random_prompts(2, seed=22, min_len=3, max_len=10):
        run.add(p, SamplingParams(max_tokens=40))
    run.steps(1)
    longs = random_prompts(2, seed=21, min_len=50, max_len=80)
    run.add(longs[0], SamplingParams(max_tokens=16, prompt_logprobs=2, logprobs=1))
    run.add(longs[1], SamplingParams(max_tokens=16, temperature=1.0, seed=3))
    return run.finish()


def features_run(clock: FakeClock) -> dict[str, Any]:
    """Cancellation (running and waiting), stop strings, stop token ids, eos, min_tokens, logprobs, per-request
    speculation, at batch 2."""
    run = Run(*_engine(clock, "dsde", batch=2, eos=(7,)))
    ps = random_prompts(8, seed=9, max_len=20)
    run.add(ps[0], SamplingParams(max_tokens=40))
    doomed = run.add(ps[1], SamplingParams(max_tokens=40, temperature=1.0, seed=1))
    run.add(ps[2], SamplingParams(max_tokens=30, stop=("<1", "9>"), logprobs=2, prompt_logprobs=1))
    waiting = run.add(ps[3], SamplingParams(max_tokens=30))
    run.add(ps[4], SamplingParams(max_tokens=30, stop=("<2",), include_stop_str_in_output=True),
            SpeculationParams(max_sl=2))
    run.add(ps[5], SamplingParams(max_tokens=30, stop_token_ids=(3, 11, 40), min_tokens=5),
            SpeculationParams(enabled=False))
    run.add(ps[6], SamplingParams(max_tokens=25, ignore_eos=True, temperature=0.7, seed=6, top_k=10))
    run.add(ps[7], SamplingParams(max_tokens=25, presence_penalty=0.5, logit_bias={5: 2.0}))
    run.steps(2)
    run.engine.cancel(waiting.req_id)  # one a step: the engine ends a step's cancellations in no fixed order
    run.steps(1)
    run.engine.cancel(doomed.req_id)
    return run.finish()


class _Broken:
    """A text stream that raises: a bug in one request's output."""

    stopped, text = False, ""

    def add(self, ids: list[int]) -> str:
        raise ValueError("no text for these ids")


def fault_run(clock: FakeClock, name: str) -> dict[str, Any]:
    engine, parties = _engine(clock, "static:3" if name.startswith("draft") else "dsde", batch=3, worker_probe_s=0.001)
    run = Run(engine, parties)
    _mixed(run, 6, seed=11)
    target, draft, policy = parties["target"], parties["draft"], parties["policy"]
    bad = run.reqs[2]
    if name == "draft-batch-fault":  # a passing fault: the batch's call, then each suspect alone
        draft.fault_at = ("propose", 3)
    elif name == "draft-one-request":  # the draft raises whenever one request is in the call: it goes target-only
        draft.fault_if = lambda m, args: m == "propose" and any(t.slot == bad.slot for t in args[0])
    elif name == "draft-dies":
        draft.kill_at = ("propose", 4)
        draft.restart_after_probes = 3
    elif name == "target-batch-fault":  # a passing fault, then a release that raises
        target.fault_at = ("verify", 4)
        target.fault_if = lambda m, args: m == "release" and target.calls[m] == 1
    elif name == "target-one-request":  # the target raises whenever one request is in the call (after 2): it ends
        target.fault_if = lambda m, args: (m == "verify" and any(t.slot == bad.slot for t in args[0])
                                           and target.calls[m] > 2)
    elif name == "target-dies":
        target.kill_at = ("verify", 5)
        target.restart_after_probes = 3
    elif name == "policy-faults":
        policy.fault_at = ("observe", 3)
        draft.fault_at = ("release", 1)
    elif name == "commit-fault":
        bad.detok = _Broken()
    return run.finish()


def scenario(name: str) -> dict[str, Any]:
    """Run one scenario under a fresh fake clock; its result as the JSON file holds it (tuples as lists)."""
    kind, _, arg = name.partition(":")
    runs: dict[str, Callable[[FakeClock], dict[str, Any]]] = {
        "policy": lambda c: policy_run(c, arg), "chunked": lambda c: chunked_run(c, arg),
        "features": features_run, "fault": lambda c: fault_run(c, arg)}
    clock = FakeClock()
    perf_counter, sleep = time.perf_counter, time.sleep
    time.perf_counter, time.sleep = clock, clock.sleep
    try:
        return json.loads(json.dumps(runs[kind](clock)))
    finally:
        time.perf_counter, time.sleep = perf_counter, sleep


def _logprob_values(result: dict[str, Any]) -> tuple[dict[str, Any], list[float]]:
    """(the result with every log-probability replaced by 0, those log-probabilities in order): the tokens and their
    order compare exactly, the values within float noise."""
    values: list[float] = []

    def strip(lps: list[Any] | None) -> list[Any] | None:
        if lps is None:
            return None
        values.extend(v for lp, top in lps for v in [lp] + [t[1] for t in top])
        return [[0, [[t[0], 0] for t in top]] for _, top in lps]

    out = json.loads(json.dumps(result))
    for r in out["requests"]:
        r["logprobs"], r["prompt_logprobs"] = strip(r["logprobs"]), strip(r["prompt_logprobs"])
    for o in out["stream"]:
        o[8], o[9] = strip(o[8]), strip(o[9])
    return out, values


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny models run fastest on one thread (the outputs are the same on any number)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.mark.skipif(DEVICE != "cpu", reason="the golden file holds the CPU's fp32 outputs")
@pytest.mark.parametrize("name", SCENARIOS)
def test_a_fixed_seed_gives_the_same_tokens_and_step_log(golden: dict[str, Any], name: str) -> None:
    got, got_values = _logprob_values(scenario(name))
    want, want_values = _logprob_values(golden[name])
    for key in want:  # key by key, so a failure names what changed
        assert got[key] == want[key], key
    assert got.keys() == want.keys()
    assert got_values == pytest.approx(want_values, abs=1e-5)


def test_the_scenarios_exercise_what_they_are_named_for(golden: dict[str, Any]) -> None:
    """The golden file is worth comparing against: speculation, chunks, stops, log-probabilities and each fault
    happened in it."""
    assert golden.keys() == set(SCENARIOS)
    drafted = {name: sum(sum(s["ks"]) for s in g["step_log"]) for name, g in golden.items()}
    assert drafted["policy:off"] == 0 and all(drafted[f"policy:{p}"] > 0 for p in POLICIES if p != "off")
    assert all(golden[f"chunked:{p}"]["prefill_chunks"] == {"target": 8, "draft": 8} for p in ("static:3",
                                                                                                "dsde-goodput"))
    features = [r["finish"] for r in golden["features"]["requests"]]
    assert features.count("cancelled") == 2 and features.count("stop") == 3
    assert [r["draft_off"] for r in golden["fault:draft-one-request"]["requests"]].count(True) == 1
    assert [r["finish"] for r in golden["fault:target-one-request"]["requests"]].count("error") == 1
    assert [r["finish"] for r in golden["fault:commit-fault"]["requests"]].count("error") == 1
    for name, role in (("draft-batch-fault", "draft"), ("draft-dies", "draft"), ("target-batch-fault", "target"),
                       ("target-dies", "target"), ("policy-faults", "policy")):
        assert golden[f"fault:{name}"]["state"]["workers"][role]["failures"] >= 1, name


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({name: scenario(name) for name in SCENARIOS}, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN}")
