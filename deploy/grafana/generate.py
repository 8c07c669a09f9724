"""Writes the Grafana dashboards of DSDE Serve (classic dashboard JSON, schemaVersion 42) from the panel lists below:
deploy/grafana/dashboards/*.json and the copies the Helm chart ships (helm/dsde/dashboards/). Run it after editing:

    .venv/bin/python deploy/grafana/generate.py          # rewrite the JSON files
    .venv/bin/python deploy/grafana/generate.py --check  # exit 1 if a file differs from what this writes

Every query is PromQL against the series of the metrics table in docs/operations.md (`ray_dsde_*`) and Ray Serve's own
(`ray_serve_*`); `$model` and `$application` are the dashboards' variables, `$__rate_interval` and `$__range` are
Grafana's. tests/test_ops_prometheus.py evaluates every one of them on a real Prometheus that scraped a real run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT_DIRS = [ROOT / "deploy" / "grafana" / "dashboards", ROOT / "helm" / "dsde" / "dashboards"]
SCHEMA_VERSION = 42  # the last classic (v1 API) schema version; newer Grafana migrates it on load
DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model=~"$model"'
APP = 'application=~"$application"'
RI = "$__rate_interval"
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
TOK_S = "suffix: tok/s"


def _rate(metric: str, by: str = "", sel: str = M, window: str = RI) -> str:
    return f"sum{f' by ({by})' if by else ''} (rate({metric}{{{sel}}}[{window}]))"


def _zero_by_worker(sel: str = M) -> str:
    """`or` 0 for each worker the ingress reports: a counter exported from its first event on reads 0 before it."""
    return f"\n  or 0 * min by (worker) (ray_dsde_worker_up{{{sel}}})"


def _ratio(num: str, den: str, by: str = "", sel: str = M) -> str:
    return f"{_rate(num, by, sel)}\n  / {_rate(den, by, sel)}"


def _quantiles(hist: str, sel: str = M) -> list[dict[str, Any]]:
    return [target(f"histogram_quantile({q}, {_rate(f'{hist}_bucket', 'le', sel)})", name) for name, q in QUANTILES]


def target(expr: str, legend: str = "__auto", instant: bool = False, fmt: str = "time_series") -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend, "instant": instant, "range": not instant, "format": fmt}


def timeseries(title: str, desc: str, unit: str, targets: list[dict[str, Any]], w: int = 12, h: int = 8,
               **defaults: Any) -> dict[str, Any]:
    return {"type": "timeseries", "title": title, "description": desc, "targets": targets, "w": w, "h": h,
            "fieldConfig": {"defaults": {"unit": unit, **defaults,
                                         "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                                    "showPoints": "never", "spanNulls": False}},
                            "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title: str, desc: str, unit: str, expr: str, w: int = 4, h: int = 4, legend: str | None = None,
         **defaults: Any) -> dict[str, Any]:
    return {"type": "stat", "title": title, "description": desc, "targets": [target(expr, legend or title)],
            "w": w, "h": h,
            "fieldConfig": {"defaults": {"unit": unit, **defaults}, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "justifyMode": "auto", "textMode": "auto",
                        "orientation": "auto"}}


def heatmap(title: str, desc: str, y_unit: str, hist: str, w: int = 8, h: int = 8) -> dict[str, Any]:
    expr = f"sum by (le) (increase({hist}_bucket{{{M}}}[{RI}]))"
    return {"type": "heatmap", "title": title, "description": desc, "w": w, "h": h,
            "targets": [target(expr, "{{le}}", fmt="heatmap")],
            "fieldConfig": {"defaults": {"unit": "short", "custom": {"scaleDistribution": {"type": "linear"}}},
                            "overrides": []},
            "options": {"calculate": False, "cellGap": 1, "yAxis": {"axisPlacement": "left", "unit": y_unit},
                        "rowsFrame": {"layout": "auto"}, "legend": {"show": True},
                        "color": {"mode": "scheme", "scheme": "Oranges", "fill": "dark-orange", "scale": "exponential",
                                  "exponent": 0.5, "steps": 64, "reverse": False},
                        "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": False},
                        "filterValues": {"le": 1e-9}, "exemplars": {"color": "rgba(255,0,255,0.7)"}}}


def bargauge(title: str, desc: str, unit: str, expr: str, legend: str, w: int = 12, h: int = 8,
             **defaults: Any) -> dict[str, Any]:
    return {"type": "bargauge", "title": title, "description": desc, "w": w, "h": h,
            "targets": [target(expr, legend, instant=True)],
            "fieldConfig": {"defaults": {"unit": unit, **defaults}, "overrides": []},
            "options": {"orientation": "vertical", "displayMode": "gradient", "showUnfilled": True,
                        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "valueMode": "color", "namePlacement": "auto", "sizing": "auto"}}


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "w": 24, "h": 1}


PCT = {"min": 0, "max": 1, "decimals": 1}

SPECULATIVE_DECODING: list[dict[str, Any]] = [
    row("Overview"),
    stat("Acceptance rate", "Draft tokens accepted / draft tokens proposed, all selected models.", "percentunit",
         _ratio("ray_dsde_spec_decode_num_accepted_tokens_total", "ray_dsde_spec_decode_num_draft_tokens_total"),
         **PCT),
    stat("Mean acceptance length", "Tokens per drafting sequence-step: 1 + accepted / drafts (vLLM's definition).",
         "suffix: tokens", "1 + " + _ratio("ray_dsde_spec_decode_num_accepted_tokens_total",
                                          "ray_dsde_spec_decode_num_drafts_total"), decimals=2),
    stat("Speedup estimate", "Effective speedup estimate: output tokens per target forward of a sequence "
         "(target-only decoding: 1x). Ignores the draft's cost.", "suffix:x",
         _ratio("ray_dsde_generation_tokens_total", "ray_dsde_sl_chosen_count"), decimals=2),
    stat("Speculation on", "Share of sequence-steps planned with k > 0 (the rest ran target-only).", "percentunit",
         _ratio("ray_dsde_speculation_enabled_total", "ray_dsde_sl_chosen_count"), **PCT),
    stat("Mean SL", "Mean speculation length planned per sequence-step (k = 0 included).", "suffix: tokens",
         _ratio("ray_dsde_sl_chosen_sum", "ray_dsde_sl_chosen_count"), decimals=2),
    stat("SL cap", "DSDE's batch SL cap at the last step (0: no sequence was capped). Gauges are exported while "
         "the engine steps and age out when it is idle.", "none", f"max(ray_dsde_sl_cap{{{M}}})"),
    row("Acceptance"),
    timeseries("Acceptance rate by model", "Draft tokens accepted / proposed, per model.", "percentunit",
               [target(_ratio("ray_dsde_spec_decode_num_accepted_tokens_total",
                              "ray_dsde_spec_decode_num_draft_tokens_total", "model"), "{{model}}")], **PCT),
    timeseries("Mean acceptance length by model",
               "1 + accepted / drafts: tokens per drafting sequence-step, per model.", "suffix: tokens",
               [target("1 + " + _ratio("ray_dsde_spec_decode_num_accepted_tokens_total",
                                       "ray_dsde_spec_decode_num_drafts_total", "model"), "{{model}}")], min=1),
    timeseries("Accepted and drafted tokens/s", "Draft tokens proposed and accepted per second.", TOK_S,
               [target(_rate("ray_dsde_spec_decode_num_draft_tokens_total", "model"), "drafted {{model}}"),
                target(_rate("ray_dsde_spec_decode_num_accepted_tokens_total", "model"), "accepted {{model}}")],
               min=0),
    timeseries("Acceptance by draft position", "Of the drafts that reached position j (0-based), the share "
               "accepted there. Acceptance comes in runs: a rejection ends the draft.", "percentunit",
               [target(_ratio("ray_dsde_spec_decode_num_accepted_tokens_per_pos_total",
                              "ray_dsde_spec_decode_num_draft_tokens_per_pos_total", "position"),
                       "position {{position}}")], **PCT),
    bargauge("Acceptance by draft position (time range)", "The same over the whole time range shown.", "percentunit",
             f"sum by (position) (increase(ray_dsde_spec_decode_num_accepted_tokens_per_pos_total{{{M}}}[$__range]))"
             f"\n  / sum by (position) (increase(ray_dsde_spec_decode_num_draft_tokens_per_pos_total{{{M}}}"
             "[$__range]))", "{{position}}", w=24, **PCT),
    row("Speculation length"),
    timeseries("SL cap over time", "DSDE's batch SL cap at each step (0: no sequence capped), per model.", "none",
               [target(f"max by (model) (ray_dsde_sl_cap{{{M}}})", "{{model}}")], min=0, decimals=0),
    timeseries("Speculation length (k planned)", "Percentiles and mean of the k planned per sequence-step.",
               "suffix: tokens",
               [*_quantiles("ray_dsde_sl_chosen"),
                target(_ratio("ray_dsde_sl_chosen_sum", "ray_dsde_sl_chosen_count"), "mean")], min=0),
    heatmap("SL distribution", "k planned per sequence-step (buckets of one).", "none", "ray_dsde_sl_chosen"),
    heatmap("KLD distribution", "KL(target || draft) per proposed position (sparse, at the signal temperature).",
            "none", "ray_dsde_kld"),
    heatmap("WVIR distribution", "DSDE's weighted variance intensity ratio per sequence-step (after warm-up).",
            "none", "ray_dsde_wvir"),
    timeseries("Speculation on / off", "Sequence-steps per second planned with k > 0 and with k = 0 "
               "(target-only: per-request `speculation.enabled: false`, or the policy's choice).",
               "suffix: steps/s",
               [target(_rate("ray_dsde_speculation_enabled_total"), "k > 0"),
                target(_rate("ray_dsde_speculation_disabled_total"), "k = 0 (target only)")], min=0),
    row("Speedup"),
    timeseries("Effective speedup estimate", "Output tokens per target forward of a sequence, per model "
               "(target-only decoding: 1x); the draft's cost is not counted.", "suffix:x",
               [target(_ratio("ray_dsde_generation_tokens_total", "ray_dsde_sl_chosen_count", "model"),
                       "{{model}}")], w=12, min=1),
    timeseries("Step-cost model", "The engine's online fit of a step's cost at the current batch size and longest "
               "context, what dsde-goodput plans with: verify = target forward with no draft tokens (+ per draft "
               "token), draft = one batched draft forward (+ per draft token; + per context token of a first draft "
               "step's prefill).", "s",
               [target(f"max by (model) (ray_dsde_cost_verify_seconds{{{M}}})", "verify {{model}}"),
                target(f"max by (model) (ray_dsde_cost_draft_forward_seconds{{{M}}})", "draft forward {{model}}"),
                target(f"max by (model) (ray_dsde_cost_verify_per_token_seconds{{{M}}})",
                       "verify per token {{model}}"),
                target(f"max by (model) (ray_dsde_cost_draft_per_token_seconds{{{M}}})",
                       "draft per token {{model}}"),
                target(f"max by (model) (ray_dsde_cost_draft_context_per_token_seconds{{{M}}})",
                       "draft per context token {{model}}")], w=12, min=0),
]

SERVING: list[dict[str, Any]] = [
    row("Load"),
    stat("Requests running", "Requests in the running batch (gauges are exported while the engine steps).",
         "short", f"sum(ray_dsde_num_requests_running{{{M}}})"),
    stat("Requests waiting", "Requests waiting for a KV slot.", "short", f"sum(ray_dsde_num_requests_waiting{{{M}}})"),
    stat("KV slots held", "KV-cache slots held (of max_batch_size per replica).", "short",
         f"sum(ray_dsde_kv_slots_in_use{{{M}}})"),
    stat("Requests/s", "Requests finished per second, every reason.", "reqps",
         _rate("ray_dsde_requests_finished_total")),
    stat("Generation tokens/s", "Tokens generated per second.", TOK_S, _rate("ray_dsde_generation_tokens_total")),
    stat("TTFT p90", "Time to first token, 90th percentile.", "s",
         f"histogram_quantile(0.9, {_rate('ray_dsde_time_to_first_token_seconds_bucket', 'le')})"),
    timeseries("Requests running and waiting", "Running batch and queue, per model.", "short",
               [target(f"sum by (model) (ray_dsde_num_requests_running{{{M}}})", "running {{model}}"),
                target(f"sum by (model) (ray_dsde_num_requests_waiting{{{M}}})", "waiting {{model}}")], min=0),
    timeseries("KV slots in use", "KV-cache slots held, per model.", "short",
               [target(f"sum by (model) (ray_dsde_kv_slots_in_use{{{M}}})", "{{model}}")], min=0),
    row("Latency"),
    timeseries("Time to first token", "Arrival to first token.", "s",
               _quantiles("ray_dsde_time_to_first_token_seconds"), w=12, min=0),
    timeseries("Inter-token latency", "Gap between successive emissions of a request (one per engine step that "
               "gave it tokens).", "s", _quantiles("ray_dsde_inter_token_latency_seconds"), w=12, min=0),
    timeseries("End-to-end latency", "Arrival to last token.", "s",
               _quantiles("ray_dsde_e2e_request_latency_seconds"), w=12, min=0),
    timeseries("Time per output token", "Per request: (last - first token) / (tokens - 1).", "s",
               _quantiles("ray_dsde_time_per_output_token_seconds"), w=12, min=0),
    row("Throughput and errors"),
    timeseries("Prompt and generation tokens/s", "Prompt tokens of admitted requests and generated tokens.", TOK_S,
               [target(_rate("ray_dsde_prompt_tokens_total", "model"), "prompt {{model}}"),
                target(_rate("ray_dsde_generation_tokens_total", "model"), "generation {{model}}")], w=6, min=0),
    timeseries("Prefill chunks/s", "Chunks of prompts over a step's prefill budget (prefill_chunk) fed to each "
               "model: a long prompt's TTFT is spread over these steps so the running requests keep decoding "
               "(docs/policies.md, Chunked prefill); 0 before a first chunk.", "short",
               [target(_rate("ray_dsde_prefill_chunks_total", "worker")
                       + _zero_by_worker(f'{M}, worker=~"target|draft"'), "{{worker}}")], w=6, min=0),
    timeseries("Requests finished by reason", "stop, length, cancelled (client gone), error.", "reqps",
               [target(_rate("ray_dsde_requests_finished_total", "finished_reason"), "{{finished_reason}}")],
               w=6, min=0),
    timeseries("Errors by status", "HTTP error responses per second, by status code (4xx: the request; 5xx: the "
               "service).", "reqps",
               [target(_rate("ray_dsde_request_errors_total", "status_code"), "{{status_code}}")], w=6, min=0),
    row("Ray Serve"),
    stat("Workers up", "Whether the ingress reaches each of its actors (1 up, 0 down: the engine falls back to "
         "target-only decoding without the draft and waits for a restarted target; docs/failures.md).",
         "none", f"min by (worker) (ray_dsde_worker_up{{{M}}})", w=4, legend="{{worker}}"),
    stat("Worker failures", "Times the engine lost each actor or it raised an error, over the dashboard's range "
         "(a down time shorter than a scrape shows here, not in Workers up; docs/failures.md).", "short",
         f"sum by (worker) (increase(ray_dsde_worker_failures_total{{{M}}}[$__range]))" + _zero_by_worker(), w=4,
         legend="{{worker}}"),
    stat("Healthy replicas", "Replicas passing Serve's health check, per deployment.", "short",
         f"sum by (application, deployment) (ray_serve_deployment_replica_healthy{{{APP}}})", w=4,
         legend="{{deployment}}"),
    stat("Deployment status", "Serve's deployment status (6 HEALTHY, 3 UPDATING, 4/5 scaling, 2 UNHEALTHY, "
         "1 DEPLOY_FAILED).", "none",
         f"max by (application, deployment) (ray_serve_deployment_status{{{APP}}})", w=4,
         legend="{{deployment}}"),
    stat("Replica starts", "Replicas started per deployment since the cluster started (restarts included).",
         "short", f"sum by (application, deployment) (ray_serve_deployment_replica_starts_total{{{APP}}})", w=4,
         legend="{{deployment}}"),
    stat("Ongoing requests", "Requests in flight at the replicas, as Serve's routers see them.", "short",
         f"sum by (application, deployment) (ray_serve_num_ongoing_requests_at_replicas{{{APP}}})", w=4,
         legend="{{deployment}}"),
    timeseries("HTTP requests/s by route and status", "Requests through Serve's HTTP proxy.", "reqps",
               [target(_rate("ray_serve_num_http_requests_total", "route, status_code", APP),
                       "{{route}} {{status_code}}")], min=0),
    timeseries("Replica requests/s", "Requests handled by each deployment's replicas.", "reqps",
               [target(_rate("ray_serve_deployment_request_counter_total", "deployment", APP), "{{deployment}}")],
               min=0),
    timeseries("Serve HTTP latency", "Serve proxy's request latency (a stream counts until its last byte).", "ms",
               _quantiles("ray_serve_http_request_latency_ms", APP), min=0),
    timeseries("Replica processing latency", "Time in the replica per request.", "ms",
               _quantiles("ray_serve_deployment_processing_latency_ms", APP), min=0),
]

STATUS_MAPPINGS = [{"type": "value", "options": {str(v): {"text": t, "index": i} for i, (v, t) in enumerate(
    [(0, "UNKNOWN"), (1, "DEPLOY_FAILED"), (2, "UNHEALTHY"), (3, "UPDATING"), (4, "UPSCALING"), (5, "DOWNSCALING"),
     (6, "HEALTHY")])}}]


def _layout(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Grid positions left to right, top to bottom (24 columns), ids 1..n, the datasource on every panel/target."""
    panels, x, y, row_h = [], 0, 0, 0
    for pid, spec in enumerate(specs, start=1):
        p = dict(spec)
        w, h = p.pop("w"), p.pop("h")
        if x + w > 24 or p["type"] == "row":
            x, y, row_h = 0, y + row_h, 0
        panel: dict[str, Any] = {"id": pid, "type": p.pop("type"), "title": p.pop("title"),
                                 "gridPos": {"h": h, "w": w, "x": x, "y": y}}
        if panel["type"] != "row":
            panel["datasource"] = DS
            panel["targets"] = [{"datasource": DS, "editorMode": "code", "refId": chr(ord("A") + i), **t}
                                for i, t in enumerate(p.pop("targets"))]
        panel.update(p)
        if panel["title"] == "Deployment status":
            panel["fieldConfig"]["defaults"]["mappings"] = STATUS_MAPPINGS
        panels.append(panel)
        x, row_h = x + w, max(row_h, h)
        if panel["type"] == "row":
            x, y, row_h = 0, y + h, 0
    return panels


def _variables(serve: bool) -> dict[str, Any]:
    def query_var(name: str, label: str, metric: str) -> dict[str, Any]:
        q = f"label_values({metric}, {name})"
        return {"name": name, "label": label, "type": "query", "datasource": DS, "definition": q,
                "query": {"qryType": 1, "query": q, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "sort": 1, "regex": "",
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "hide": 0}

    variables = [{"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
                  "regex": "", "refresh": 1, "hide": 0, "includeAll": False, "multi": False, "options": [],
                  "current": {}},
                 query_var("model", "Model", "ray_dsde_generation_tokens_total")]
    if serve:
        variables.append(query_var("application", "Serve application", "ray_serve_deployment_status"))
    return {"list": variables}


def dashboard(uid: str, title: str, description: str, specs: list[dict[str, Any]], serve: bool) -> dict[str, Any]:
    return {
        "id": None, "uid": uid, "title": title, "description": description,
        "tags": ["dsde", "ray-serve", "speculative-decoding"], "timezone": "browser", "editable": True,
        "graphTooltip": 1, "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
        "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "timepicker": {},
        "schemaVersion": SCHEMA_VERSION, "version": 1,
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": [{"type": "dashboards", "tags": ["dsde"], "asDropdown": False, "includeVars": True,
                   "keepTime": True, "title": "DSDE", "icon": "external link", "targetBlank": False,
                   "tooltip": "", "url": ""}],
        "templating": _variables(serve),
        "panels": _layout(specs),
    }


DASHBOARDS: dict[str, dict[str, Any]] = {
    "dsde-speculative-decoding.json": dashboard(
        "dsde-speculative-decoding", "DSDE / Speculative decoding",
        "DSDE Serve: acceptance, speculation lengths, the KLD/WVIR signal and the speedup estimate.",
        SPECULATIVE_DECODING, serve=False),
    "dsde-serving.json": dashboard(
        "dsde-serving", "DSDE / Serving",
        "DSDE Serve: load, latency percentiles, throughput, errors and Ray Serve's replicas.", SERVING, serve=True),
}


def render(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = ap.parse_args(argv)
    stale = []
    for out in OUT_DIRS:
        for name, board in DASHBOARDS.items():
            path, text = out / name, render(board)
            if args.check:
                if not path.exists() or path.read_text() != text:
                    stale.append(str(path.relative_to(ROOT)))
            else:
                out.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if stale:
        print("out of date (run deploy/grafana/generate.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
