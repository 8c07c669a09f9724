"""What the engine knows about the health of the parties it talks to: the target, the draft and the policy.

A call that raises WorkerUnavailable marks its party down (Engine._failed); the engine then goes on without it
where it can and brings it back when it answers again (Engine._recover):

- draft down:  every running request continues target-only (max_k = 0); once the draft answers, each running
               slot is opened on it again and its cache is rebuilt from the committed tokens (the prefix-match
               sync feeds the whole sequence to an empty cache), and speculation resumes.
- target down: no step runs; once the target answers, each running slot is opened again and re-prefilled from
               prompt + committed tokens, and decoding continues where it stopped (nothing is repeated or
               lost: the committed tokens are the engine's). A request that waits longer than
               EngineConfig.worker_wait_s for it ends with an error (RequestOutput.error_type "unavailable").
- policy down: every sequence is planned k = 0 (decoding never stops); once it answers, its per-request state
               is rebuilt lazily, as for a new request (a restarted DSDE policy warms up again).

Releases that cannot reach a party that is down are deferred and sent when it is back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("target", "draft", "policy")


@dataclass
class WorkerHealth:
    role: str
    down_since: float | None = None  # time.perf_counter() of the failure; None: up
    last_error: str = ""
    failures: int = 0  # times it was marked down
    recoveries: int = 0  # times it came back
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

    def mark_up(self) -> None:
        self.down_since = None
        self.recoveries += 1
        self.pending.clear()

    def as_dict(self) -> dict[str, Any]:
        return {"up": not self.down, "failures": self.failures, "recoveries": self.recoveries,
                "last_error": self.last_error or None, "deferred_releases": len(self.pending)}


def is_available(party: Any) -> bool:
    """Ask a worker or policy whether it answers; one without an `available` method is local and always does."""
    probe = getattr(party, "available", None)
    return True if probe is None else bool(probe())
