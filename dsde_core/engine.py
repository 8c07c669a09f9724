"""The engine: continuous batching over a speculative step.

One step = plan (policy + cap give k_i per sequence) -> propose (draft) -> verify (target)
-> commit (both caches learn the committed tokens on their next call) -> emit.
Requests join and leave between steps. The engine talks to the draft, the target and the policy only
through their interfaces, so each may be a local object or a proxy to a Ray actor.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from dsde_core.config import EngineConfig, SamplingParams, SpeculationParams
from dsde_core.cost import OnlineCostModel
from dsde_core.detokenize import TextStream
from dsde_core.errors import ConfigError, WorkerUnavailable
from dsde_core.policies import Plan, SeqInfo, SpeculationPolicy, StepFeedback, ceiling_note
from dsde_core.recovery import ROLES, WorkerHealth, describe, is_available
from dsde_core.request import Request, RequestOutput
from dsde_core.workers import DraftTask, Proposal, Verdict, VerifyTask

log = logging.getLogger(__name__)
TARGET_TRIES = 2  # a request ends after the target raised on it alone this many times in a row (a passing fault: once)
DRAFT_TRIES = 2  # a request goes on target-only after the draft raised on it alone this many times in a row


def _share(need: int, budget: int | None) -> tuple[int, int | None]:
    """Chunked prefill's rule, for the target's prefills and the draft's: (the tokens of `need` a prefill takes in this
    step, the step's budget left). All of them where they fit (None: no limit), else the budget's rest."""
    if budget is None:
        return need, None
    fed = min(need, budget)
    return fed, budget - fed


class DraftAPI(Protocol):
    def open(self, slot: int, params: SamplingParams, prompt_len: int = 0, emitted: int = 0) -> None: ...
    def release(self, slot: int) -> None: ...
    def propose(self, tasks: list[DraftTask]) -> list[Proposal]: ...


class TargetAPI(Protocol):
    def open(self, slot: int, params: SamplingParams, prompt_len: int = 0, emitted: int = 0) -> None: ...
    def release(self, slot: int) -> None: ...
    def verify(self, tasks: list[VerifyTask]) -> list[Verdict]: ...


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


class Engine:
    def __init__(
        self,
        target: TargetAPI,
        draft: DraftAPI | None,
        policy: SpeculationPolicy,
        tokenizer: Any,
        config: EngineConfig,
        eos_ids: Iterable[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        self.target, self.draft, self.policy = target, draft, policy
        self.tokenizer, self.config = tokenizer, config
        self.eos_ids = frozenset(eos_ids) | frozenset(config.extra_eos_ids)
        self.vocab_size = vocab_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(config.max_batch_size - 1, -1, -1))
        self.requests: dict[str, Request] = {}
        self.step_log: deque[StepRecord] = deque(maxlen=4096)
        self.costs = OnlineCostModel()  # learnt from this engine's decode steps; cost-aware policies plan with it
        self._draft_rows = self._draft_context = self._draft_chunks = 0
        # chunks of prefills over the step's budget (config.prefill_chunk) each model was fed, since the start
        self.prefill_chunks = {"target": 0, "draft": 0}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()  # add_request / cancel may come from other threads
        self.health = {role: WorkerHealth(role) for role in ROLES}  # see dsde_core.recovery and _recover
        self.recovery_hooks: list[Callable[[str], None]] = []  # called with the role when a failed party is back
        self._suspects: dict[str, int] = {}  # req_id -> target faults alone in a row; each runs alone (_target_fault)
        self._draft_suspects: dict[str, int] = {}  # req_id -> draft faults alone in a row; each drafts alone
        self._draft_alone: Request | None = None  # the draft suspect drafting alone this step (_draft_fault)
        self._ids = itertools.count()
        self._note_ceiling()

    # ---- requests in and out ------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        spec: SpeculationParams | None = None,
        req_id: str | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> Request:
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self.validate(prompt, params)
        if params.min_tokens and not params.ignore_eos:  # the workers hold the end-of-sequence off too
            params = replace(params, stop_token_ids=tuple(self.eos_ids | set(params.stop_token_ids)))
        with self._lock:
            req_id = req_id or f"req-{next(self._ids)}"
            if req_id in self.requests:
                raise ConfigError(f"request id {req_id!r} is already in use")
            req = Request(req_id, prompt, params, spec or SpeculationParams(),
                          TextStream(self.tokenizer, params.stop, params.min_tokens,
                                     params.include_stop_str_in_output, params.skip_special_tokens), on_output)
            self.requests[req_id] = req
            self.waiting.append(req)
        return req

    def validate(self, prompt: list[int], params: SamplingParams, bound: str = "max_tokens") -> None:
        """ConfigError unless add_request would accept this prompt (a server checks before it starts a stream).
        `bound`: the caller's name for max_tokens, which an error names (an API field, a CLI flag)."""
        if not prompt:
            raise ConfigError("the prompt is empty: give at least one token", "prompt")
        self.check_ids(prompt, "prompt token ids", "prompt")
        self.check_ids([t for t, _ in params.logit_bias], "logit_bias token ids", "logit_bias")
        self.check_ids(params.stop_token_ids, "stop_token_ids", "stop_token_ids")
        need = len(prompt) + params.max_tokens
        if need > self.config.max_seq_len:
            raise ConfigError(
                f"prompt ({len(prompt)} tokens) + {bound} ({params.max_tokens}) = {need} exceeds the "
                f"context window of {self.config.max_seq_len} tokens", bound
            )

    def check_ids(self, ids: Sequence[int], what: str, field: str | None = None) -> None:
        """ConfigError naming `what` (its `field`: the input at fault) unless every id is inside the vocabulary (when
        the engine knows its size)."""
        if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in ids):
            raise ConfigError(f"{what} must be in [0, {self.vocab_size})", field)

    def cancel(self, req_id: str) -> bool:
        """Thread-safe; the request ends (and frees its slot and state) at the start of the next step. False, a
        no-op, for a request that has finished or is gone: a consumer can see a final output before the step frees
        its request, and an idle engine takes no next step to clear the id."""
        with self._lock:
            r = self.requests.get(req_id)
            if r is None or r.finished:
                return False
            self._cancelled.add(req_id)
            return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self._apply_cancellations()  # cancelled requests are freed here, before any work
        outputs += self._recover()  # failed workers that are back get their state again; see dsde_core.recovery
        outputs += self._admit()
        if not self.running or self.health["target"].down:
            return outputs
        # every running request (after a target fault, one suspect at a time); a prefill over the step's budget is fed
        # a chunk of its context (chunks) and runs its step once the rest fits
        rows, chunks = self._chunk_prefills(self._rows())
        self._draft_alone = next((r for r in rows if r.req_id in self._draft_suspects), None)
        plans = self._plan_or_fallback(rows) if rows else {}
        t1 = time.perf_counter()
        proposals = self._propose(rows, plans)
        t2 = time.perf_counter()
        prefill = bool(chunks or self._draft_chunks) or any(self._prefilling(r) for r in rows)  # a prompt is fed
        pending = [self._pending(r) for r in rows] + [n for _, n in chunks]
        contexts = [r.num_tokens for r in rows]
        tasks = [self._verify_task(r, proposals.get(r.req_id)) for r in rows]
        tasks += [self._verify_task(r, None, n) for r, n in chunks]
        fed = rows + [r for r, _ in chunks]
        try:
            verdicts = self.target.verify(tasks)
        except WorkerUnavailable as e:  # nothing was committed: the step is lost, the requests wait for the target
            self._failed("target", e)
            return outputs
        except Exception as e:  # a fault: nothing was committed; only a request the target fails on alone ends
            return outputs + self._target_fault(fed, e)
        for r in fed:
            self._suspects.pop(r.req_id, None)
        self.prefill_chunks["target"] += len(chunks)
        for (r, _), v in zip(chunks, verdicts[len(rows) :], strict=True):
            r.scored += v.prompt_logprobs or []
        verdicts = verdicts[: len(rows)]
        t3 = time.perf_counter()
        if rows and not self.health["policy"].down:
            try:
                self.policy.observe([self._feedback(r, plans[r.req_id], proposals.get(r.req_id), v)
                                     for r, v in zip(rows, verdicts, strict=True)])
            except Exception as e:  # WorkerUnavailable, or a fault: planned target-only until it is back
                self._failed("policy", e)
        ks = [len(v.kld) for v in verdicts]  # tokens proposed per sequence, 0 included
        emitted, failed = self._commit_all(rows, verdicts)
        self._observe_costs(pending, proposals, t2 - t1, t3 - t2, max(contexts, default=0))
        self.step_log.append(StepRecord(
            batch=len(verdicts), ks=ks, emitted=sum(len(o.token_ids) for o in emitted), draft_s=t2 - t1,
            target_s=t3 - t2, total_s=time.perf_counter() - t0, prefill=prefill, contexts=contexts))
        for out in emitted:
            if out.finished:
                self._free(self.requests.pop(out.req_id))
        return outputs + failed + emitted

    def _plan(self, rows: list[Request]) -> dict[str, Plan]:
        # a sequence whose draft cache is empty (it never drafted, or the draft restarted) prefills it when it drafts
        infos = [SeqInfo(r.req_id, r.params.temperature, self._max_k(r), self._pending(r), r.remaining(),
                         r.draft_context(drafting=True, window=self.config.draft_window)) for r in rows]
        costs = self.costs.estimate(len(infos), sum(i.pending + i.max_k for i in infos),
                                    max(r.num_tokens for r in rows))
        plans = self.policy.plan(infos, costs, len(self.waiting))
        return {i.req_id: replace(p, k=min(p.k, i.max_k)) for i, p in zip(infos, plans, strict=True)}

    @staticmethod
    def _prefilling(r: Request) -> bool:
        """The target's cache lacks more of r's context than its last committed token: a (re)start, or a chunked
        prefill under way."""
        return r.synced_target == 0 or r.chunked

    def _pending(self, r: Request) -> int:
        """Tokens the target is fed for r this step besides the drafts: the rest of its context during a prefill, else
        1 (the target's cache holds every committed token but the last: the correction or bonus token)."""
        return r.num_tokens - r.synced_target if self._prefilling(r) else 1

    def _chunk_prefills(self, rows: list[Request]) -> tuple[list[Request], list[tuple[Request, int]]]:
        """Chunked prefill: (the rows that run a whole step, the (row, tokens) fed a chunk of their context). In row
        order, prefills share config.prefill_chunk context tokens: one that fits runs its step; the first that does not
        is fed the budget's rest and sits out the plan, the draft and the commit; later ones wait a step. Decoding rows
        always run, so a long prompt never stalls them for more than one chunk."""
        budget = self.config.prefill_chunk
        whole: list[Request] = []
        chunks: list[tuple[Request, int]] = []
        for r in rows:
            need = self._pending(r) if self._prefilling(r) else 0  # a decoding row is outside the budget
            fed, budget = _share(need, budget)
            if fed == need:
                whole.append(r)
            elif fed > 0:
                chunks.append((r, fed))
        return whole, chunks

    def _observe_costs(self, pending: list[int], proposals: dict[str, Proposal], draft_s: float,
                       verify_s: float, context: int) -> None:
        """Feed one step to the cost model: the target's query tokens (a prompt's too: the table is by tokens); the
        draft's forwards (its levels) and rows over them (one per drafted token; a call that only caught caches up is
        one forward of its rows) and the context tokens it took in besides (a prefill's, which the model prices
        apart); the longest row's context."""
        proposed = [len(p.tokens) for p in proposals.values()]
        forwards, rows = (max(proposed), sum(proposed)) if proposed else (int(self._draft_rows > 0),
                                                                           self._draft_rows)
        self.costs.observe(sum(pending) + sum(proposed), verify_s, forwards, rows, draft_s, self._draft_context,
                           context)

    def _max_k(self, r: Request) -> int:
        """Ceiling on k: no draft, speculation off, global and per-request max SL, tokens left to generate."""
        if self.draft is None or not r.spec.enabled or self.health["draft"].down or r.draft_off:
            return 0
        if self._draft_alone is not None and self._draft_alone is not r:  # a draft suspect drafts alone
            return 0
        per_request = r.spec.max_sl if r.spec.max_sl is not None else self.config.max_sl
        # a step emits up to k + 1 tokens; never draft past max_tokens
        return max(0, min(self.config.max_sl, per_request, r.remaining() - 1))

    def _propose(self, rows: list[Request], plans: dict[str, Plan]) -> dict[str, Proposal]:
        # rows and context tokens of the draft call (for the cost model), and its rows fed a chunk of a prefill
        self._draft_rows = self._draft_context = self._draft_chunks = 0
        if self.draft is None or self.health["draft"].down:
            return {}
        tasks, reqs = [], []
        # chunked prefill for the draft: in row order, its prefills share config.prefill_chunk tokens as the target's
        # do; one over the budget takes the rest as a chunk and proposes nothing until what is left fits. A prompt
        # still reaches the draft only when its request first drafts: a request that never speculates never pays.
        budget = self.config.prefill_chunk
        drafting = any(p.k > 0 for p in plans.values())
        alone = self._draft_alone
        for r in rows if alone is None else [alone]:
            if r.draft_off:
                continue
            plan = plans[r.req_id]
            # A sequence with k = 0 still feeds its committed tokens to the draft when the batch drafts anyway
            # (its rows ride in the first draft forward) or when it lags by draft_max_lag tokens: its draft cache
            # never goes stale, so turning speculation back on needs no catch-up and loses no acceptance. A sequence
            # that has never drafted (or whose draft restarted) defers its prompt until it drafts: a prompt is a
            # prefill, not a cheap ride, and a request that never speculates never pays for it.
            lag = r.num_tokens - r.synced_draft
            ride = lag > 0 and r.synced_draft > 0 and (drafting or lag >= self.config.draft_max_lag)
            if not (plan.k > 0 or ride or self.config.draft_catch_up or r is alone):  # a suspect is tried at k = 0
                continue
            context = r.draft_context(plan.k > 0, self.config.draft_window)  # a prefill's or a catch-up's
            fed, budget = _share(context, budget) if r.draft_prefilling else (context, budget)
            chunk = fed < context  # a chunk of a prefill: only cached, nothing drafted this step
            if chunk and fed == 0:  # the step's draft prefills took the budget: it waits a step
                continue
            tasks.append(DraftTask(r.slot, r.tokens[r.synced_draft:], 0 if chunk else plan.k, plan.min_confidence,
                                   plan.p_next, plan.accept_model, plan.worth, limit=fed if chunk else None))
            reqs.append(r)
            self._draft_context += fed
            self._draft_chunks += chunk
            r.synced_draft, r.draft_gap = r.num_tokens, context - fed
        if not tasks:
            return {}
        self._draft_rows = len(tasks)
        stop = next((p.stop for p in plans.values() if p.stop is not None), None)  # one rule for the batch
        try:
            proposals = self.draft.propose(tasks, stop) if stop is not None else self.draft.propose(tasks)
        except WorkerUnavailable as e:  # this step and the next ones go on target-only until the draft is back
            self._failed("draft", e)
            return {}
        except Exception as e:  # a fault: the same after a batch's call, and its requests are suspects
            self._draft_fault(reqs, alone, e)
            return {}
        if alone is not None:  # it passed
            self._draft_suspects.pop(alone.req_id, None)
        self.prefill_chunks["draft"] += self._draft_chunks
        return {r.req_id: p for r, p in zip(reqs, proposals, strict=True) if p.tokens}

    def _verify_task(self, r: Request, proposal: Proposal | None, chunk: int | None = None) -> VerifyTask:
        """r's tokens for the target: all it has not been fed, or with `chunk` that many of a prefill's (no proposal;
        the target only caches them)."""
        start = r.synced_target
        if start == 0:
            r.scored = []
        # the prompt's log-probabilities where asked, once: from the prefill of a fresh slot (it feeds every token)
        asks = r.params.prompt_logprobs if r.prompt_logprobs is None and self._prefilling(r) else None
        end = r.num_tokens if chunk is None else start + chunk
        r.synced_target, r.chunked = end, chunk is not None
        return VerifyTask(r.slot, r.tokens[start:end], proposal, asks, partial=chunk is not None)

    @staticmethod
    def _feedback(r: Request, plan: Plan, prop: Proposal | None, v: Verdict) -> StepFeedback:
        dists = prop.dists if prop else []
        entropy = tuple(d.entropy for d in dists)  # computed by the draft only where a confidence stop needs it
        return StepFeedback(r.req_id, plan.k, len(dists), v.accepted, tuple(v.kld),
                            entropy if all(h == h for h in entropy) else (), tuple(prop.conf) if prop else ())

    def _commit_all(self, rows: list[Request],
                    verdicts: list[Verdict]) -> tuple[list[RequestOutput], list[RequestOutput]]:
        """Commit each row's verdict: (its outputs, the error ends of rows whose commit raised). A bug in one request's
        output (its text, its stop strings) ends that request only."""
        emitted: list[RequestOutput] = []
        failed: list[RequestOutput] = []
        for r, v in zip(rows, verdicts, strict=True):
            try:
                emitted.append(self._commit(r, v))
            except Exception as e:
                log.error("the engine failed on request %s; it ends with the error", r.req_id, exc_info=e)
                failed.append(self._fail(r, f"the engine failed on this request: {describe(e)}"))
        return emitted, failed

    def _commit(self, r: Request, v: Verdict) -> RequestOutput:
        now = time.perf_counter()
        r.stats.record_step(len(v.kld), v.accepted)
        new: list[int] = []
        for tok in v.tokens:
            if tok in self.eos_ids and not r.params.ignore_eos:
                r.finish_reason = "stop"
                break
            if tok in r.params.stop_token_ids:
                r.finish_reason, r.stop_reason = "stop", tok
                new += [tok] if r.params.include_stop_str_in_output else []
                break
            new.append(tok)
            if len(r.output_ids) + len(new) >= r.params.max_tokens:
                r.finish_reason = "length"
                break
        text = r.detok.add(new)
        if r.detok.stopped:  # a stop string: the tokens after the one completing it are dropped
            new = new[: r.detok.kept]
            r.finish_reason, r.stop_reason = "stop", r.detok.matched
        r.output_ids += new
        logprobs = None if v.logprobs is None else v.logprobs[: len(new)]
        r.logprobs += logprobs or []
        first = v.prompt_logprobs is not None and r.prompt_logprobs is None  # the prefill that computed them
        if first:  # the earlier chunks' and this step's
            r.prompt_logprobs, r.scored = (r.scored + v.prompt_logprobs)[: len(r.prompt_ids) - 1], []
        if new:
            r.stats.first_token = r.stats.first_token or now
            r.stats.token_times += [now] * len(new)
        if r.finished:
            text += r.detok.flush()
            r.stats.finish = now
        out = RequestOutput(r.req_id, new, text, r.finished, r.finish_reason, stats=r.stats if r.finished else None,
                            stop_reason=r.stop_reason,
                            logprobs=logprobs, prompt_logprobs=r.prompt_logprobs if first else None)
        return self._emit(out, r)

    @staticmethod
    def _emit(out: RequestOutput, r: Request) -> RequestOutput:
        if r.on_output is not None:
            try:
                r.on_output(out)
            except Exception:  # a consumer that went away must not stop the engine for everyone else
                r.on_output = None
        return out

    # ---- admission and release ------------------------------------------------------------------------
    def _admit(self) -> list[RequestOutput]:
        """Waiting requests in order while slots are free."""
        outputs: list[RequestOutput] = []
        while self.waiting and self.free_slots and not self.health["target"].down:
            with self._lock:
                r = self.waiting.popleft()
            r.slot = self.free_slots.pop()
            self.running.append(r)  # running before its slot opens: a failed open is redone by _recover
            failed = self._reopen_target(r)
            outputs += failed
            if not failed and self.draft is not None:
                self._open("draft", self.draft, r)
        return outputs

    def _apply_cancellations(self) -> list[RequestOutput]:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            for r in [r for r in self.waiting if r.req_id in cancelled]:
                self.waiting.remove(r)
        outputs = []
        for req_id in cancelled:
            r = self.requests.get(req_id)
            if r is None or r.finished:
                continue
            r.finish_reason = "cancelled"
            r.stats.finish = time.perf_counter()
            outputs.append(self._emit(RequestOutput(req_id, [], "", True, "cancelled", stats=r.stats), r))
            self._free(self.requests.pop(req_id))
        return outputs

    def fail_running(self, error: str) -> list[RequestOutput]:
        """End the running requests with an error after a step that raised (what it left of their state is not
        known) and free their state; the waiting ones were not in it and run next."""
        return [self._fail(r, error) for r in list(self.running)]

    def _fail(self, r: Request, error: str, error_type: str | None = None) -> RequestOutput:
        """End one request with an error and free its state (its caller has taken it off the waiting queue)."""
        r.finish_reason, r.error = "error", error
        r.stats.finish = time.perf_counter()
        out = self._emit(RequestOutput(r.req_id, [], "", True, "error", error, r.stats, error_type), r)
        self.requests.pop(r.req_id, None)
        self._free(r)
        return out

    def _free(self, r: Request) -> None:
        """Release the slot and every piece of per-request state: engine, both workers, policy."""
        with self._lock:  # cancelled while it finished
            self._cancelled.discard(r.req_id)
        if r in self.running:
            self.running.remove(r)
        self._suspects.pop(r.req_id, None)
        self._draft_suspects.pop(r.req_id, None)
        if r.slot is not None:
            self._release("target", self.target, r.slot)
            if self.draft is not None:
                self._release("draft", self.draft, r.slot)
            self.free_slots.append(r.slot)
            r.slot = None
        self._release("policy", self.policy, r.req_id)

    # ---- failure and recovery (dsde_core.recovery) -------------------------------------------------------
    def _plan_or_fallback(self, rows: list[Request]) -> dict[str, Plan]:
        """The policy's plans; k = 0 for every sequence (a target-only step) while the policy host is down."""
        if not self.health["policy"].down:
            try:
                return self._plan(rows)
            except Exception as e:  # WorkerUnavailable, or a fault
                self._failed("policy", e)
        return {r.req_id: Plan(0) for r in rows}

    def _rows(self) -> list[Request]:
        """This step's batch: every running request; while a batch the target raised on has suspects, one of them
        alone (_target_fault)."""
        return next(([r] for r in self.running if r.req_id in self._suspects), list(self.running))

    def _target_fault(self, rows: list[Request], error: Exception) -> list[RequestOutput]:
        """The target raised `error` on `rows` (a fault: it still answers; nothing was committed). Each becomes a
        suspect that runs alone until it passes a step; one the target raised on alone TARGET_TRIES times in a row
        ends with the error. So a fault one request causes ends only that request, and a passing one (an
        out-of-memory, say) none. What the call left of their target state is not known: each slot is opened afresh
        and re-prefilled from prompt + committed tokens."""
        self.health["target"].count_fault(error)
        log.error("the target raised an error on %d request(s); each is tried alone, and one it fails on alone %d "
                  "times ends with the error", len(rows), TARGET_TRIES, exc_info=error)
        outputs: list[RequestOutput] = []
        for r in rows:
            tries = self._suspects.get(r.req_id, 0) + int(len(rows) == 1)  # faults alone, in a row
            if tries >= TARGET_TRIES:
                outputs.append(self._fail(r, f"the target failed on this request: {describe(error)}"))
            else:
                self._suspects[r.req_id] = tries
                outputs += self._reopen_target(r)
        return outputs

    def _draft_fault(self, reqs: list[Request], alone: Request | None, error: Exception) -> None:
        """The draft raised `error` (a fault: it answers) on a call holding `reqs`. After a batch's call it sits out its
        wait (_failed) and each of the call's requests becomes a suspect: once the draft is back, a suspect drafts
        alone (the others plan k = 0 for that step) until it passes a call. A fault on a suspect alone is that
        request's: the draft stays up, the suspect's slot is opened afresh, and one the draft raised on alone
        DRAFT_TRIES times goes on target-only to its end. So a fault one request causes turns speculation off for
        that request only, and a passing one (an out-of-memory at the batch's size) for none."""
        if alone is None:
            self._failed("draft", error)
            for r in reqs:
                self._draft_suspects.setdefault(r.req_id, 0)
            return
        self.health["draft"].count_fault(error)
        tries = self._draft_suspects.get(alone.req_id, 0) + 1  # faults alone, in a row
        log.error("the draft raised an error on request %s alone (%d of %d)", alone.req_id, tries, DRAFT_TRIES,
                  exc_info=error)
        if tries < DRAFT_TRIES:
            self._draft_suspects[alone.req_id] = tries
            alone.synced_draft = 0  # what the call left of its draft cache is not known
            self._open("draft", self.draft, alone)
        else:
            self._draft_suspects.pop(alone.req_id, None)
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
            return  # opened by _recover when the worker is back
        try:
            self._open_slot(worker, r)
        except self._survivable(role) as e:
            self._failed(role, e)

    @staticmethod
    def _open_slot(worker: DraftAPI | TargetAPI, r: Request) -> None:
        """Open r's slot on a model worker: its parameters, prompt length and output so far (a reopened slot's seeded
        draws start a stream of their own)."""
        worker.open(r.slot, r.params, len(r.prompt_ids), len(r.output_ids))

    def _release(self, role: str, party: Any, key: int | str) -> None:
        """Release a slot (a request id for the policy); deferred to _recover while the party is down."""
        h = self.health[role]
        if not h.down:
            try:
                party.release(key)
                return
            except Exception as e:  # a release never fails a request: deferred until the party answers again
                self._failed(role, e)
        h.pending.add(key)

    @staticmethod
    def _survivable(role: str) -> type[Exception]:
        """What a call to `role` may raise without failing requests (dsde_core.recovery): the target's
        WorkerUnavailable; anything the draft or the policy raises (without them the engine decodes target-only)."""
        return WorkerUnavailable if role == "target" else Exception

    def _failed(self, role: str, error: Exception) -> None:
        """A call to `role` raised WorkerUnavailable, or a fault (any other error: from the draft or the policy, or
        from a release): go on without it; its state is rebuilt when it is back (a faulty one is tried again after a
        doubling wait)."""
        h, now = self.health[role], time.perf_counter()
        if isinstance(error, WorkerUnavailable):
            h.mark_down(now, str(error))
        else:
            log.error("the %s raised an error; going on without it (target-only)", role, exc_info=error)
            h.fault(now, error, self.config.worker_probe_s)
        for r in self.running:  # what it was told is lost: resync from scratch (prompt + committed tokens)
            if role == "draft":
                r.synced_draft = 0
            elif role == "target":
                r.synced_target = 0

    def _recover(self) -> list[RequestOutput]:
        """Probe each party that is down (every worker_probe_s); when one answers, send its deferred releases,
        open every running slot on it again and resync it from the committed tokens. While the target is down,
        end the requests that have waited worker_wait_s for it."""
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
                    for r in self.running:
                        self._open_slot(party, r)
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
        with self._lock:
            waiting = list(self.waiting)
        for r in waiting + list(self.running):
            if now - max(target.down_since, r.stats.arrival) >= self.config.worker_wait_s:
                with self._lock:
                    if r in self.waiting:
                        self.waiting.remove(r)
                outputs.append(self._fail(r, f"the target worker failed and did not come back within "
                                             f"{self.config.worker_wait_s:g}s ({target.last_error})", "unavailable"))
        if self.running or self.waiting:
            time.sleep(min(0.05, self.config.worker_probe_s))  # nothing can run until the target is back
        return outputs

    @property
    def recovering(self) -> bool:
        """A worker or the policy is down: step() probes it even with no request (AsyncEngine does, when idle)."""
        return any(h.down for h in self.health.values())

    def state(self) -> dict[str, Any]:
        """Counts of per-request state held by the engine, and each party's health (a server's debug view)."""
        with self._lock:
            waiting, cancelling = len(self.waiting), len(self._cancelled)
        return {"running": len(self.running), "waiting": waiting, "requests": len(self.requests),
                "slots_in_use": self.config.max_batch_size - len(self.free_slots), "cancelling": cancelling,
                "tried_alone": len(self._suspects),  # requests of a batch the target raised on (_target_fault)
                "draft_tried_alone": len(self._draft_suspects),  # of a draft call that raised (_draft_fault)
                "draft_off": sum(r.draft_off for r in self.running),  # target-only after draft faults alone
                "prefill_chunks": dict(self.prefill_chunks),  # fed to each model since the start (prefill_chunk)
                "workers": {role: h.as_dict() for role, h in self.health.items() if role != "draft" or self.draft}}

    # ---- convenience --------------------------------------------------------------------------------
    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_unfinished():
            self.step()

    def set_policy(self, policy: SpeculationPolicy) -> None:
        """Swap the speculation policy; only between batches (no request running)."""
        if self.has_unfinished():
            raise ConfigError("the policy can only be changed while no request is running")
        self.policy = policy
        self._note_ceiling()

    def _note_ceiling(self) -> None:
        if note := ceiling_note(self.policy, self.config.max_sl):
            log.warning(note)
