"""Prometheus metrics through Ray's metrics export (ray.util.metrics; Ray adds the prefix `ray_`, and `_total`
to counters). Names follow vLLM's where one exists, so existing queries carry over with `vllm:` -> `ray_dsde_`.

Recorded in the ingress, where the engine lives, from what the engine already produces: each request's outputs
and final RequestStats (ServiceMetrics.on_output / on_finish), and each step's plans and feedback as they pass
through the policy interface (ObservedPolicy wraps the policy the engine talks to). dsde_core records nothing.
Every metric is tagged with the served model name; the per-replica load signals that autoscaling is judged by also
with the replica (Serve's replica id, as Serve's own `replica` tag): several replicas on one node would otherwise
export one series. docs/operations.md's metrics table lists them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.util import metrics as rm

from dsde_core.cost import StepCosts
from dsde_core.policies import Plan, SeqInfo, SpeculationPolicy, StepFeedback
from dsde_core.request import RequestOutput, RequestStats

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0]
SL_BUCKETS = [i + 0.5 for i in range(20)] + [32.5, 64.5]  # k = 0, 1, ..., 20 each in its own bucket
KLD_BUCKETS = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0]
WVIR_BUCKETS = [0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0]

# (name as registered, kind, description, extra tag keys, histogram boundaries)
METRICS: list[tuple[str, str, str, tuple[str, ...], list[float] | None]] = [
    ("dsde_num_requests_running", "gauge", "Requests in the engine's running batch", (), None),
    ("dsde_num_requests_waiting", "gauge", "Requests waiting for a KV slot", (), None),
    ("dsde_kv_slots_in_use", "gauge", "KV-cache slots held by running requests", (), None),
    ("dsde_kv_cache_usage_perc", "gauge", "Share of this replica's KV-cache slots in use (0-1; 1: every one of "
     "max_batch_size held)", ("replica",), None),
    ("dsde_replica_num_requests_waiting", "gauge", "Requests waiting for a KV slot in this replica", ("replica",),
     None),
    ("dsde_sl_cap", "gauge", "DSDE's batch SL cap at the last step (0 when no sequence was capped)", (), None),
    ("dsde_worker_up", "gauge", "1 while the engine reaches the worker (draft, target, policy), 0 while it is down",
     ("worker",), None),
    ("dsde_worker_failures", "counter", "Times the engine lost a worker (draft, target, policy) or the worker raised "
     "an error; exported from the first one on", ("worker",), None),
    ("dsde_prefill_chunks", "counter", "Chunks of prompts over a step's prefill budget (prefill_chunk) fed to a model "
     "(target, draft); exported from the first one on", ("worker",), None),
    ("dsde_cost_verify_seconds", "gauge", "Step-cost model: target verification of the batch with no draft tokens",
     (), None),
    ("dsde_cost_verify_per_token_seconds", "gauge", "Step-cost model: added per draft token verified", (), None),
    ("dsde_cost_draft_forward_seconds", "gauge", "Step-cost model: one batched draft forward", (), None),
    ("dsde_cost_draft_per_token_seconds", "gauge", "Step-cost model: added per draft token proposed", (), None),
    ("dsde_cost_draft_context_per_token_seconds", "gauge",
     "Step-cost model: added per context token the draft takes in (a first draft step's prefill)", (), None),
    ("dsde_prompt_tokens", "counter", "Prompt tokens of admitted engine requests: each of a request's n choices "
     "prefills its prompt (a response's usage counts the prompt once)", (), None),
    ("dsde_generation_tokens", "counter", "Tokens generated", (), None),
    ("dsde_spec_decode_num_drafts", "counter", "Sequence-steps that proposed at least one draft token", (), None),
    ("dsde_spec_decode_num_draft_tokens", "counter", "Draft tokens proposed", (), None),
    ("dsde_spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted", (), None),
    ("dsde_spec_decode_num_draft_tokens_per_pos", "counter", "Draft tokens proposed at each draft position",
     ("position",), None),
    ("dsde_spec_decode_num_accepted_tokens_per_pos", "counter", "Draft tokens accepted at each draft position",
     ("position",), None),
    ("dsde_speculation_enabled", "counter", "Sequence-steps planned with k > 0", (), None),
    ("dsde_speculation_disabled", "counter", "Sequence-steps planned with k = 0 (target-only step)", (), None),
    ("dsde_requests_finished", "counter", "Engine requests (one per choice) ended, by reason (stop, length, cancelled, "
     "error)",
     ("finished_reason",), None),
    ("dsde_request_errors", "counter", "HTTP error responses, by status code", ("status_code",), None),
    ("dsde_time_to_first_token_seconds", "histogram", "Arrival to first token", (), LATENCY_BUCKETS),
    ("dsde_inter_token_latency_seconds", "histogram",
     "Time between successive emissions of a request (one per engine step that gave it tokens)", (),
     LATENCY_BUCKETS),
    ("dsde_time_per_output_token_seconds", "histogram", "Per request: (last - first token time) / (tokens - 1)",
     (), LATENCY_BUCKETS),
    ("dsde_e2e_request_latency_seconds", "histogram", "Arrival to the last token", (), LATENCY_BUCKETS),
    ("dsde_sl_chosen", "histogram", "Speculation length planned per sequence and step", (), SL_BUCKETS),
    ("dsde_kld", "histogram", "KL(target || draft) per proposed position (sparse, signal temperature)", (),
     KLD_BUCKETS),
    ("dsde_wvir", "histogram", "DSDE's weighted variance intensity ratio per sequence and step", (), WVIR_BUCKETS),
]


def exported_name(name: str, kind: str) -> str:
    """The Prometheus series name Ray exports for a registered metric."""
    return f"ray_{name}_total" if kind == "counter" else f"ray_{name}"


class ServiceMetrics:
    """All of the service's metrics, created once per ingress replica; thread-safe to record from the engine
    thread and the event loop alike (ray.util.metrics records into the core worker)."""

    def __init__(self, model: str, replica: str = "", max_batch_size: int | None = None) -> None:
        self.tags = {"model": model}
        self.replica, self.max_batch_size = replica, max_batch_size  # the per-replica signals' tag and denominator
        self.m: dict[str, Any] = {}
        for name, kind, desc, extra, buckets in METRICS:
            keys = ("model", *extra)
            if kind == "gauge":
                self.m[name] = rm.Gauge(name, desc, tag_keys=keys)
            elif kind == "counter":
                self.m[name] = rm.Counter(name, desc, tag_keys=keys)
            else:
                self.m[name] = rm.Histogram(name, desc, boundaries=buckets, tag_keys=keys)
            self.m[name].set_default_tags(self.tags)
        self._gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # last value of each gauge series
        self._counted: dict[str, dict[str, int]] = {}  # per counter fed from the engine's totals: what it counted

    def _set(self, name: str, value: float, **tags: str) -> None:
        self._gauges[name, tuple(sorted(tags.items()))] = value
        self.m[name].set(value, tags=tags or None)

    def refresh(self) -> None:
        """Set every gauge to its last value again: Ray stops exporting a gauge series that nobody sets for a while,
        so an idle service would lose `requests running = 0`, the cap and the cost model (called on a timer)."""
        for (name, tags), value in list(self._gauges.items()):
            self.m[name].set(value, tags=dict(tags) or None)

    def _inc(self, name: str, value: float, **tags: str) -> None:
        if value > 0:
            self.m[name].inc(value, tags=tags or None)

    # ---- per request (event loop) -------------------------------------------------------------------
    def on_admit(self, prompt_tokens: int) -> None:
        self._inc("dsde_prompt_tokens", prompt_tokens)

    def on_output(self, out: RequestOutput) -> None:
        self._inc("dsde_generation_tokens", len(out.token_ids))

    def on_finish(self, reason: str, stats: RequestStats | None) -> None:
        self._inc("dsde_requests_finished", 1, finished_reason=reason or "unknown")
        if stats is None:
            return
        if stats.ttft is not None:
            self.m["dsde_time_to_first_token_seconds"].observe(stats.ttft)
        if stats.e2e is not None and stats.first_token is not None:
            self.m["dsde_e2e_request_latency_seconds"].observe(stats.e2e)
        if stats.itl is not None:
            self.m["dsde_time_per_output_token_seconds"].observe(stats.itl)
        emissions = sorted(set(stats.token_times))
        for a, b in zip(emissions, emissions[1:], strict=False):
            self.m["dsde_inter_token_latency_seconds"].observe(b - a)

    def on_error_status(self, status: int) -> None:
        self._inc("dsde_request_errors", 1, status_code=str(status))

    # ---- per step (engine thread) -------------------------------------------------------------------
    def on_load(self, running: int, waiting: int, slots_in_use: int) -> None:
        self._set("dsde_num_requests_running", running)
        self._set("dsde_num_requests_waiting", waiting)
        self._set("dsde_kv_slots_in_use", slots_in_use)
        self._set("dsde_replica_num_requests_waiting", waiting, replica=self.replica)
        if self.max_batch_size:
            self._set("dsde_kv_cache_usage_perc", slots_in_use / self.max_batch_size, replica=self.replica)

    def on_workers(self, up: dict[str, bool], failures: dict[str, int]) -> None:
        """Each worker's state and its failures so far (the engine's count: the counter grows by what is new; a down
        time shorter than a scrape interval shows in the counter, not in the gauge)."""
        for role, ok in up.items():
            self._set("dsde_worker_up", 1 if ok else 0, worker=role)
        self._count_up("dsde_worker_failures", failures)

    def on_prefill_chunks(self, chunks: dict[str, int]) -> None:
        """The chunks of prefills each model was fed so far (the engine's count)."""
        self._count_up("dsde_prefill_chunks", chunks)

    def _count_up(self, name: str, totals: dict[str, int]) -> None:
        """A counter by worker fed from the engine's running totals: it grows by what is new."""
        counted = self._counted.setdefault(name, {})
        for role, n in totals.items():
            if (new := n - counted.get(role, 0)) > 0:
                self._inc(name, new, worker=role)
                counted[role] = n

    def on_costs(self, costs: StepCosts) -> None:
        """The engine's online step-cost model at the current batch size and its longest row's context (what cost-aware
        policies plan with)."""
        self._set("dsde_cost_verify_seconds", costs.verify_s)
        self._set("dsde_cost_verify_per_token_seconds", costs.verify_per_token_s)
        self._set("dsde_cost_draft_forward_seconds", costs.draft_fwd_s)
        self._set("dsde_cost_draft_per_token_seconds", costs.draft_per_token_s)
        self._set("dsde_cost_draft_context_per_token_seconds", costs.draft_context(1))

    def on_plan(self, plans: Sequence[Plan]) -> None:
        sl = self.m["dsde_sl_chosen"]
        for p in plans:
            sl.observe(p.k)
        on = sum(p.k > 0 for p in plans)
        self._inc("dsde_speculation_enabled", on)
        self._inc("dsde_speculation_disabled", len(plans) - on)

    def on_feedback(self, feedback: Sequence[StepFeedback], telemetry: Any) -> None:
        drafted_at: list[int] = []
        accepted_at: list[int] = []
        kld = self.m["dsde_kld"]
        for fb in feedback:
            for v in fb.kld:
                kld.observe(v)
            if fb.proposed > len(drafted_at):
                grow = fb.proposed - len(drafted_at)
                drafted_at += [0] * grow
                accepted_at += [0] * grow
            for j in range(fb.proposed):
                drafted_at[j] += 1
                accepted_at[j] += j < fb.accepted
        self._inc("dsde_spec_decode_num_drafts", sum(fb.proposed > 0 for fb in feedback))
        self._inc("dsde_spec_decode_num_draft_tokens", sum(drafted_at))
        self._inc("dsde_spec_decode_num_accepted_tokens", sum(accepted_at))
        for j, (d, a) in enumerate(zip(drafted_at, accepted_at, strict=True)):
            self._inc("dsde_spec_decode_num_draft_tokens_per_pos", d, position=str(j))
            self._inc("dsde_spec_decode_num_accepted_tokens_per_pos", a, position=str(j))
        if telemetry is not None:
            self._set("dsde_sl_cap", telemetry.cap or 0)
            for w in telemetry.wvir:
                self.m["dsde_wvir"].observe(w)


_current: list[ServiceMetrics] = []


def set_current(metrics: ServiceMetrics) -> None:
    """Register this process's metrics (one ingress replica per process) for code that has no handle on the
    replica, such as FastAPI's exception handlers."""
    _current[:] = [metrics]


def current() -> ServiceMetrics | None:
    return _current[0] if _current else None


class ObservedPolicy(SpeculationPolicy):
    """Wraps the policy the engine talks to and records each step's plans and feedback; decides nothing.

    `load` gives (running, waiting, slots in use) for the gauges; it is read at every plan and release, i.e.
    whenever the engine's batch changes.
    """

    def __init__(self, inner: SpeculationPolicy, metrics: ServiceMetrics, load: Any = None) -> None:
        self.inner, self.metrics, self.load = inner, metrics, load
        self.name = inner.name

    def _record_load(self) -> None:
        if self.load is not None:
            self.metrics.on_load(*self.load())

    def plan(self, seqs: Sequence[SeqInfo], costs: StepCosts | None = None, waiting: int = 0) -> list[Plan]:
        plans = self.inner.plan(seqs, costs, waiting)
        self._record_load()
        if costs is not None:
            self.metrics.on_costs(costs)
        self.metrics.on_plan(plans)
        return plans

    def observe(self, feedback: Sequence[StepFeedback]) -> Any:
        telemetry = self.inner.observe(feedback)
        self.metrics.on_feedback(feedback, telemetry)
        return telemetry

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)
        self._record_load()

    def num_tracked(self) -> int:
        return self.inner.num_tracked()

    def available(self) -> bool:
        probe = getattr(self.inner, "available", None)
        return True if probe is None else bool(probe())

    def stats(self, req_id: str) -> dict[str, float]:
        return self.inner.stats(req_id)

    def cappable(self, req_id: str) -> bool:
        return self.inner.cappable(req_id)
