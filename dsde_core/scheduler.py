"""The engine's requests and slots: the waiting queue (FIFO), the running batch, the free KV-cache slots, cancellations,
and each step's chunked-prefill split of the prefill budget (EngineConfig.prefill_chunk) for the target and the draft.

It calls no worker: the engine opens an admitted request's slots, and releases them when the scheduler frees it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from dsde_core.config import EngineConfig
from dsde_core.errors import ConfigError
from dsde_core.request import Request


def share(need: int, budget: int | None) -> tuple[int, int | None]:
    """Chunked prefill's rule, for the target's prefills and the draft's: (the tokens of `need` a prefill takes in this
    step, the step's budget left). All of them where they fit (None: no limit), else the budget's rest."""
    if budget is None:
        return need, None
    fed = min(need, budget)
    return fed, budget - fed


def prefilling(r: Request) -> bool:
    """The target's cache lacks more of r's context than its last committed token: a (re)start, or a chunked prefill
    under way."""
    return r.synced_target == 0 or r.chunked


def pending(r: Request) -> int:
    """Tokens the target is fed for r this step besides the drafts: the rest of its context during a prefill, else 1
    (the target's cache holds every committed token but the last: the correction or bonus token)."""
    return r.num_tokens - r.synced_target if prefilling(r) else 1


@dataclass
class Batch:
    """One step's share of the target: what each request is fed, fixed before the step feeds anything."""

    rows: list[Request]  # run the whole step: plan, draft, verify, commit
    chunks: list[tuple[Request, int]]  # (request, tokens): a chunk of a prefill over the budget, only cached
    pending: list[int]  # target tokens besides the drafts, per row and then per chunk
    contexts: list[int]  # committed tokens per row (what the verify attends over, besides its drafts)
    prefill: bool  # a prompt reaches the target this step (a row's prefill or a chunk)

    @property
    def fed(self) -> list[Request]:
        """Every request the target is fed this step: the rows, then the chunks'."""
        return self.rows + [r for r, _ in self.chunks]


class Scheduler:
    """Requests by id, the waiting queue, the running batch, the free slots and the requests cancelled since the last
    step. `lock` guards what other threads touch (add, cancel: a server's event loop) against the step loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(config.max_batch_size - 1, -1, -1))  # popped from the end: slot 0 first
        self.cancelled: set[str] = set()
        self.lock = threading.Lock()

    # ---- requests in and out ----------------------------------------------------------------------------------
    def add(self, r: Request) -> None:
        """Register r and queue it; ConfigError if its id is in use."""
        with self.lock:
            if r.req_id in self.requests:
                raise ConfigError(f"request id {r.req_id!r} is already in use")
            self.requests[r.req_id] = r
            self.waiting.append(r)

    def cancel(self, req_id: str) -> bool:
        """Mark a request to end at the next step; False, a no-op, for one that has finished or is gone."""
        with self.lock:
            r = self.requests.get(req_id)
            if r is None or r.finished:
                return False
            self.cancelled.add(req_id)
            return True

    def take_cancelled(self) -> list[Request]:
        """The requests cancelled since the last call that are still to end, each taken off the waiting queue."""
        with self.lock:
            cancelled, self.cancelled = self.cancelled, set()
            for r in [r for r in self.waiting if r.req_id in cancelled]:
                self.waiting.remove(r)
        return [r for req_id in cancelled if (r := self.requests.get(req_id)) is not None and not r.finished]

    def admit_next(self) -> Request | None:
        """The first waiting request, given a free slot and running (before its slots open: a failed open is redone
        when the worker is back); None when none waits or no slot is free."""
        if not (self.waiting and self.free_slots):
            return None
        with self.lock:
            r = self.waiting.popleft()
        r.slot = self.free_slots.pop()
        self.running.append(r)
        return r

    def queued(self) -> list[Request]:
        with self.lock:
            return list(self.waiting)

    def dequeue(self, r: Request) -> None:
        """Take r off the waiting queue, if it is there."""
        with self.lock:
            if r in self.waiting:
                self.waiting.remove(r)

    def free(self, r: Request) -> int | None:
        """Forget r: off the table and the running batch, its slot free again; returns that slot (None: it had
        none), which its workers are still to release."""
        self.requests.pop(r.req_id, None)
        with self.lock:  # cancelled while it finished
            self.cancelled.discard(r.req_id)
        if r in self.running:
            self.running.remove(r)
        slot, r.slot = r.slot, None
        if slot is not None:
            self.free_slots.append(slot)
        return slot

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step's chunked-prefill split ---------------------------------------------------------------------
    def schedule(self, rows: list[Request]) -> Batch:
        """Split the step's rows on the target's prefill budget: in row order, prefills share config.prefill_chunk
        context tokens; one that fits runs its step; the first that does not is fed the budget's rest as a chunk and
        sits out the plan, the draft and the commit; later ones wait a step. Decoding rows are outside the budget and
        always run, so a long prompt never stalls them for more than one chunk."""
        budget = self.config.prefill_chunk
        whole: list[Request] = []
        chunks: list[tuple[Request, int]] = []
        for r in rows:
            need = pending(r) if prefilling(r) else 0
            fed, budget = share(need, budget)
            if fed == need:
                whole.append(r)
            elif fed > 0:
                chunks.append((r, fed))
        return Batch(whole, chunks, [pending(r) for r in whole] + [n for _, n in chunks], [r.num_tokens for r in whole],
                     bool(chunks) or any(prefilling(r) for r in whole))

    def split_draft(self, feeds: Iterable[tuple[Request, int]]) -> list[tuple[Request, int, int]]:
        """The same split for the draft: given (request, context tokens it is to take in) in row order, (request,
        context, tokens fed this step) for each fed. Its prefills (an empty or chunked draft cache) share
        config.prefill_chunk as the target's do: one over the budget takes the rest as a chunk (fed < context) and
        proposes nothing until what is left fits; one the budget has nothing left for waits a step."""
        budget = self.config.prefill_chunk
        out = []
        for r, context in feeds:
            fed, budget = share(context, budget) if r.draft_prefilling else (context, budget)
            if fed < context and fed == 0:  # the step's draft prefills took the budget: it waits a step
                continue
            out.append((r, context, fed))
        return out
