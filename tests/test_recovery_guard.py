"""The recovery guard over fake workers and a fake clock: what a failed call marks down, the releases it defers, the
suspects it tries alone, the tries after which a request ends or drafts no more, and what a party's return redoes."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dsde_core.config import EngineConfig, SamplingParams, SpeculationParams
from dsde_core.errors import WorkerUnavailable
from dsde_core.policies import Plan
from dsde_core.recovery import DRAFT_TRIES, TARGET_TRIES, RecoveryGuard
from dsde_core.request import Request, RequestOutput
from dsde_core.scheduler import Scheduler

PROBE_S, WAIT_S = 0.5, 10.0


class Fake:
    """A worker or policy that records its calls; `raises` (method -> error) makes a method raise, `raises_once` its
    next call only; `up` False makes available() say it does not answer."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.raises: dict[str, Exception] = {}
        self.raises_once: dict[str, Exception] = {}
        self.up = True

    def available(self) -> bool:
        return self.up

    def _call(self, name: str, arg: Any) -> Any:
        self.calls.append((name, arg))
        if name in self.raises_once:
            raise self.raises_once.pop(name)
        if name in self.raises:
            raise self.raises[name]
        return arg

    def open(self, slot: int, params: SamplingParams, prompt_len: int = 0, emitted: int = 0) -> None:
        self._call("open", slot)

    def release(self, key: int | str) -> None:
        self._call("release", key)

    def propose(self, tasks: list[Any], stop: Any = None) -> list[Any]:
        return self._call("propose", tasks)

    def verify(self, tasks: list[Any]) -> list[Any]:
        return self._call("verify", tasks)

    def observe(self, feedback: list[Any]) -> None:
        self._call("observe", feedback)

    def named(self, name: str) -> list[Any]:
        return [arg for n, arg in self.calls if n == name]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(time, "perf_counter", c)
    monkeypatch.setattr(time, "sleep", c.sleep)
    return c


class Setup:
    """A guard over three fakes and a scheduler of 4 slots; `ended` holds the requests it ended through `fail`, which
    frees them as the engine does."""

    def __init__(self, n: int = 3, draft: bool = True) -> None:
        self.target, self.draft, self.policy = Fake(), Fake() if draft else None, Fake()
        config = EngineConfig(max_batch_size=4, max_seq_len=256, worker_probe_s=PROBE_S, worker_wait_s=WAIT_S)
        self.scheduler = Scheduler(config)
        self.ended: list[tuple[str, str, str | None]] = []
        self.guard = RecoveryGuard(self.target, self.draft, self.policy, config, self.scheduler, self.fail)
        self.reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(), SpeculationParams(), detok=None) for i in range(n)]
        for r in self.reqs:
            self.scheduler.add(r)
            self.scheduler.admit_next()
            r.synced_target = r.synced_draft = r.num_tokens
            r.stats.arrival = 0.0

    def fail(self, r: Request, error: str, error_type: str | None) -> RequestOutput:
        self.ended.append((r.req_id, error, error_type))
        self.guard.release(r.req_id, self.scheduler.free(r))
        return RequestOutput(r.req_id, [], "", True, "error", error)


def test_a_lost_target_is_marked_down_and_brought_back_with_every_slot_resynced(clock: Clock) -> None:
    s = Setup()
    hooks: list[str] = []
    s.guard.recovery_hooks.append(hooks.append)
    s.target.raises["verify"] = WorkerUnavailable("target", "the actor died")
    assert s.guard.verify(["task"], s.reqs) == (None, [])  # the step is lost; no request ends
    h = s.guard.health["target"]
    assert s.guard.target_down and s.guard.recovering and h.failures == 1 and "died" in h.last_error
    assert all(r.synced_target == 0 and r.synced_draft > 0 for r in s.reqs)  # the target's caches are lost
    del s.target.raises["verify"]
    s.target.up = False
    assert s.guard.recover() == [] and s.guard.target_down  # still away
    clock.now += PROBE_S / 2
    s.guard.recover()
    assert s.guard.target_down and s.target.named("open") == []  # not probed again before worker_probe_s
    s.target.up = True
    clock.now += PROBE_S
    assert s.guard.recover() == []
    assert not s.guard.target_down and h.recoveries == 1 and hooks == ["target"]
    assert s.target.named("open") == [0, 1, 2]  # every running slot opened again


def test_releases_to_a_party_that_is_down_or_raises_are_deferred_until_it_is_back(clock: Clock) -> None:
    s = Setup()
    s.draft.raises["propose"] = WorkerUnavailable("draft", "the actor died")
    assert s.guard.propose(["task"], s.reqs, None) is None and not s.guard.drafting
    s.target.raises["release"] = RuntimeError("release: an illegal memory access")
    s.fail(s.reqs[0], "gone", None)
    assert s.guard.health["draft"].pending == {0}  # the draft is down: deferred without a call
    assert ("release", 0) not in s.draft.calls
    assert s.guard.health["target"].pending == {0} and s.guard.target_down  # a release fault: down for a fault's wait
    assert s.policy.named("release") == ["r0"]
    del s.target.raises["release"]
    clock.now += 2 * PROBE_S  # past the target's fault wait (probe_s * 2^1) and the draft's probe
    s.guard.recover()
    assert s.target.named("release") == [0, 0] and s.draft.named("release") == [0]  # sent when back
    assert not s.guard.recovering and not any(h.pending for h in s.guard.health.values())


def test_a_target_fault_makes_suspects_that_run_alone_until_each_passes(clock: Clock) -> None:
    s = Setup()
    s.target.raises["verify"] = RuntimeError("verify: an illegal memory access")
    assert s.guard.verify(["task"], s.reqs) == (None, [])  # a batch's fault ends nobody
    assert s.guard.suspects == {"r0": 0, "r1": 0, "r2": 0} and not s.guard.target_down
    assert s.target.named("open") == [0, 1, 2] and all(r.synced_target == 0 for r in s.reqs)  # opened afresh
    assert s.guard.rows() == [s.reqs[0]]  # alone
    del s.target.raises["verify"]
    verdicts, ended = s.guard.verify(["task"], [s.reqs[0]])
    assert verdicts == ["task"] and ended == [] and "r0" not in s.guard.suspects
    assert s.guard.rows() == [s.reqs[1]]
    s.guard.verify(["task"], [s.reqs[1]])
    s.guard.verify(["task"], [s.reqs[2]])
    assert s.guard.rows() == s.reqs and s.guard.health["target"].failures == 1  # the batch again


def test_a_request_the_target_fails_on_alone_too_often_ends_with_the_error(clock: Clock) -> None:
    s = Setup()
    bad = s.reqs[1]
    s.target.raises["verify"] = RuntimeError("verify: an illegal memory access")
    s.guard.verify(["task"], s.reqs)
    for attempt in range(1, TARGET_TRIES + 1):
        _, ended = s.guard.verify(["task"], [bad])
        if attempt < TARGET_TRIES:
            assert ended == [] and s.guard.suspects[bad.req_id] == attempt
    assert [o.req_id for o in ended] == ["r1"]
    assert s.ended == [("r1", "the target failed on this request: RuntimeError: verify: an illegal memory access",
                        None)]
    assert bad not in s.scheduler.running and "r1" not in s.guard.suspects and s.target.named("release") == [1]
    assert not s.guard.target_down and s.guard.health["target"].failures == 1 + TARGET_TRIES


def test_a_draft_fault_makes_suspects_that_draft_alone_and_one_that_fails_alone_goes_target_only(
        clock: Clock) -> None:
    s = Setup()
    s.draft.raises["propose"] = RuntimeError("propose: an illegal memory access")
    assert s.guard.propose(["task"], s.reqs, None) is None
    h = s.guard.health["draft"]
    assert h.down and h.faults == 1 and s.guard.draft_suspects == {"r0": 0, "r1": 0, "r2": 0}
    assert all(r.synced_draft == 0 for r in s.reqs)
    clock.now += 2 * PROBE_S
    s.guard.recover()
    assert s.guard.drafting
    s.guard.plan(s.reqs, lambda rows: {r.req_id: Plan(3) for r in rows})
    bad = s.guard.alone
    assert bad is s.reqs[0] and [s.guard.may_draft(r) for r in s.reqs] == [True, False, False]
    opens = len(s.draft.named("open"))
    for attempt in range(1, DRAFT_TRIES + 1):
        assert s.guard.propose(["task"], [bad], None) is None
        assert s.guard.drafting  # a suspect's fault alone is its own: the draft stays up
        if attempt < DRAFT_TRIES:
            assert s.guard.draft_suspects[bad.req_id] == attempt and len(s.draft.named("open")) == opens + 1
    assert bad.draft_off and "r0" not in s.guard.draft_suspects and not s.guard.may_draft(bad)
    assert h.failures == 1 + DRAFT_TRIES and h.faults == 1
    del s.draft.raises["propose"]
    s.guard.plan(s.reqs, lambda rows: {})
    assert s.guard.alone is s.reqs[1]
    assert s.guard.propose(["task"], [s.reqs[1]], None) == ["task"] and "r1" not in s.guard.draft_suspects


def test_the_policy_plans_target_only_while_it_is_down_or_raises(clock: Clock) -> None:
    s = Setup()

    def broken(rows: list[Request]) -> dict[str, Plan]:
        raise RuntimeError("plan: a bug")

    assert s.guard.plan(s.reqs, broken) == {r.req_id: Plan(0) for r in s.reqs}
    assert s.guard.health["policy"].down
    planned: list[bool] = []
    assert s.guard.plan(s.reqs, lambda rows: planned.append(True) or {}) == {r.req_id: Plan(0) for r in s.reqs}
    assert planned == []  # not asked while it sits out its wait
    s.guard.observe(s.reqs, lambda: ["feedback"])
    assert s.policy.named("observe") == []
    clock.now += 2 * PROBE_S
    s.guard.recover()
    s.guard.observe(s.reqs, lambda: ["feedback"])
    assert s.policy.named("observe") == [["feedback"]]
    s.policy.raises["observe"] = WorkerUnavailable("policy", "the actor died")
    s.guard.observe(s.reqs, lambda: ["feedback"])
    assert s.guard.health["policy"].down and s.guard.health["policy"].failures == 2
    assert s.guard.plan([], broken) == {}  # no rows: nothing to plan


def test_requests_that_wait_too_long_for_the_target_end_unavailable(clock: Clock) -> None:
    s = Setup(n=2)
    late = Request("late", [4, 5], SamplingParams(), SpeculationParams(), detok=None)
    late.stats.arrival = clock.now + WAIT_S / 2  # queued after the target went down
    s.scheduler.add(late)
    s.target.up = False
    s.target.raises["verify"] = WorkerUnavailable("target", "gone")
    s.guard.verify(["task"], s.reqs)
    clock.now += WAIT_S - PROBE_S
    assert s.guard.recover() == [] and s.ended == []
    clock.now += PROBE_S
    assert [o.req_id for o in s.guard.recover()] == ["r0", "r1"]  # the waiting one has not waited long enough
    assert all(t == "unavailable" and "did not come back within 10s" in e for _, e, t in s.ended)
    assert list(s.scheduler.waiting) == [late]
    clock.now += WAIT_S / 2
    assert [o.req_id for o in s.guard.recover()] == ["late"] and not s.scheduler.waiting
    assert s.guard.health["target"].pending == {0, 1}  # its slots' releases wait for it


def test_opening_an_admitted_requests_slot_a_target_fault_is_the_requests_own(clock: Clock) -> None:
    """A fault opening the target's slot is retried at once, alone; one that repeats ends the request (its draft slot
    is never opened); a lost target leaves the request running, its slots opened when the target is back."""
    s = Setup(n=0)

    def admitted(req_id: str) -> Request:
        r = Request(req_id, [1, 2], SamplingParams(), SpeculationParams(), detok=None)
        s.scheduler.add(r)
        s.scheduler.admit_next()
        return r

    passing = admitted("passing")
    s.target.raises_once["open"] = RuntimeError("open: out of memory")
    assert s.guard.open(passing) == [] and s.guard.suspects == {"passing": 1}
    assert s.target.named("open") == [0, 0] and s.draft.named("open") == [0]
    bad = admitted("bad")
    s.target.raises["open"] = RuntimeError("open: a bad prompt")
    assert [o.req_id for o in s.guard.open(bad)] == ["bad"] and [e[0] for e in s.ended] == ["bad"]
    assert s.target.named("open") == [0, 0, 1, 1] and s.draft.named("open") == [0]
    s.target.raises["open"] = WorkerUnavailable("target", "gone")
    lost = admitted("lost")
    assert s.guard.open(lost) == [] and s.guard.target_down and lost in s.scheduler.running
    assert s.draft.named("open") == [0, lost.slot]


@pytest.mark.parametrize("role", ["draft", "target", "policy"])
def test_a_bug_raises_out_of_the_step_where_faults_are_strict(clock: Clock, role: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """DSDE_STRICT_FAULTS (the suite sets it): an AttributeError out of a party is raised, not survived as a fault;
    a RuntimeError still is. Unset (a server), the bug is a fault too."""
    calls = {"draft": lambda s: s.guard.propose(["task"], s.reqs, None),
             "target": lambda s: s.guard.verify(["task"], s.reqs),
             "policy": lambda s: s.guard.observe(s.reqs, lambda: ["feedback"])}
    method = {"draft": "propose", "target": "verify", "policy": "observe"}[role]
    s = Setup()
    getattr(s, role).raises[method] = AttributeError("'_Slot' object has no attribute 'prompt_len'")
    with pytest.raises(AttributeError, match="prompt_len"):
        calls[role](s)
    for strict, error in ((True, RuntimeError("CUDA error: out of memory")), (False, AttributeError("a bug"))):
        if not strict:
            monkeypatch.delenv("DSDE_STRICT_FAULTS")
        s = Setup()
        getattr(s, role).raises[method] = error
        calls[role](s)  # survived
        h = s.guard.health[role]
        assert h.failures == 1 and type(error).__name__ in h.last_error, (strict, h.as_dict())
