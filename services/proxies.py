"""Engine-side stand-ins for the actors: DraftAPI, TargetAPI and the policy interface, by plain actor calls.

Each method is `ray.get(actor.method.remote(...))` and nothing else: the engine loop is dsde_core's, the same one
that runs in-process. A plain actor call costs ~1.3 ms here (a Serve handle call 4-5 ms), so the per-step calls
between engine, draft, target and controller are plain calls. Calls from the engine thread reach each actor in
the order they were made.

One exception to "nothing else": `release` of an actor that has died is not an error. The engine releases
every slot after a failed step (abort_all); a dead actor holds nothing to release, and raising there would stop
the engine from freeing the other requests' state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError

from dsde_core.config import SamplingParams
from dsde_core.cost import StepCosts
from dsde_core.policies import Plan, SeqInfo, SpeculationPolicy, StepFeedback
from dsde_core.workers import DraftTask, Proposal, Verdict, VerifyTask

log = logging.getLogger(__name__)


def _release(actor: Any, *args: Any) -> None:
    try:
        ray.get(actor.release.remote(*args))
    except RayActorError as e:
        log.warning("release%r on a dead actor ignored: %s", args, e)


class DraftProxy:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def open(self, slot: int, params: SamplingParams) -> None:
        ray.get(self.actor.open.remote(slot, params))

    def release(self, slot: int) -> None:
        _release(self.actor, slot)

    def propose(self, tasks: list[DraftTask]) -> list[Proposal]:
        return ray.get(self.actor.propose.remote(tasks))

    def num_open(self) -> int:
        return ray.get(self.actor.num_open.remote())


class TargetProxy:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def open(self, slot: int, params: SamplingParams) -> None:
        ray.get(self.actor.open.remote(slot, params))

    def release(self, slot: int) -> None:
        _release(self.actor, slot)

    def verify(self, tasks: list[VerifyTask]) -> list[Verdict]:
        return ray.get(self.actor.verify.remote(tasks))

    def num_open(self) -> int:
        return ray.get(self.actor.num_open.remote())


class ControllerProxy(SpeculationPolicy):
    """The policy interface over the controller actor (services.controller.Controller)."""

    name = "controller"

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None) -> list[Plan]:
        return ray.get(self.actor.plan.remote(list(seqs), costs))

    def observe(self, feedback: Sequence[StepFeedback]) -> Any:
        return ray.get(self.actor.observe.remote(list(feedback)))  # the controller's Telemetry

    def release(self, req_id: str) -> None:
        _release(self.actor, req_id)

    def num_tracked(self) -> int:
        return ray.get(self.actor.num_tracked.remote())

    def stats(self, req_id: str) -> dict[str, float]:
        return ray.get(self.actor.stats.remote(req_id))

    def cappable(self, req_id: str) -> bool:
        return ray.get(self.actor.cappable.remote(req_id))
