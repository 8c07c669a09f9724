"""The controller: the speculation policy with its per-request state and the batch SL cap, behind the policy
interface. It runs as a Ray actor (the engine reaches it through services.proxies.ControllerProxy) or in-process.

Generations. `reconfigure(cfg)` builds a new policy object, a generation, and makes it current. A request is
bound to the generation that is current at its first plan (its first engine step) and keeps it until it ends,
so a change applies to requests that arrive afterwards and never changes the rules under a running request.
An old generation is dropped when its last request is released. Each generation caps its own sequences
(CappedPolicy); while two generations run side by side, each has its own cap over its own sequences.

`observe` returns a small Telemetry (the cap of the last plan, the WVIR of the sequences that drafted) so the
ingress can export them without another actor call; an in-process engine ignores the return value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dsde_core.cost import StepCosts
from dsde_core.policies import Plan, SeqInfo, SpeculationPolicy, StepFeedback
from services.config import PolicyConfig, build_policy


@dataclass
class Telemetry:
    """What one observe() learned that the engine's own records do not hold."""

    cap: int | None = None  # SL cap of the last plan (None: no capped sequence)
    wvir: list[float] = field(default_factory=list)  # one per sequence that drafted and has a WVIR
    policy: str = ""  # the current generation's policy


@dataclass
class _Generation:
    config: PolicyConfig
    policy: SpeculationPolicy
    requests: int = 0  # requests bound to it
    planned: bool = False  # took part in the last plan


class Controller(SpeculationPolicy):
    def __init__(self, config: PolicyConfig | None = None) -> None:
        self._generations: dict[int, _Generation] = {}
        self._current = -1
        self._bound: dict[str, int] = {}  # req_id -> generation
        self.reconfigure(config or PolicyConfig())

    # ---- live configuration -------------------------------------------------------------------------
    def reconfigure(self, config: PolicyConfig) -> str:
        """Make a fresh policy built from `config` current for requests whose first step comes later."""
        policy = build_policy(config)
        old = self._current
        self._current = max(self._generations, default=-1) + 1
        self._generations[self._current] = _Generation(config, policy)
        self._drop_if_idle(old)
        self.name = policy.name
        return policy.name

    def describe(self) -> dict[str, Any]:
        gen = self._generations[self._current]
        return {"policy": gen.policy.name, "generation": self._current, "generations": len(self._generations),
                "tracked": len(self._bound)}

    def ping(self) -> bool:
        return True

    # ---- the policy interface ------------------------------------------------------------------------
    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        groups: dict[int, list[int]] = {}
        for i, seq in enumerate(seqs):
            gen_id = self._bound.get(seq.req_id)
            if gen_id is None:
                gen_id = self._bound[seq.req_id] = self._current
                self._generations[gen_id].requests += 1
            groups.setdefault(gen_id, []).append(i)
        plans: list[Plan | None] = [None] * len(seqs)
        for gen_id, gen in self._generations.items():
            idx = groups.get(gen_id, [])
            gen.planned = bool(idx)
            if not idx:
                continue
            ceiling = gen.config.max_sl
            sub = [seqs[i] if ceiling is None else replace(seqs[i], max_k=min(seqs[i].max_k, ceiling)) for i in idx]
            for i, p in zip(idx, gen.policy.plan(sub, costs, waiting), strict=True):
                plans[i] = p
        return plans  # type: ignore[return-value]  # every index belongs to exactly one group

    def observe(self, feedback: Sequence[StepFeedback]) -> Telemetry:
        groups: dict[int, list[StepFeedback]] = {}
        for fb in feedback:
            gen_id = self._bound.get(fb.req_id)
            if gen_id is not None:
                groups.setdefault(gen_id, []).append(fb)
        telemetry = Telemetry(policy=self._generations[self._current].policy.name)
        for gen_id, fbs in groups.items():
            policy = self._generations[gen_id].policy
            policy.observe(fbs)
            for fb in fbs:
                w = policy.stats(fb.req_id).get("wvir") if fb.proposed else None
                if w is not None:
                    telemetry.wvir.append(float(w))
        caps = [gen.policy.last_cap for gen in self._generations.values()
                if gen.planned and getattr(gen.policy, "last_cap", None) is not None]
        telemetry.cap = max(caps) if caps else None
        return telemetry

    def release(self, req_id: str) -> None:
        gen_id = self._bound.pop(req_id, None)
        if gen_id is None:
            return
        gen = self._generations[gen_id]
        gen.policy.release(req_id)
        gen.requests -= 1
        self._drop_if_idle(gen_id)

    def num_tracked(self) -> int:
        return len(self._bound)

    def stats(self, req_id: str) -> dict[str, float]:
        gen_id = self._bound.get(req_id)
        return {} if gen_id is None else self._generations[gen_id].policy.stats(req_id)

    def cappable(self, req_id: str) -> bool:
        gen_id = self._bound.get(req_id)
        return gen_id is None or self._generations[gen_id].policy.cappable(req_id)

    def _drop_if_idle(self, gen_id: int) -> None:
        gen = self._generations.get(gen_id)
        if gen is not None and gen_id != self._current and gen.requests == 0:
            del self._generations[gen_id]
