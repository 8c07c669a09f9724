"""The engine's recovery from failed workers, in-process: a fake worker that "dies" (every call raises
WorkerUnavailable and `available()` is False), then "restarts" (a fresh worker over a fresh KV cache, all slots
lost), exactly what a Ray actor restart looks like through services.proxies.

At temperature 0 every request still ends with the target-only output, token for token, nothing repeated or
missing; the state of every party is freed at the end; a target that does not come back in time ends each
request with a clear error."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import pytest

from dsde_core.async_engine import AsyncEngine
from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.engine import DRAFT_TRIES, Engine
from dsde_core.errors import WorkerUnavailable
from dsde_core.models.runner import ModelRunner
from dsde_core.policies import make_policy
from dsde_core.recovery import MAX_FAULT_WAIT_S, WorkerHealth
from dsde_core.request import RequestOutput
from dsde_core.workers import DraftWorker, TargetWorker
from tests.tiny import IdTokenizer, random_prompts, tiny_engine, tiny_pair

BATCH, SEQ = 4, 256
PROMPTS = random_prompts(8, seed=11)
MAX_TOKENS = [20 + 5 * i for i in range(len(PROMPTS))]  # 20..55


class Flaky:
    """A worker (or policy) that can die and restart. Dead: every call raises WorkerUnavailable and available()
    is False. restart(): a fresh inner object (empty caches, no slots, no per-request state). It can also fault:
    raise another error (`error`) from one call (`fault_at`) or from every call of a method (`faulty`) while it
    lives on, state and all."""

    def __init__(self, role: str, factory: Callable[[], Any]) -> None:
        self.role, self.factory = role, factory
        self.inner = factory()
        self.dead = False
        self.calls: dict[str, int] = {}
        self.kill_at: tuple[str, int] | None = None  # die on the n-th call of a method (1-based)
        self.restart_after_probes: int | None = None  # come back after this many available() calls
        self.fault_at: tuple[str, int] | None = None  # raise `error` from the n-th call of a method (1-based)
        self.faulty: str | None = None  # raise `error` from every call of this method
        self.fault_if: Callable[[str, tuple[Any, ...]], bool] | None = None  # raise `error` where (name, args) holds
        self.error: Callable[[str], Exception] = lambda name: RuntimeError(f"{name}: an illegal memory access")
        self.probes = 0
        self.restarts = 0

    def kill(self) -> None:
        self.dead = True
        self.probes = 0

    def restart(self) -> None:
        self.inner = self.factory()
        self.dead = False
        self.restarts += 1

    def available(self) -> bool:
        if self.dead:
            self.probes += 1
            if self.restart_after_probes is not None and self.probes >= self.restart_after_probes:
                self.restart()
        return not self.dead

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr) or name in ("num_open", "num_tracked"):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.kill_at == (name, self.calls[name]):
                self.kill()
            if self.dead:
                raise WorkerUnavailable(self.role, f"{name}: the actor died")
            if (self.fault_at == (name, self.calls[name]) or self.faulty == name
                    or (self.fault_if is not None and self.fault_if(name, args))):
                raise self.error(name)
            return getattr(self.inner, name)(*args, **kwargs)

        return call


def _engine(policy: str = "static:4", wait_s: float = 30.0, flaky: tuple[str, ...] = ("draft", "target", "policy"),
            ) -> tuple[Engine, dict[str, Flaky]]:
    target_model, draft_model = tiny_pair()
    cfg = EngineConfig(max_batch_size=BATCH, max_seq_len=SEQ, dtype="float32", worker_wait_s=wait_s,
                       worker_probe_s=0.001)
    factories: dict[str, Callable[[], Any]] = {
        "target": lambda: TargetWorker(ModelRunner(target_model, BATCH, SEQ)),
        "draft": lambda: DraftWorker.from_config(ModelRunner(draft_model, BATCH, SEQ), cfg),
        "policy": lambda: make_policy(policy),
    }
    parties = {role: Flaky(role, f) if role in flaky else f() for role, f in factories.items()}
    engine = Engine(parties["target"], parties["draft"], parties["policy"], IdTokenizer(), cfg, vocab_size=96)
    return engine, {r: p for r, p in parties.items() if isinstance(p, Flaky)}


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    engine = tiny_engine("off", batch=1, with_draft=False)
    out = []
    for p, m in zip(PROMPTS, MAX_TOKENS, strict=True):
        r = engine.add_request(p, SamplingParams(max_tokens=m))
        engine.run()
        out.append(r.output_ids)
    return out


def _add_all(engine: Engine, emitted: dict[str, list[int]]) -> list[Any]:
    def sink(out: RequestOutput) -> None:
        emitted.setdefault(out.req_id, []).extend(out.token_ids)

    return [engine.add_request(p, SamplingParams(max_tokens=m), on_output=sink)
            for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]


def _run_bounded(engine: Engine, steps: int = 2000) -> None:
    for _ in range(steps):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("the engine did not finish its requests")


def _drafted(reqs: list[Any]) -> int:
    return sum(r.stats.drafted for r in reqs)


def _drafted_when(engine: Engine, reqs: list[Any], event: Callable[[], bool], steps: int = 2000) -> int | None:
    """Run the engine until its requests finish (bounded); the tokens drafted by the end of the first step after
    which event() holds (None: it never did)."""
    at = None
    for _ in range(steps):
        if not engine.has_unfinished():
            return at
        engine.step()
        if at is None and event():
            at = _drafted(reqs)
    raise AssertionError("the engine did not finish its requests")


def _restart(engine: Engine, party: Flaky) -> None:
    """Restart a party and wait past the engine's next probe of it, however fast the restart was."""
    party.restart()
    time.sleep(2 * engine.config.worker_probe_s)


def _assert_all_freed(engine: Engine, parties: dict[str, Any]) -> None:
    state = engine.state()
    assert not engine.running and not engine.waiting and not engine.requests
    assert state["tried_alone"] == state["draft_tried_alone"] == state["draft_off"] == 0
    assert len(engine.free_slots) == BATCH
    for role in ("target", "draft"):
        if role in parties and not parties[role].dead:
            assert parties[role].num_open() == 0, role
    if "policy" in parties and not parties["policy"].dead:
        assert parties["policy"].num_tracked() == 0
    assert all(not h.pending for h in engine.health.values() if not h.down)


def test_draft_failure_continues_target_only_then_speculation_resumes(reference: list[list[int]]) -> None:
    engine, parties = _engine()
    draft = parties["draft"]
    draft.kill_at = ("propose", 4)  # dies in the middle of the 4th step that drafts
    draft.restart_after_probes = 5  # and comes back (with empty caches, no slots) a few steps later
    recovered: list[str] = []
    engine.recovery_hooks.append(recovered.append)
    emitted: dict[str, list[int]] = {}
    reqs = _add_all(engine, emitted)
    drafted_at_recovery = _drafted_when(engine, reqs, lambda: bool(recovered))
    assert [r.output_ids for r in reqs] == reference
    assert [emitted[r.req_id] for r in reqs] == reference  # streamed: nothing repeated, nothing missing
    assert draft.restarts == 1 and recovered == ["draft"]
    h = engine.health["draft"]
    assert h.failures == 1 and h.recoveries == 1 and not h.down
    assert drafted_at_recovery is not None and _drafted(reqs) > drafted_at_recovery  # resumed
    assert any(k == 0 for r in reqs for k in r.stats.sl)  # target-only steps while the draft was away
    _assert_all_freed(engine, parties)


def test_draft_that_never_comes_back_leaves_target_only_decoding(reference: list[list[int]]) -> None:
    engine, parties = _engine("dsde")
    parties["draft"].kill_at = ("propose", 2)
    reqs = _add_all(engine, {})
    _run_bounded(engine)
    assert [r.output_ids for r in reqs] == reference
    assert engine.health["draft"].down and all(r.finish_reason == "length" for r in reqs)
    assert parties["draft"].calls["propose"] == 2  # no call to a dead draft after the failure; probes only
    # the slots released while the draft was down wait for it; everything else is free
    assert engine.health["draft"].pending == set(range(BATCH))
    _restart(engine, parties["draft"])
    engine.step()  # nothing to run: the probe brings the draft back and flushes its deferred releases
    assert not engine.health["draft"].down and not engine.health["draft"].pending
    _assert_all_freed(engine, parties)


@pytest.mark.parametrize("when", [("verify", 3), ("verify", 9), ("open", 2)])
def test_target_failure_reprefills_and_continues_exactly(reference: list[list[int]], when: tuple[str, int]) -> None:
    engine, parties = _engine("dsde")
    target = parties["target"]
    target.kill_at = when
    target.restart_after_probes = 4
    emitted: dict[str, list[int]] = {}
    reqs = _add_all(engine, emitted)
    _run_bounded(engine)
    assert [r.output_ids for r in reqs] == reference
    assert [emitted[r.req_id] for r in reqs] == reference
    assert target.restarts == 1 and engine.health["target"].recoveries == 1
    assert all(r.finish_reason == "length" for r in reqs)
    _assert_all_freed(engine, parties)


def test_silent_restart_is_found_by_lost_slots_and_recovered(reference: list[list[int]]) -> None:
    """A worker restarted between two steps answers, but without the slots: WorkerStateLost, then a resync."""
    engine, parties = _engine()
    reqs = _add_all(engine, {})
    for _ in range(3):
        engine.step()
    parties["target"].restart()
    parties["draft"].restart()
    _run_bounded(engine)
    assert [r.output_ids for r in reqs] == reference
    assert engine.health["target"].recoveries == 1 and engine.health["draft"].recoveries == 1
    assert "not open" in engine.health["target"].last_error
    _assert_all_freed(engine, parties)


def test_target_that_does_not_come_back_ends_each_request_with_an_error() -> None:
    engine, parties = _engine("dsde", wait_s=0.3)
    parties["target"].kill_at = ("verify", 3)
    outs: dict[str, RequestOutput] = {}
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m), on_output=lambda o: outs.__setitem__(o.req_id, o))
            for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    t0 = time.perf_counter()
    _run_bounded(engine, steps=10_000)
    took = time.perf_counter() - t0
    assert 0.3 <= took < 5  # the configured wait, not a hang
    for r in reqs:
        assert r.finish_reason == "error" and "did not come back within 0.3s" in r.error
        assert outs[r.req_id].finished and outs[r.req_id].error_type == "unavailable"
    assert not engine.running and not engine.waiting and not engine.requests and len(engine.free_slots) == BATCH
    assert parties["policy"].num_tracked() == 0
    # the target comes back later: deferred releases go out, and new requests are served
    parties["target"].restart()
    r = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS[0]))
    _run_bounded(engine)
    assert r.finish_reason == "length" and len(r.output_ids) == MAX_TOKENS[0]
    _assert_all_freed(engine, parties)


def test_policy_failure_plans_target_only_and_rebuilds_its_state(reference: list[list[int]]) -> None:
    engine, parties = _engine("dsde")
    policy = parties["policy"]
    policy.kill_at = ("plan", 5)
    policy.restart_after_probes = 3
    reqs = _add_all(engine, {})
    steps_down = 0
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        steps_down += engine.health["policy"].down
    assert [r.output_ids for r in reqs] == reference
    assert policy.restarts == 1 and engine.health["policy"].recoveries == 1 and steps_down >= 1
    assert _drafted(reqs) > 0
    _assert_all_freed(engine, parties)


def test_cancel_while_the_target_is_down_frees_everything() -> None:
    engine, parties = _engine("dsde")
    parties["target"].kill_at = ("verify", 2)
    reqs = _add_all(engine, {})
    for _ in range(3):
        engine.step()
    assert engine.health["target"].down and engine.running
    for r in reqs:
        engine.cancel(r.req_id)
    engine.step()
    assert all(r.finish_reason == "cancelled" for r in reqs)
    assert not engine.running and not engine.waiting and not engine.requests and len(engine.free_slots) == BATCH
    assert engine.health["target"].pending  # its releases wait for it
    _restart(engine, parties["target"])
    engine.step()
    _assert_all_freed(engine, parties)


def test_sampling_survives_both_workers_failing() -> None:
    """T > 0: the output distribution stays the target's (rejection sampling with any draft); here: every request
    completes with its full length after the draft and then the target fail and restart."""
    engine, parties = _engine("dsde")
    parties["draft"].kill_at = ("propose", 3)
    parties["draft"].restart_after_probes = 2
    parties["target"].kill_at = ("verify", 8)
    parties["target"].restart_after_probes = 2
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.8, seed=i))
            for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))]
    _run_bounded(engine)
    assert all(r.finish_reason == "length" and len(r.output_ids) == r.params.max_tokens for r in reqs)
    assert engine.health["draft"].recoveries == 1 and engine.health["target"].recoveries == 1
    _assert_all_freed(engine, parties)


def test_a_seeded_slot_opened_again_after_output_does_not_replay_its_first_draws() -> None:
    """T > 0: a restarted worker opens a seeded request's slot with a generator seeded from the request's seed and its
    output's length, so the draws after the restart are not the first steps' again (the target restarts at verify 4,
    the draft at propose 3: each reopens every slot). Before any output a slot draws from the request's own seed, and
    the slot's parameters keep it."""
    from dsde_core.sampling import make_generator

    engine, parties = _engine("static:4")
    parties["draft"].kill_at = ("propose", 3)
    parties["draft"].restart_after_probes = 2
    parties["target"].kill_at = ("verify", 4)
    parties["target"].restart_after_probes = 2
    reqs = [engine.add_request(p, SamplingParams(max_tokens=30, temperature=1.0, seed=i)) for i, p in
            enumerate(PROMPTS[:2])]
    seeds: dict[str, set[int]] = {"draft": set(), "target": set()}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        for role, party in parties.items():
            if role != "policy" and not party.dead:
                seeds[role] |= {(i, party.inner.slots[r.slot].gen.initial_seed()) for i, r in enumerate(reqs)
                                if r.slot in party.inner.slots}
    assert engine.health["draft"].recoveries == engine.health["target"].recoveries == 1
    for role, worker in (("draft", DraftWorker), ("target", TargetWorker)):
        own = {(i, make_generator(i, worker.stream).initial_seed()) for i in range(len(reqs))}
        assert own < seeds[role] and len(seeds[role]) == 2 * len(reqs), role  # each: its own seed, then another
    assert all(len(r.output_ids) == 30 for r in reqs)
    assert [r.params.seed for r in reqs] == [0, 1]


def test_state_reports_counts_and_health() -> None:
    engine, parties = _engine()
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=30))
    engine.step()
    s = engine.state()
    assert s["running"] == 1 and s["requests"] == 1 and s["slots_in_use"] == 1
    assert s["workers"]["target"]["up"] and s["workers"]["draft"]["failures"] == 0
    parties["draft"].kill()
    engine.step()
    s = engine.state()
    assert not s["workers"]["draft"]["up"] and "died" in s["workers"]["draft"]["last_error"]


# ---- faults: the draft or the policy raises an error and lives on ------------------------------------------------
@pytest.mark.parametrize("when", [("propose", 4), ("open", 3), ("release", 2)])
def test_a_draft_fault_continues_target_only_then_speculation_resumes(reference: list[list[int]],
                                                                       when: tuple[str, int]) -> None:
    engine, parties = _engine()
    draft = parties["draft"]
    draft.fault_at = when
    emitted: dict[str, list[int]] = {}
    reqs = _add_all(engine, emitted)
    drafted_at_fault = _drafted_when(engine, reqs, lambda: engine.health["draft"].failures > 0)
    assert [r.output_ids for r in reqs] == reference  # no request failed, and the output is the target's
    assert [emitted[r.req_id] for r in reqs] == reference
    h = engine.health["draft"]
    assert h.failures == h.recoveries == h.faults == 1 and not h.down and draft.restarts == 0
    assert h.last_error == f"RuntimeError: {when[0]}: an illegal memory access"
    assert drafted_at_fault is not None and _drafted(reqs) > drafted_at_fault  # the same worker drafts again
    assert not any(r.draft_off for r in reqs)  # a passing fault: each drafted alone once, passed, and drafts on
    _assert_all_freed(engine, parties)


@pytest.mark.parametrize("when", [("plan", 5), ("observe", 5), ("release", 1)])
def test_a_policy_fault_plans_target_only_and_the_policy_comes_back(reference: list[list[int]],
                                                                    when: tuple[str, int]) -> None:
    engine, parties = _engine("dsde")
    parties["policy"].fault_at = when
    reqs = _add_all(engine, {})
    _run_bounded(engine)
    assert [r.output_ids for r in reqs] == reference
    h = engine.health["policy"]
    assert h.failures == h.recoveries == h.faults == 1 and not h.down and parties["policy"].restarts == 0
    assert _drafted(reqs) > 0
    _assert_all_freed(engine, parties)


def test_a_draft_fault_that_one_request_causes_turns_speculation_off_for_that_request_only(
        reference: list[list[int]]) -> None:
    """The draft raises whenever one request is in its call (as a kernel that breaks on one request's data would):
    that request, tried alone twice, goes on target-only; the others draft again while it still runs (before: the
    draft sat out faulting until that request ended). Every output is the target-only output."""
    engine, parties = _engine("static:4")
    reqs = _add_all(engine, {})
    bad = reqs[3]  # in the first batch, and outlives that batch's others
    parties["draft"].fault_if = lambda name, args: name == "propose" and any(t.slot == bad.slot for t in args[0])
    at_off = at_end = None  # tokens the others had drafted when bad was switched off, and when it ended
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        others = sum(r.stats.drafted for r in reqs if r is not bad)
        at_off = others if at_off is None and bad.draft_off else at_off
        at_end = others if at_end is None and bad.finished else at_end
    assert [r.output_ids for r in reqs] == reference and all(r.finish_reason == "length" for r in reqs)
    assert bad.draft_off and bad.stats.drafted == 0 and not any(r.draft_off for r in reqs if r is not bad)
    assert at_off is not None and at_end is not None and at_end > at_off  # they drafted while bad ran target-only
    h = engine.health["draft"]
    assert h.failures == 3 and h.faults == 1 and not h.down  # the batch's call (it sat out), then bad's two alone
    _assert_all_freed(engine, parties)


def test_a_draft_that_always_faults_is_tried_less_and_less_often(reference: list[list[int]]) -> None:
    """Each batch's call that faults doubles the draft's wait; each request is then tried alone at most DRAFT_TRIES
    times and goes on target-only."""
    engine, parties = _engine()
    draft = parties["draft"]
    draft.faulty = "propose"
    reqs = _add_all(engine, {})
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished() and steps < 2000:
        engine.step()
        steps += 1
    took = time.perf_counter() - t0
    assert [r.output_ids for r in reqs] == reference and _drafted(reqs) == 0
    tries, h = draft.calls["propose"], engine.health["draft"]
    assert h.failures == tries and h.faults >= 2 and tries - h.faults <= DRAFT_TRIES * len(reqs)
    # the n-th batch fault waits probe_s * 2^n before the next try, so n of them take at least probe_s * (2^n - 2)
    assert h.faults <= math.log2(took / engine.config.worker_probe_s + 2) + 1 < steps / 4


def test_a_fault_doubles_the_wait_up_to_its_cap_and_a_long_healthy_run_restarts_the_count() -> None:
    h = WorkerHealth("draft")
    h.fault(100.0, ValueError("bad"), 0.2)
    assert h.down and h.failures == h.faults == 1 and h.next_probe == pytest.approx(100.4)
    assert h.last_error == "ValueError: bad"
    h.fault(100.4, ValueError("bad"), 0.2)  # the retry faulted too: still down, one failure, twice the wait
    assert h.failures == 1 and h.faults == 2 and h.next_probe == pytest.approx(101.2)
    for _ in range(20):
        h.fault(200.0, ValueError("bad"), 0.2)
    assert h.next_probe == pytest.approx(200.0 + MAX_FAULT_WAIT_S)
    h.mark_up(300.0)
    h.fault(300.0 + MAX_FAULT_WAIT_S / 2, ValueError("bad"), 0.2)  # soon after coming back: the count goes on
    assert h.failures == 2 and h.faults == 23
    h.mark_up(400.0)
    h.fault(401.0 + MAX_FAULT_WAIT_S, ValueError("bad"), 0.2)  # after a healthy minute: it starts anew
    assert h.faults == 1 and h.next_probe == pytest.approx(401.4 + MAX_FAULT_WAIT_S)


def test_a_passing_target_fault_loses_no_request(reference: list[list[int]]) -> None:
    """The target raises once in a batch (an out-of-memory that passes): nothing of the step was committed; its
    requests are re-prefilled and each tried alone, and every request ends with the target-only output, streamed
    exactly once, through the AsyncEngine a server runs."""
    engine, parties = _engine("dsde")
    parties["target"].fault_at = ("verify", 3)
    aeng = AsyncEngine(engine).start()
    try:
        async def one(prompt: list[int], max_tokens: int) -> list[RequestOutput]:
            return [o async for o in aeng.generate(prompt, SamplingParams(max_tokens=max_tokens))]

        async def run() -> list[list[RequestOutput]]:
            return await asyncio.wait_for(asyncio.gather(*map(one, PROMPTS, MAX_TOKENS)), 60)

        outs = asyncio.run(run())
    finally:
        aeng.stop()
    assert [[t for x in o for t in x.token_ids] for o in outs] == reference
    assert all(o[-1].finish_reason == "length" for o in outs) and aeng.last_error is None
    h = engine.health["target"]
    assert h.failures == 1 and not h.down and h.last_error == "RuntimeError: verify: an illegal memory access"
    _assert_all_freed(engine, parties)


def _poison(parties: dict[str, Flaky], method: str, max_tokens: int, after: int = 0) -> None:
    """The target raises on `method` whenever the request of `max_tokens` is in the call, once it has `after`
    committed output tokens (open: from the start): a fault that one request causes."""
    target = parties["target"]

    def hit(name: str, args: tuple[Any, ...]) -> bool:
        if name == "open":
            return method == "open" and args[1].max_tokens == max_tokens
        if name != method:
            return False
        slots = target.inner.slots
        return any(slots[t.slot].params.max_tokens == max_tokens
                   and len(slots[t.slot].committed) + len(t.new_tokens) >= len(PROMPTS[MAX_TOKENS.index(max_tokens)])
                   + after for t in args[0])

    target.fault_if = hit


@pytest.mark.parametrize(("method", "after"), [("verify", 0), ("verify", 7), ("open", 0)])
def test_a_target_fault_that_one_request_causes_ends_only_that_request(reference: list[list[int]], method: str,
                                                                       after: int) -> None:
    """A request the target fails on (in its prefill, after some tokens, or opening its slot) ends with the error
    alone, its streamed tokens a prefix of its target-only output; the others, some of them in its batch, end with
    theirs exactly."""
    engine, parties = _engine("dsde")
    bad = 2
    _poison(parties, method, MAX_TOKENS[bad], after)
    emitted: dict[str, list[int]] = {}
    reqs = _add_all(engine, emitted)
    _run_bounded(engine)
    for i, r in enumerate(reqs):
        if i == bad:
            assert r.finish_reason == "error"
            assert r.error == f"the target failed on this request: RuntimeError: {method}: an illegal memory access"
            assert emitted.get(r.req_id, []) == reference[i][:len(r.output_ids)] and len(r.output_ids) >= after
        else:
            assert r.finish_reason == "length" and r.output_ids == reference[i] and emitted[r.req_id] == reference[i]
    h = engine.health["target"]
    assert h.failures == (2 if method == "open" else 3) and not h.down  # (the batch's fault, then) twice alone
    _assert_all_freed(engine, parties)


def test_a_passing_target_fault_at_batch_1_loses_no_request(reference: list[list[int]]) -> None:
    """Alone from the start, a request the target raised on once is tried again (a passing fault) and ends exactly."""
    engine, parties = _engine("dsde")
    parties["target"].fault_at = ("verify", 3)
    r = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS[0]))
    _run_bounded(engine)
    assert r.finish_reason == "length" and r.output_ids == reference[0]
    assert engine.health["target"].failures == 1
    _assert_all_freed(engine, parties)


def test_a_target_that_faults_on_every_full_batch_still_finishes_every_request(reference: list[list[int]]) -> None:
    """A fault at the batch's size (an out-of-memory on every batch of more than 2) costs steps, not requests: each
    request passes its steps alone, the batch forms again, and every request ends with its target-only output."""
    engine, parties = _engine("dsde")
    parties["target"].fault_if = lambda name, args: name == "verify" and len(args[0]) > 2
    reqs = _add_all(engine, {})
    while not engine.health["target"].failures:
        engine.step()
    assert engine.state()["tried_alone"] == BATCH  # the failed batch's requests, each to run alone
    _run_bounded(engine, steps=5000)
    assert [r.output_ids for r in reqs] == reference
    assert engine.health["target"].failures > 1 and not engine.health["target"].down
    _assert_all_freed(engine, parties)


def test_a_target_that_faults_while_it_is_brought_back_is_tried_again(reference: list[list[int]]) -> None:
    """The restarted target raises on the first slot the engine opens on it again: still down, tried again after
    its fault wait; the requests then go on exactly."""
    engine, parties = _engine("dsde")
    target = parties["target"]
    target.kill_at = ("verify", 3)
    target.restart_after_probes = 2
    faulted: list[bool] = []
    target.fault_if = lambda name, _: (name == "open" and target.restarts == 1 and not faulted
                                       and not faulted.append(True))
    reqs = _add_all(engine, {})
    _run_bounded(engine)
    assert faulted and [r.output_ids for r in reqs] == reference
    h = engine.health["target"]
    assert h.failures == h.recoveries == h.faults == 1 and not h.down and target.restarts == 1
    _assert_all_freed(engine, parties)


def test_an_error_committing_one_request_ends_only_that_request(reference: list[list[int]]) -> None:
    """A bug in one request's output handling (here its detokenizer raises) ends that request with the error; the
    others of its steps end with their target-only outputs."""
    engine, parties = _engine("dsde")
    reqs = _add_all(engine, {})

    class Broken:
        stopped = False

        def add(self, ids: list[int]) -> str:
            raise ValueError("no text for these ids")

    reqs[2].detok = Broken()
    _run_bounded(engine)
    for i, r in enumerate(reqs):
        if i == 2:
            assert r.finish_reason == "error"
            assert r.error == "the engine failed on this request: ValueError: no text for these ids"
        else:
            assert r.finish_reason == "length" and r.output_ids == reference[i]
    _assert_all_freed(engine, parties)


def test_a_target_release_that_raises_is_deferred_and_decoding_goes_on_exactly(reference: list[list[int]]) -> None:
    engine, parties = _engine("dsde")
    parties["target"].fault_at = ("release", 1)  # the first finished request's release
    reqs = _add_all(engine, {})
    _run_bounded(engine)
    assert [r.output_ids for r in reqs] == reference
    h = engine.health["target"]
    assert h.failures == h.faults == h.recoveries == 1 and h.last_error.startswith("RuntimeError: release")
    _assert_all_freed(engine, parties)
