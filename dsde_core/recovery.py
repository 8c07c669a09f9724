"""What the engine knows about the health of the parties it talks to: the target, the draft and the policy.

A call that raises WorkerUnavailable marks its party down (Engine._failed); the engine then goes on without it
where it can and brings it back when it answers again (Engine._recover):

- draft down:  every running request continues target-only (max_k = 0); once the draft answers, each running
               slot is opened on it again and its cache is rebuilt from the committed tokens (the prefix-match
               sync feeds the whole sequence to an empty cache), and speculation resumes.
- target down: no step runs; once the target answers, each running slot is opened again and re-prefilled from
               prompt + committed tokens, and decoding continues where it stopped (nothing is repeated or
               lost: the committed tokens are the engine's). One that raises while it is brought back stays
               down and is tried again after a fault's wait (below). A request that waits longer than
               EngineConfig.worker_wait_s for it ends with an error (RequestOutput.error_type "unavailable").
- policy down: every sequence is planned k = 0 (decoding never stops); once it answers, its per-request state
               is rebuilt lazily, as for a new request (a restarted DSDE policy warms up again).

A draft or policy that raises any other error (a bug, an out-of-memory, a bad state: it still answers, one call
failed) is a fault, handled the same way: speculation is an optimisation, and without it the engine decodes
target-only, losslessly, so no request fails for it. Where WorkerUnavailable is probed every worker_probe_s, a
faulty party sits out worker_probe_s * 2^faults (at most MAX_FAULT_WAIT_S) before it is tried again: a fault that
repeats on every call would otherwise cost a resync of every draft cache each time. A fault after the party had been
up for MAX_FAULT_WAIT_S starts the count anew.

The draft's faults are also isolated to the requests that cause them (Engine._draft_fault): the requests of a draft
call that raised become suspects, and once the draft is back each drafts alone for a step (the batch's others plan
k = 0 for it) until it passes a call. A fault on a suspect alone is that request's: the draft stays up and does not
sit out; the suspect's draft slot is opened afresh, and one the draft raised on alone twice (Engine.DRAFT_TRIES) goes
on target-only to its end, its output unchanged. So a fault one request causes turns speculation off for that request
only, a passing one (an out-of-memory at the batch's size) for none, and a draft that faults on every call is tried in
a batch less and less often and alone at most twice per request.

A target that raises verifying a step or opening a slot (it alone produces the tokens: there is no going on without
it) stays up; nothing of the step was committed, and the fault is isolated to the requests that cause it
(Engine._target_fault): the step's requests become suspects, their target slots are opened afresh (re-prefilled from
prompt + committed tokens), and each runs alone until it passes a step. A request the target fails on alone twice in
a row (Engine.TARGET_TRIES) ends with the error; the others go on, exactly (the output at temperature 0 is still the
target-only output). A fault that one request causes (a prompt that breaks a kernel) so ends only that request; a
passing one (an out-of-memory at the batch's size), none. An error committing one request's tokens (a bug in its
text or stop strings) ends that request only; any other error out of a step (an engine bug) ends the step's requests
(AsyncEngine: Engine.fail_running; the waiting ones run next). A release that raises, from any party, is deferred as
for a lost one.

Releases that cannot reach a party that is down are deferred and sent when it is back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("target", "draft", "policy")
MAX_FAULT_WAIT_S = 60.0  # the longest a faulty draft or policy sits out before it is tried again


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
        """It raised `error` and stays up (the target, whose faults the engine isolates to requests): counted."""
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


def is_available(party: Any) -> bool:
    """Ask a worker or policy whether it answers; one without an `available` method is local and always does."""
    probe = getattr(party, "available", None)
    return True if probe is None else bool(probe())
