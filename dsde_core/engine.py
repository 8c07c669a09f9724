"""The engine: continuous batching over a speculative step.

One step (Engine.step) is plan -> propose -> verify -> commit -> record:
- plan: the cancelled requests end, failed parties that answer again get their state back (recovery.RecoveryGuard),
  waiting requests are admitted into free slots, and the running ones are split on the step's prefill budget
  (scheduler.Scheduler): a prefill over it is fed a chunk of its context, only cached, and sits out the rest of the
  step. The policy (with its cap) then gives each row a speculation length k, bounded by the row's ceiling (_max_k).
- propose: the draft takes in each row's committed tokens it lacks and proposes up to k tokens.
- verify: the target scores every row's proposal in one batched forward and accepts a prefix of it, losslessly
  (greedy: while it matches the target's argmax; sampled: rejection sampling), plus a token of its own.
- commit: the policy observes the step; each row's tokens are checked against its stops and lengths and emitted; both
  caches learn them on their next call.
- record: the step's phase times feed the cost model and the step log (step_stats.StepStats); then each finished
  request frees its slot and its state on every party.

Requests join and leave between steps. The engine reaches the draft, the target and the policy only through their
interfaces, by way of the guard, so each may be a local object or a proxy to a Ray actor.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from dsde_core.config import EngineConfig, SamplingParams, SpeculationParams
from dsde_core.detokenize import TextStream
from dsde_core.errors import ConfigError
from dsde_core.policies import Plan, SeqInfo, SpeculationPolicy, StepFeedback, ceiling_note
from dsde_core.recovery import DRAFT_TRIES, TARGET_TRIES, DraftAPI, RecoveryGuard, TargetAPI, WorkerHealth, describe
from dsde_core.request import Request, RequestOutput
from dsde_core.scheduler import Batch, Scheduler, pending, prefilling
from dsde_core.step_stats import StepRecord, StepStats
from dsde_core.workers import DraftTask, Proposal, Verdict, VerifyTask

__all__ = ["DRAFT_TRIES", "TARGET_TRIES", "DraftAPI", "Engine", "StepRecord", "TargetAPI"]

log = logging.getLogger(__name__)


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
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_ids = frozenset(eos_ids) | frozenset(config.extra_eos_ids)
        self._config = config
        self.scheduler = Scheduler(config)  # requests, queues, slots, chunked prefill
        self.guard = RecoveryGuard(target, draft, policy, config, self.scheduler, self._fail)  # every worker call
        self.stats = StepStats()  # phase times, the cost model, the step log
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
        """Queue a request (thread-safe); ConfigError for a prompt or parameters it cannot take, or an id in use."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self.validate(prompt, params)
        if params.min_tokens and not params.ignore_eos:  # the workers hold the end-of-sequence off too
            params = replace(params, stop_token_ids=tuple(self.eos_ids | set(params.stop_token_ids)))
        req = Request(req_id or f"req-{next(self._ids)}", prompt, params, spec or SpeculationParams(),
                      TextStream(self.tokenizer, params.stop, params.min_tokens, params.include_stop_str_in_output,
                                 params.skip_special_tokens), on_output)
        self.scheduler.add(req)
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
        return self.scheduler.cancel(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step (the module doc): the outputs of every request it emitted tokens for or ended."""
        self.stats.start()
        outputs = self._end_cancelled() + self.guard.recover() + self._admit()
        if not self.running or self.guard.target_down:
            return outputs
        batch = self.scheduler.schedule(self.guard.rows())
        plans = self.guard.plan(batch.rows, self._plan)
        self.stats.planned()
        proposals = self._propose(batch.rows, plans)
        self.stats.proposed()
        verdicts, ended = self._verify(batch, proposals)
        if verdicts is None:  # the target raised: nothing was committed, the step is lost
            return outputs + ended
        self.stats.verified(len(batch.chunks))
        self.guard.observe(batch.rows, lambda: self._feedback(batch.rows, plans, proposals, verdicts))
        emitted, ended = self._commit_all(batch.rows, verdicts)
        self.stats.record(batch, proposals, verdicts, emitted)
        self._free_finished(emitted)
        return outputs + ended + emitted

    def _end_cancelled(self) -> list[RequestOutput]:
        """End the requests cancelled since the last step, before any work; their slots and state are freed."""
        outputs = []
        for r in self.scheduler.take_cancelled():
            r.finish_reason = "cancelled"
            r.stats.finish = time.perf_counter()
            outputs.append(self._emit(RequestOutput(r.req_id, [], "", True, "cancelled", stats=r.stats), r))
            self._free(r)
        return outputs

    def _admit(self) -> list[RequestOutput]:
        """Waiting requests in order, while slots are free and the target is up, each with its slots opened."""
        outputs: list[RequestOutput] = []
        while not self.guard.target_down and (r := self.scheduler.admit_next()) is not None:
            outputs += self.guard.open(r)
        return outputs

    def _plan(self, rows: list[Request]) -> dict[str, Plan]:
        # a sequence whose draft cache is empty (it never drafted, or the draft restarted) prefills it when it drafts
        infos = [SeqInfo(r.req_id, r.params.temperature, self._max_k(r), pending(r), r.remaining(),
                         r.draft_context(drafting=True, window=self.config.draft_window)) for r in rows]
        costs = self.costs.estimate(len(infos), sum(i.pending + i.max_k for i in infos),
                                    max(r.num_tokens for r in rows))
        plans = self.policy.plan(infos, costs, len(self.waiting))
        return {i.req_id: replace(p, k=min(p.k, i.max_k)) for i, p in zip(infos, plans, strict=True)}

    def _max_k(self, r: Request) -> int:
        """Ceiling on k: no draft (or it is down, or r drafts no more, or another suspect drafts alone), speculation
        off, global and per-request max SL, tokens left to generate."""
        if not r.spec.enabled or not self.guard.may_draft(r):
            return 0
        per_request = r.spec.max_sl if r.spec.max_sl is not None else self.config.max_sl
        # a step emits up to k + 1 tokens; never draft past max_tokens
        return max(0, min(self.config.max_sl, per_request, r.remaining() - 1))

    def _draft_feeds(self, rows: list[Request], plans: dict[str, Plan]) -> list[tuple[Request, int]]:
        """(row, context tokens the draft is to take in for it) for each row the draft is fed this step; only the draft
        suspect while one drafts alone (it is tried even at k = 0)."""
        drafting = any(p.k > 0 for p in plans.values())
        alone = self.guard.alone
        feeds = []
        for r in rows if alone is None else [alone]:
            if r.draft_off:
                continue
            k = plans[r.req_id].k
            # A sequence with k = 0 still feeds its committed tokens to the draft when the batch drafts anyway
            # (its rows ride in the first draft forward) or when it lags by draft_max_lag tokens: its draft cache
            # never goes stale, so turning speculation back on needs no catch-up and loses no acceptance. A sequence
            # that has never drafted (or whose draft restarted) defers its prompt until it drafts: a prompt is a
            # prefill, not a cheap ride, and a request that never speculates never pays for it.
            lag = r.num_tokens - r.synced_draft
            ride = lag > 0 and r.synced_draft > 0 and (drafting or lag >= self.config.draft_max_lag)
            if k > 0 or ride or self.config.draft_catch_up or r is alone:
                feeds.append((r, r.draft_context(k > 0, self.config.draft_window)))  # a prefill's or a catch-up's
        return feeds

    def _propose(self, rows: list[Request], plans: dict[str, Plan]) -> dict[str, Proposal]:
        """The draft's proposals by request id (those with tokens). A draft prefill over the step's budget is fed a
        chunk (scheduler.split_draft) and proposes nothing until the rest fits."""
        feeds = self._draft_feeds(rows, plans) if self.guard.drafting else []
        tasks, reqs, context, chunks = [], [], 0, 0
        for r, ctx, fed in self.scheduler.split_draft(feeds):
            plan, chunk = plans[r.req_id], fed < ctx  # a chunk: only cached, nothing drafted this step
            tasks.append(DraftTask(r.slot, r.tokens[r.synced_draft:], 0 if chunk else plan.k, plan.min_confidence,
                                   plan.p_next, plan.accept_model, plan.worth, limit=fed if chunk else None))
            reqs.append(r)
            context, chunks = context + fed, chunks + chunk
            r.synced_draft, r.draft_gap = r.num_tokens, ctx - fed
        stop = next((p.stop for p in plans.values() if p.stop is not None), None)  # one rule for the batch
        proposals = self.guard.propose(tasks, reqs, stop) if tasks else None
        self.stats.draft_call(len(tasks), context, chunks, done=proposals is not None)
        if proposals is None:  # no call, or the draft raised: the step goes on target-only
            return {}
        return {r.req_id: p for r, p in zip(reqs, proposals, strict=True) if p.tokens}

    def _verify(self, batch: Batch, proposals: dict[str, Proposal]) -> tuple[list[Verdict] | None,
                                                                            list[RequestOutput]]:
        """(the rows' verdicts, []); (None, the outputs of the requests the guard ended) where the target raised. A
        chunk's verdict only scores its prompt tokens, kept for its prefill's end."""
        tasks = [self._verify_task(r, proposals.get(r.req_id)) for r in batch.rows]
        tasks += [self._verify_task(r, None, n) for r, n in batch.chunks]
        verdicts, ended = self.guard.verify(tasks, batch.fed)
        if verdicts is None:
            return None, ended
        for (r, _), v in zip(batch.chunks, verdicts[len(batch.rows):], strict=True):
            r.scored += v.prompt_logprobs or []
        return verdicts[: len(batch.rows)], []

    def _verify_task(self, r: Request, proposal: Proposal | None, chunk: int | None = None) -> VerifyTask:
        """r's tokens for the target: all it has not been fed, or with `chunk` that many of a prefill's (no proposal;
        the target only caches them)."""
        start = r.synced_target
        if start == 0:
            r.scored = []
        # the prompt's log-probabilities where asked, once: from the prefill of a fresh slot (it feeds every token)
        asks = r.params.prompt_logprobs if r.prompt_logprobs is None and prefilling(r) else None
        end = r.num_tokens if chunk is None else start + chunk
        r.synced_target, r.chunked = end, chunk is not None
        return VerifyTask(r.slot, r.tokens[start:end], proposal, asks, partial=chunk is not None)

    @staticmethod
    def _feedback(rows: list[Request], plans: dict[str, Plan], proposals: dict[str, Proposal],
                  verdicts: list[Verdict]) -> list[StepFeedback]:
        out = []
        for r, v in zip(rows, verdicts, strict=True):
            prop = proposals.get(r.req_id)
            dists = prop.dists if prop else []
            entropy = tuple(d.entropy for d in dists)  # computed by the draft only where a confidence stop needs it
            out.append(StepFeedback(r.req_id, plans[r.req_id].k, len(dists), v.accepted, tuple(v.kld),
                                    entropy if all(h == h for h in entropy) else (), tuple(prop.conf) if prop else ()))
        return out

    # ---- commit -------------------------------------------------------------------------------------
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

    # ---- ending requests ----------------------------------------------------------------------------
    def fail_running(self, error: str) -> list[RequestOutput]:
        """End the running requests with an error after a step that raised (what it left of their state is not
        known) and free their state; the waiting ones were not in it and run next."""
        return [self._fail(r, error) for r in list(self.running)]

    def _fail(self, r: Request, error: str, error_type: str | None = None) -> RequestOutput:
        """End one request with an error and free its state (its caller has taken it off the waiting queue)."""
        r.finish_reason, r.error = "error", error
        r.stats.finish = time.perf_counter()
        out = self._emit(RequestOutput(r.req_id, [], "", True, "error", error, r.stats, error_type), r)
        self._free(r)
        return out

    def _free_finished(self, emitted: list[RequestOutput]) -> None:
        for out in emitted:
            if out.finished:
                self._free(self.requests[out.req_id])

    def _free(self, r: Request) -> None:
        """Release the slot and every piece of per-request state: engine, both workers, policy."""
        self.guard.release(r.req_id, self.scheduler.free(r))

    # ---- state ---------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Counts of per-request state held by the engine, and each party's health (a server's debug view)."""
        s, g = self.scheduler, self.guard
        with s.lock:
            waiting, cancelling = len(s.waiting), len(s.cancelled)
        return {"running": len(s.running), "waiting": waiting, "requests": len(s.requests),
                "slots_in_use": self.config.max_batch_size - len(s.free_slots), "cancelling": cancelling,
                "tried_alone": len(g.suspects),  # requests of a batch the target raised on, each to run alone
                "draft_tried_alone": len(g.draft_suspects),  # of a draft call that raised, each to draft alone
                "draft_off": sum(r.draft_off for r in s.running),  # target-only after draft faults alone
                "prefill_chunks": dict(self.prefill_chunks),  # fed to each model since the start (prefill_chunk)
                "workers": {role: h.as_dict() for role, h in g.health.items() if role != "draft" or self.draft}}

    # what other code reads on the engine, held by its parts
    @property
    def config(self) -> EngineConfig:
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self._config = self.scheduler.config = self.guard.config = config

    @property
    def target(self) -> TargetAPI:
        return self.guard.target

    @target.setter
    def target(self, target: TargetAPI) -> None:
        self.guard.target = target

    @property
    def draft(self) -> DraftAPI | None:
        return self.guard.draft

    @draft.setter
    def draft(self, draft: DraftAPI | None) -> None:
        self.guard.draft = draft

    @property
    def policy(self) -> SpeculationPolicy:
        return self.guard.policy

    @policy.setter
    def policy(self, policy: SpeculationPolicy) -> None:
        self.guard.policy = policy

    @property
    def costs(self) -> Any:
        """The step-cost model cost-aware policies plan with: learnt from this engine's steps (OnlineCostModel)."""
        return self.stats.costs

    @costs.setter
    def costs(self, costs: Any) -> None:
        self.stats.costs = costs

    @property
    def step_log(self) -> deque[StepRecord]:
        return self.stats.step_log

    @property
    def prefill_chunks(self) -> dict[str, int]:
        """Chunks of prefills over the step's budget (config.prefill_chunk) each model was fed, since the start."""
        return self.stats.prefill_chunks

    @property
    def health(self) -> dict[str, WorkerHealth]:
        return self.guard.health

    @property
    def recovery_hooks(self) -> list[Callable[[str], None]]:
        """Called with the role when a failed party is back."""
        return self.guard.recovery_hooks

    @property
    def recovering(self) -> bool:
        """A worker or the policy is down: step() probes it even with no request (AsyncEngine does, when idle)."""
        return self.guard.recovering

    @property
    def requests(self) -> dict[str, Request]:
        return self.scheduler.requests

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def free_slots(self) -> list[int]:
        return self.scheduler.free_slots

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
