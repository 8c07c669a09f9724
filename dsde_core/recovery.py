"""Fault isolation and recovery for the parties the engine calls: the target, the draft and the policy.

RecoveryGuard makes every call to them, so that a party's failure costs this and no more:

- A call that raises WorkerUnavailable marks its party down. A party that is down is probed every worker_probe_s; once
  it answers, it gets its deferred releases, every running slot opened again and its cache resynced from the committed
  tokens (they are the engine's: nothing is repeated or lost), and the recovery hooks run.
  - draft down: every request decodes target-only (k = 0).
  - policy down: every row is planned k = 0; a restarted policy rebuilds its per-request state as for new requests.
  - target down: no step runs; a request that waits worker_wait_s for it ends with an error (RequestOutput.error_type
    "unavailable"). A target that raises while it is brought back stays down for a fault's wait.
- Any other error from the draft or the policy is a fault, handled alike: without them the engine decodes target-only,
  losslessly, so no request fails for it. A faulty party sits out worker_probe_s * 2^faults (at most MAX_FAULT_WAIT_S;
  a fault after MAX_FAULT_WAIT_S up starts the count anew), so one that faults on every call does not cost a resync of
  every draft cache every step.
- Faults are isolated to the requests that cause them, so a fault one request causes ends (or turns speculation off
  for) that request only, and a passing one (an out-of-memory at the batch's size) none:
  - draft: the requests of a call that raised become suspects; once the draft is back, each drafts alone (the others
    plan k = 0) until it passes a call. A fault on a suspect alone is its own: the draft stays up, the suspect's slot is
    opened afresh, and after DRAFT_TRIES of them it goes on target-only to its end.
  - target (verifying a step or opening a slot): it stays up and nothing of the step was committed; the step's requests
    become suspects, are re-prefilled from prompt + committed tokens and run alone until each passes a step. One the
    target fails on alone TARGET_TRIES times in a row ends with the error; the others go on exactly.
- A release that raises, or that cannot reach a party that is down, is deferred until the party answers again.

Where DSDE_STRICT_FAULTS is set (the test suite sets it), an error that is a bug in the code (AttributeError,
NameError, TypeError, IndexError, KeyError, AssertionError) is raised out of the step instead of survived: a test
would otherwise pass on the target-only fallback while the draft path is broken.

The engine's own errors are not the guard's: one committing a request's tokens ends that request only; any other error
out of a step ends the step's requests (AsyncEngine calls Engine.fail_running; the waiting ones run next).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.errors import WorkerUnavailable
from dsde_core.policies import Plan, SpeculationPolicy, StepFeedback
from dsde_core.request import Request, RequestOutput

if TYPE_CHECKING:
    from dsde_core.policies.stopping import DraftStop
    from dsde_core.scheduler import Scheduler
    from dsde_core.workers import DraftTask, Proposal, Verdict, VerifyTask

log = logging.getLogger("dsde_core.engine")  # the engine's log, where operators look for a fault's traceback
ROLES = ("target", "draft", "policy")
MAX_FAULT_WAIT_S = 60.0  # the longest a faulty draft or policy sits out before it is tried again
TARGET_TRIES = 2  # a request ends after the target raised on it alone this many times in a row (a passing fault: once)
DRAFT_TRIES = 2  # a request goes on target-only after the draft raised on it alone this many times in a row
STRICT_ENV = "DSDE_STRICT_FAULTS"  # set: a party's bug (BUGS) is raised out of the step, not survived
BUGS = (AttributeError, NameError, TypeError, IndexError, KeyError, AssertionError)


class DraftAPI(Protocol):
    def open(self, slot: int, params: SamplingParams, prompt_len: int = 0, emitted: int = 0) -> None: ...
    def release(self, slot: int) -> None: ...
    def propose(self, tasks: list[DraftTask]) -> list[Proposal]: ...


class TargetAPI(Protocol):
    def open(self, slot: int, params: SamplingParams, prompt_len: int = 0, emitted: int = 0) -> None: ...
    def release(self, slot: int) -> None: ...
    def verify(self, tasks: list[VerifyTask]) -> list[Verdict]: ...


@dataclass
class WorkerHealth:
    role: str
    down_since: float | None = None  # time.perf_counter() of the failure; None: up
    last_error: str = ""
    failures: int = 0  # times it was marked down, or raised and stayed up (count_fault)
    recoveries: int = 0  # times it came back
    faults: int = 0  # errors it raised in a row (not WorkerUnavailable): each doubles its wait before the next try
    up_since: float = 0.0
    next_probe: float = 0.0
    pending: set[Any] = field(default_factory=set)  # releases deferred while down: slots, or req_ids for the policy

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def mark_down(self, now: float, error: str) -> None:
        if self.down_since is None:
            self.down_since = now
            self.failures += 1
            self.next_probe = now
        self.last_error = error

    def fault(self, now: float, error: BaseException, probe_s: float) -> None:
        """It raised `error` (it answers; a call failed): down, and tried again after probe_s * 2^faults."""
        if not self.down and now - self.up_since > MAX_FAULT_WAIT_S:  # after a long healthy run: the count starts anew
            self.faults = 0
        self.faults += 1
        self.mark_down(now, describe(error))
        self.next_probe = now + min(probe_s * 2 ** self.faults, MAX_FAULT_WAIT_S)

    def count_fault(self, error: BaseException) -> None:
        """It raised `error` and stays up (the target, whose faults the guard isolates to requests): counted."""
        self.failures += 1
        self.last_error = describe(error)

    def mark_up(self, now: float) -> None:
        self.down_since = None
        self.up_since = now
        self.recoveries += 1
        self.pending.clear()

    def as_dict(self) -> dict[str, Any]:
        return {"up": not self.down, "failures": self.failures, "recoveries": self.recoveries, "faults": self.faults,
                "last_error": self.last_error or None, "deferred_releases": len(self.pending)}


def describe(error: BaseException) -> str:
    """One line for an error: its type and the last line of its text (a remote error's text is its traceback, whose
    last line is the original error)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1].strip()}" if lines else type(error).__name__


def raise_if_bug(error: BaseException) -> None:
    """Raise `error` where DSDE_STRICT_FAULTS is set and it is one of BUGS (a fault of the code, not of a party)."""
    if os.environ.get(STRICT_ENV) and isinstance(error, BUGS):
        raise error


def is_available(party: Any) -> bool:
    """Ask a worker or policy whether it answers; one without an `available` method is local and always does."""
    probe = getattr(party, "available", None)
    return True if probe is None else bool(probe())


def _survivable(role: str) -> type[Exception]:
    """What a call to `role` may raise without failing requests: the target's WorkerUnavailable (its other errors are
    faults of the requests in the call); anything the draft or the policy raises (without them the engine decodes
    target-only)."""
    return WorkerUnavailable if role == "target" else Exception


def _open_slot(worker: DraftAPI | TargetAPI, r: Request) -> None:
    """Open r's slot on a model worker: its parameters, prompt length and output so far (a reopened slot's seeded
    draws start a stream of their own)."""
    worker.open(r.slot, r.params, len(r.prompt_ids), len(r.output_ids))


class RecoveryGuard:
    """The engine's calls to the target, the draft and the policy (the module doc says what a failure costs).

    It reads the running and waiting requests from the scheduler, and ends a request through `fail` (the engine's:
    it emits the error and frees the request's state)."""

    def __init__(self, target: TargetAPI, draft: DraftAPI | None, policy: SpeculationPolicy, config: EngineConfig,
                 scheduler: Scheduler, fail: Callable[[Request, str, str | None], RequestOutput]) -> None:
        self.target, self.draft, self.policy = target, draft, policy
        self.config = config
        self.scheduler = scheduler
        self.fail = fail
        self.health = {role: WorkerHealth(role) for role in ROLES}
        self.recovery_hooks: list[Callable[[str], None]] = []  # called with the role when a failed party is back
        self.suspects: dict[str, int] = {}  # req_id -> target faults alone in a row; each runs alone
        self.draft_suspects: dict[str, int] = {}  # req_id -> draft faults alone in a row; each drafts alone
        self.alone: Request | None = None  # the draft suspect drafting alone this step (set by plan)

    @property
    def target_down(self) -> bool:
        return self.health["target"].down

    @property
    def recovering(self) -> bool:
        """A party is down: the engine's step probes it even with no request."""
        return any(h.down for h in self.health.values())

    @property
    def drafting(self) -> bool:
        """There is a draft and it is up."""
        return self.draft is not None and not self.health["draft"].down

    # ---- the step's calls ---------------------------------------------------------------------------------------
    def rows(self) -> list[Request]:
        """This step's requests: every running one; while a batch the target raised on has suspects, one of them
        alone."""
        running = self.scheduler.running
        return next(([r] for r in running if r.req_id in self.suspects), list(running))

    def may_draft(self, r: Request) -> bool:
        """r may be planned k > 0: the draft is up, r is not on target-only, and no other suspect drafts alone."""
        return self.drafting and not r.draft_off and (self.alone is None or self.alone is r)

    def plan(self, rows: list[Request], planner: Callable[[list[Request]], dict[str, Plan]]) -> dict[str, Plan]:
        """planner(rows)'s plans (it calls the policy), or k = 0 for every row (a target-only step) while the policy
        is down or when it raises. First picks the draft suspect among the rows that drafts alone this step."""
        self.alone = next((r for r in rows if r.req_id in self.draft_suspects), None)
        if not rows:
            return {}
        if not self.health["policy"].down:
            try:
                return planner(rows)
            except Exception as e:  # WorkerUnavailable, or a fault
                self._failed("policy", e)
        return {r.req_id: Plan(0) for r in rows}

    def propose(self, tasks: list[DraftTask], reqs: list[Request], stop: DraftStop | None) -> list[Proposal] | None:
        """The draft's proposals for tasks (one per request of reqs); None when it raised (the step goes on
        target-only): a batch's fault makes each of reqs a suspect, a suspect's fault alone is its own."""
        try:
            proposals = self.draft.propose(tasks, stop) if stop is not None else self.draft.propose(tasks)
        except WorkerUnavailable as e:  # this step and the next ones go on target-only until the draft is back
            self._failed("draft", e)
            return None
        except Exception as e:
            self._draft_fault(reqs, e)
            return None
        if self.alone is not None:  # it passed
            self.draft_suspects.pop(self.alone.req_id, None)
        return proposals

    def verify(self, tasks: list[VerifyTask], fed: list[Request]) -> tuple[list[Verdict] | None, list[RequestOutput]]:
        """(the target's verdicts for tasks, []) where it answered. Where it raised nothing was committed and the
        step is lost: (None, the outputs of the requests of `fed` it ended). WorkerUnavailable: the requests wait for
        the target; a fault: each of `fed` becomes a suspect, and one the target failed on alone too often ends."""
        try:
            verdicts = self.target.verify(tasks)
        except WorkerUnavailable as e:
            self._failed("target", e)
            return None, []
        except Exception as e:
            return None, self._target_fault(fed, e)
        for r in fed:
            self.suspects.pop(r.req_id, None)
        return verdicts, []

    def observe(self, rows: list[Request], feedback: Callable[[], list[StepFeedback]]) -> None:
        """Tell the policy what the step's rows got (feedback() builds it); it is planned target-only while it is down
        or after it raised."""
        if rows and not self.health["policy"].down:
            try:
                self.policy.observe(feedback())
            except Exception as e:  # WorkerUnavailable, or a fault
                self._failed("policy", e)

    # ---- slots --------------------------------------------------------------------------------------------------
    def open(self, r: Request) -> list[RequestOutput]:
        """Open an admitted request's slots: the target's (a fault doing so is r's: the outputs of the request it
        ended), then the draft's."""
        failed = self._reopen_target(r)
        if not failed and self.draft is not None:
            self._open("draft", self.draft, r)
        return failed

    def release(self, req_id: str, slot: int | None) -> None:
        """Release an ended request's state on every party: its slot on both workers (None: it had none) and the
        policy's; each deferred while its party is down."""
        self.suspects.pop(req_id, None)
        self.draft_suspects.pop(req_id, None)
        if slot is not None:
            self._release("target", self.target, slot)
            if self.draft is not None:
                self._release("draft", self.draft, slot)
        self._release("policy", self.policy, req_id)

    # ---- recovery -----------------------------------------------------------------------------------------------
    def recover(self) -> list[RequestOutput]:
        """Probe each party that is down (every worker_probe_s); when one answers, send its deferred releases, open
        every running slot on it again and resync it from the committed tokens. While the target is down, end the
        requests that have waited worker_wait_s for it (their outputs)."""
        now = time.perf_counter()
        for role, h in self.health.items():
            if not h.down or now < h.next_probe:
                continue
            h.next_probe = now + self.config.worker_probe_s
            party = {"target": self.target, "draft": self.draft, "policy": self.policy}[role]
            try:
                if party is None or not is_available(party):
                    continue
                for key in sorted(h.pending, key=str):
                    party.release(key)
                if role != "policy":  # a restarted policy rebuilds per-request state on its next plan
                    for r in self.scheduler.running:
                        _open_slot(party, r)
                        if role == "draft":
                            r.synced_draft = 0
                        else:
                            r.synced_target = 0
            except Exception as e:  # still down (a fault, even the target's: a longer wait)
                self._failed(role, e)
                continue
            h.mark_up(now)
            for hook in self.recovery_hooks:
                hook(role)
        target = self.health["target"]
        if not target.down:
            return []
        outputs = []
        for r in self.scheduler.queued() + list(self.scheduler.running):
            if now - max(target.down_since, r.stats.arrival) >= self.config.worker_wait_s:
                self.scheduler.dequeue(r)
                outputs.append(self.fail(r, f"the target worker failed and did not come back within "
                                            f"{self.config.worker_wait_s:g}s ({target.last_error})", "unavailable"))
        if self.scheduler.has_unfinished():
            time.sleep(min(0.05, self.config.worker_probe_s))  # nothing can run until the target is back
        return outputs

    def _failed(self, role: str, error: Exception) -> None:
        """A call to `role` raised WorkerUnavailable, or a fault (any other error: from the draft or the policy, or
        from a release): go on without it; its state is rebuilt when it is back (a faulty one is tried again after a
        doubling wait)."""
        h, now = self.health[role], time.perf_counter()
        if isinstance(error, WorkerUnavailable):
            h.mark_down(now, str(error))
        else:
            raise_if_bug(error)
            log.error("the %s raised an error; going on without it (target-only)", role, exc_info=error)
            h.fault(now, error, self.config.worker_probe_s)
        for r in self.scheduler.running:  # what it was told is lost: resync from scratch (prompt + committed tokens)
            if role == "draft":
                r.synced_draft = 0
            elif role == "target":
                r.synced_target = 0

    def _target_fault(self, rows: list[Request], error: Exception) -> list[RequestOutput]:
        """The target raised `error` on `rows` (a fault: it still answers; nothing was committed). Each becomes a
        suspect that runs alone until it passes a step; one the target raised on alone TARGET_TRIES times in a row
        ends with the error. What the call left of their target state is not known: each slot is opened afresh."""
        raise_if_bug(error)
        self.health["target"].count_fault(error)
        log.error("the target raised an error on %d request(s); each is tried alone, and one it fails on alone %d "
                  "times ends with the error", len(rows), TARGET_TRIES, exc_info=error)
        outputs: list[RequestOutput] = []
        for r in rows:
            tries = self.suspects.get(r.req_id, 0) + int(len(rows) == 1)  # faults alone, in a row
            if tries >= TARGET_TRIES:
                outputs.append(self.fail(r, f"the target failed on this request: {describe(error)}", None))
            else:
                self.suspects[r.req_id] = tries
                outputs += self._reopen_target(r)
        return outputs

    def _draft_fault(self, reqs: list[Request], error: Exception) -> None:
        """The draft raised `error` (a fault: it answers) on a call holding `reqs`. After a batch's call it sits out
        its wait and each of the call's requests becomes a suspect. A fault on the suspect drafting alone is that
        request's: the draft stays up, the suspect's slot is opened afresh, and one the draft raised on alone
        DRAFT_TRIES times goes on target-only to its end."""
        alone = self.alone
        if alone is None:
            self._failed("draft", error)
            for r in reqs:
                self.draft_suspects.setdefault(r.req_id, 0)
            return
        raise_if_bug(error)  # (a batch's: _failed)
        self.health["draft"].count_fault(error)
        tries = self.draft_suspects.get(alone.req_id, 0) + 1  # faults alone, in a row
        log.error("the draft raised an error on request %s alone (%d of %d)", alone.req_id, tries, DRAFT_TRIES,
                  exc_info=error)
        if tries < DRAFT_TRIES:
            self.draft_suspects[alone.req_id] = tries
            alone.synced_draft = 0  # what the call left of its draft cache is not known
            self._open("draft", self.draft, alone)
        else:
            self.draft_suspects.pop(alone.req_id, None)
            alone.draft_off = True

    def _reopen_target(self, r: Request) -> list[RequestOutput]:
        """Open r's target slot with an empty cache (its next step feeds prompt + committed tokens); a fault doing so
        is r's (_target_fault)."""
        r.synced_target = 0
        try:
            self._open("target", self.target, r)
        except Exception as e:  # not WorkerUnavailable (_open marks the target down for that)
            return self._target_fault([r], e)
        return []

    def _open(self, role: str, worker: DraftAPI | TargetAPI, r: Request) -> None:
        if self.health[role].down:
            return  # opened by recover() when the worker is back
        try:
            _open_slot(worker, r)
        except _survivable(role) as e:
            self._failed(role, e)

    def _release(self, role: str, party: Any, key: int | str) -> None:
        """Release a slot (a request id for the policy); deferred to recover() while the party is down."""
        h = self.health[role]
        if not h.down:
            try:
                party.release(key)
                return
            except Exception as e:  # a release never fails a request: deferred until the party answers again
                self._failed(role, e)
        h.pending.add(key)
