"""What each engine step measured: its phases' times, the cost model they feed (OnlineCostModel, which cost-aware
policies plan with), the step log (StepRecord: the raw material of cost models and benchmarks) and the prefill chunks
each model was fed.

A step calls start(), planned(), proposed() and verified() as its phases end, draft_call() with its draft call's
figures, and record() once it has committed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsde_core.cost import OnlineCostModel
from dsde_core.request import RequestOutput

if TYPE_CHECKING:
    from dsde_core.scheduler import Batch
    from dsde_core.workers import Proposal, Verdict

STEP_LOG_LEN = 4096  # the newest steps kept


@dataclass
class StepRecord:
    """Timing of one engine step: the raw material of cost models and benchmarks."""

    batch: int
    ks: list[int]  # tokens proposed per sequence
    emitted: int
    draft_s: float
    target_s: float
    total_s: float
    prefill: bool = False  # a prompt was fed this step
    contexts: list[int] = field(default_factory=list)  # committed tokens per sequence (the verify attends over + ks)


@dataclass
class DraftCall:
    """The step's draft call: its rows, the context tokens it took in besides (a prefill's, priced apart), and its
    rows fed a chunk of a prefill. All zero when the step did not call the draft."""

    rows: int = 0
    context: int = 0
    chunks: int = 0


class StepStats:
    """The engine's step recorder. `costs` is any object with OnlineCostModel's observe() and estimate() (a
    benchmark may swap in a fixed profile); `clock` is time.perf_counter unless given."""

    def __init__(self, costs: Any = None, clock: Callable[[], float] | None = None) -> None:
        self.costs = OnlineCostModel() if costs is None else costs
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG_LEN)
        self.prefill_chunks = {"target": 0, "draft": 0}  # chunks of prefills fed to each model since the start
        self.clock = clock or time.perf_counter
        self._marks: list[float] = []  # the step's start, then the end of its plan, draft and verify phases
        self._draft = DraftCall()

    # ---- the phases ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._marks = [self.clock()]
        self._draft = DraftCall()  # until draft_call() says otherwise: no draft call

    def planned(self) -> None:
        self._marks.append(self.clock())

    def draft_call(self, rows: int, context: int, chunks: int, done: bool) -> None:
        """The step's draft call, rows 0 for none (done: the draft answered, so its chunks count as fed)."""
        self._draft = DraftCall(rows, context, chunks)
        if done:
            self.prefill_chunks["draft"] += chunks

    def proposed(self) -> None:
        self._marks.append(self.clock())

    def verified(self, chunks: int) -> None:
        """The target answered; `chunks` of its rows were chunks of prefills."""
        self.prefill_chunks["target"] += chunks
        self._marks.append(self.clock())

    # ---- the record ---------------------------------------------------------------------------------------------
    def record(self, batch: Batch, proposals: dict[str, Proposal], verdicts: list[Verdict],
               emitted: list[RequestOutput]) -> StepRecord:
        """Feed the step to the cost model and append it to the step log. The cost model gets the target's query
        tokens (a prompt's too: its table is by tokens) and time; the draft's forwards (its levels) and rows over them
        (one per drafted token; a call that only caught caches up is one forward of its rows), its time and the
        context tokens it took in besides; the longest row's context."""
        t0, t1, t2, t3 = self._marks
        draft_s, target_s = t2 - t1, t3 - t2
        d = self._draft
        proposed = [len(p.tokens) for p in proposals.values()]
        forwards, rows = (max(proposed), sum(proposed)) if proposed else (int(d.rows > 0), d.rows)
        self.costs.observe(sum(batch.pending) + sum(proposed), target_s, forwards, rows, draft_s, d.context,
                           max(batch.contexts, default=0))
        record = StepRecord(batch=len(verdicts), ks=[len(v.kld) for v in verdicts],
                            emitted=sum(len(o.token_ids) for o in emitted), draft_s=draft_s, target_s=target_s,
                            total_s=self.clock() - t0, prefill=batch.prefill or d.chunks > 0, contexts=batch.contexts)
        self.step_log.append(record)
        return record
