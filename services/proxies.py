"""Engine-side stand-ins for the actors: DraftAPI, TargetAPI and the policy interface, by plain actor calls.

Each method is `ray.get(actor.method.remote(...))` and nothing else: the engine loop is dsde_core's, the same one
that runs in-process. A plain actor call costs a fraction of a Serve handle call (which goes through Serve's
router), so the per-step calls between engine, draft, target and controller are plain calls. Calls from the engine
thread reach each actor in the order they were made.

Transport failures become dsde_core's own error, and nothing more is decided here: a call to an actor that died,
is restarting or was restarted raises `WorkerUnavailable` (Ray's RayActorError: ActorDiedError,
ActorUnavailableError), and an error dsde_core raised inside the actor (e.g. `WorkerStateLost` from a worker that
came back without its slots) is raised again as itself. What to do about it is the engine's business
(dsde_core.recovery). `available()` asks without waiting: a ping stays in flight and is looked at, never awaited,
so a step never blocks on an actor that is still loading its model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from dsde_core.config import SamplingParams
from dsde_core.cost import StepCosts
from dsde_core.errors import DSDEError, WorkerUnavailable
from dsde_core.policies import Plan, SeqInfo, SpeculationPolicy, StepFeedback
from dsde_core.policies.stopping import DraftStop
from dsde_core.workers import DraftTask, Proposal, Verdict, VerifyTask

log = logging.getLogger(__name__)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def translate(role: str, e: BaseException) -> BaseException:
    """Ray's failure of a call to the `role` actor as dsde_core's error: the actor is gone or restarting ->
    WorkerUnavailable; an error dsde_core raised in the actor -> that error itself; anything else unchanged."""
    if isinstance(e, RayTaskError) and isinstance(e.cause, DSDEError):
        return e.cause
    if isinstance(e, RayActorError):
        return WorkerUnavailable(role, f"{type(e).__name__}: {_first_line(e)}")
    return e


class _ActorCalls:
    """ray.get with Ray's failures translated into dsde_core's, and a non-blocking liveness probe."""

    role = "actor"

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._ping: Any = None  # an ObjectRef in flight, or None

    def _get(self, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except (RayTaskError, RayActorError) as e:
            translated = translate(self.role, e)
            if translated is e:
                raise
            raise translated from None

    def available(self) -> bool:
        """True once a ping has come back; False while it is in flight or failed (a new one is sent next time)."""
        if self._ping is None:
            self._ping = self.actor.ping.remote()
        ready, _ = ray.wait([self._ping], timeout=0)
        if not ready:
            return False
        ref, self._ping = self._ping, None
        try:
            return bool(ray.get(ref))
        except RayActorError as e:
            log.info("the %s is not back yet: %s", self.role, _first_line(e))
            return False


class DraftProxy(_ActorCalls):
    role = "draft"

    def open(self, slot: int, params: SamplingParams, prompt_len: int = 0, emitted: int = 0) -> None:
        self._get(self.actor.open.remote(slot, params, prompt_len, emitted))

    def release(self, slot: int) -> None:
        self._get(self.actor.release.remote(slot))

    def propose(self, tasks: list[DraftTask], stop: DraftStop | None = None) -> list[Proposal]:
        return self._get(self.actor.propose.remote(tasks, stop))

    def num_open(self) -> int:
        return self._get(self.actor.num_open.remote())


class TargetProxy(_ActorCalls):
    role = "target"

    def open(self, slot: int, params: SamplingParams, prompt_len: int = 0, emitted: int = 0) -> None:
        self._get(self.actor.open.remote(slot, params, prompt_len, emitted))

    def release(self, slot: int) -> None:
        self._get(self.actor.release.remote(slot))

    def verify(self, tasks: list[VerifyTask]) -> list[Verdict]:
        return self._get(self.actor.verify.remote(tasks))

    def num_open(self) -> int:
        return self._get(self.actor.num_open.remote())


class ControllerProxy(_ActorCalls, SpeculationPolicy):
    """The policy interface over the controller actor (services.controller.Controller)."""

    name = "controller"
    role = "policy"

    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        return self._get(self.actor.plan.remote(list(seqs), costs, waiting))

    def observe(self, feedback: Sequence[StepFeedback]) -> Any:
        return self._get(self.actor.observe.remote(list(feedback)))  # the controller's Telemetry

    def release(self, req_id: str) -> None:
        self._get(self.actor.release.remote(req_id))

    def num_tracked(self) -> int:
        return self._get(self.actor.num_tracked.remote())

    def stats(self, req_id: str) -> dict[str, float]:
        return self._get(self.actor.stats.remote(req_id))

    def cappable(self, req_id: str) -> bool:
        return self._get(self.actor.cappable.remote(req_id))

    def reconfigure(self, config: Any) -> str:
        return self._get(self.actor.reconfigure.remote(config))
