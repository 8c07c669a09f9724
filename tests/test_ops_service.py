"""The operations tooling against a real run of the service: one Ray cluster started as the README deploys one
(`ray start --head`, `serve deploy` of deploy/config.yaml with a tiny Qwen2 pair and the real tokenizer), a real
Prometheus server (Debian's package, installed by `make setup`) scraping it through Ray's service-discovery file
with deploy/prometheus/prometheus.yml and its recording rules, and Locust driving it.

- Locust: load_tests/locustfile.py headless, a few users for ~25 s on localhost (chat, completions and the Responses
  API); no request may fail, and the CSV carries TTFT / ITL / TPOT / E2E beside the endpoint entries.
- Prometheus: after real requests (streamed and not, chat and completions, speculation on and off, errors), every
  PromQL expression of every panel of both Grafana dashboards, every recording rule and every template variable
  must parse and return finite data, and no alerting rule fires; every scrape target of the service-discovery file
  is up.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.ops_support import (
    GRAFANA_DIR,
    PROMETHEUS_DIR,
    ROOT,
    TINY_MODEL,
    Prometheus,
    PromQLError,
    RayHead,
    finite_values,
    locust_command,
    prometheus_server,
    prometheus_test_config,
    ray_head,
    read_csv,
    serve_deploy,
    tiny_serve_config,
)
from tests.service_support import free_port, http_get, http_post, make_tiny_pair, wait_for

SCRAPE = 2  # seconds: scrape and rule interval of the test's Prometheus
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval at a 2 s scrape: max($__interval + scrape, 4 * scrape), rounded up
APPLICATION = "dsde"  # deploy/config.yaml's application name


@dataclass
class Live:
    head: RayHead
    base: str  # http://127.0.0.1:PORT of the service
    prom: Prometheus


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("tiny-models-ops"))
    with ray_head() as head:
        base = serve_deploy(head, tiny_serve_config(free_port(), target, draft))

        def sd_targets() -> list[str]:
            groups = json.loads(head.sd_file.read_text())
            return [t for g in groups for t in g["targets"]]

        wait_for(lambda: f"127.0.0.1:{head.metrics_port}" in sd_targets(), 60, what="Ray's service-discovery file")
        assert all(t.startswith("127.0.0.1:") for t in sd_targets()), sd_targets()  # loopback only
        config = prometheus_test_config(head.sd_file, f"{SCRAPE}s")
        with prometheus_server(config, tmp_path_factory.mktemp("prometheus")) as prom:
            yield Live(head, base, prom)


# ---- Locust -------------------------------------------------------------------------------------------------
def test_locust_headless_run_streams_without_errors(live: Live, tmp_path: Path) -> None:
    prefix = tmp_path / "locust"
    cmd = locust_command(live.base, prefix, "--users", "3", "--spawn-rate", "3", "--run-time", "25s",
                         "--stop-timeout", "60", "--short-tokens", "16", "--long-tokens", "64", "--long-fraction",
                         "0.3", "--prompts-per-workload", "4", "--max-prompt-chars", "600", "--responses-fraction",
                         "0.34")
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    elapsed = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert elapsed < 120, f"locust ran {elapsed:.0f}s"

    stats = {(r["Type"], r["Name"]): r for r in read_csv(Path(f"{prefix}_stats.csv"))}
    failures = read_csv(Path(f"{prefix}_failures.csv"))
    assert failures == [], failures
    assert int(stats[("", "Aggregated")]["Failure Count"]) == 0, stats[("", "Aggregated")]
    streamed = [r for (kind, name), r in stats.items() if kind == "POST" and name.endswith("(stream)")]
    assert sum(int(r["Request Count"]) for r in streamed) >= 5, stats.keys()
    assert {r["Name"] for r in streamed} == {"/v1/chat/completions (stream)", "/v1/completions (stream)",
                                             "/v1/responses (stream)"}
    requests = sum(int(r["Request Count"]) for r in streamed)
    for name in ("TTFT", "ITL", "TPOT", "E2E"):
        row = stats[("LLM", name)]
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row
        assert float(row["Average Response Time"]) > 0, row
    assert int(stats[("LLM", "E2E")]["Request Count"]) == requests  # one E2E per streamed request
    assert int(stats[("LLM", "ITL")]["Request Count"]) > requests  # several gaps per request
    # TTFT comes before the end of its request; medians are in milliseconds
    assert float(stats[("LLM", "TTFT")]["Median Response Time"]) <= float(stats[("LLM", "E2E")]["Median Response Time"])


# ---- Prometheus and the dashboards ------------------------------------------------------------------------------
def _traffic(base: str) -> int:
    """Real requests of every kind the panels show; returns how many finished (errors excluded)."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)
    prompts = ["def fibonacci(n):", "Write a haiku about the sea.", "import numpy as np\n", "SELECT * FROM",
               "class Stack:", "Explain TCP slow start.", "Once upon a time"]

    def chat(prompt: str) -> None:
        stream = client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=64, temperature=0, stream=True)
        assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in stream)

    def completion(prompt: str) -> None:
        res = client.completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=64, temperature=0)
        assert res.choices[0].finish_reason in ("stop", "length")

    def target_only(prompt: str) -> None:
        res = client.completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                        extra_body={"speculation": {"enabled": False}})
        assert res.model_extra["speculation"]["drafted"] == 0

    jobs = [(chat, p) for p in prompts[:4]] + [(completion, p) for p in prompts[4:]] + [(target_only, prompts[0])]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # more than the 4 KV slots: some wait
        for _ in range(2):  # two waves: the step-level gauges are exported over several reports
            for fut in [pool.submit(fn, p) for fn, p in jobs]:
                fut.result()
    assert http_post(f"{base}/v1/completions", {"model": TINY_MODEL, "prompt": "x", "n": 0})[0] == 400
    assert http_post(f"{base}/v1/completions", {"model": "no-such-model", "prompt": "x"})[0] == 404
    return 2 * len(jobs)


def _panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _substitute(expr: str, variables: dict[str, str]) -> str:
    out = expr
    for name in sorted(variables, key=len, reverse=True):  # $__rate_interval before $__range
        out = out.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    assert "$" not in out, f"unsubstituted variable in {out!r}"
    return out


def _finished(prom: Prometheus) -> float:
    result = prom.query(f'sum(ray_dsde_requests_finished_total{{model="{TINY_MODEL}"}})')
    return float(result[0]["value"][1]) if result else 0.0


def test_every_dashboard_query_and_recording_rule_returns_data(live: Live) -> None:
    prom = live.prom
    wait_for(lambda: prom.query(f'up{{job="ray", instance="127.0.0.1:{live.head.metrics_port}"}} == 1'), 60,
             what="Prometheus to scrape the node's metrics port")
    before = _finished(prom)
    start = time.time()
    sent = _traffic(live.base)
    # every finished request and every histogram observation has reached Prometheus (Ray reports every 2 s)
    wait_for(lambda: _finished(prom) >= before + sent, 60, interval=1, what="the requests in Prometheus")
    time.sleep(3 * SCRAPE)  # one more report and scrape for the step-level series, two rule evaluations
    end = time.time()
    start = min(start, end - 60)  # a window with the traffic, at least a minute (rules use 1m windows)

    # the scrape targets of Ray's service-discovery file are up
    active = prom.api("targets")["activeTargets"]
    assert active and all(t["health"] == "up" for t in active), [(t["scrapeUrl"], t["lastError"]) for t in active]
    assert {t["labels"]["job"] for t in active} == {"ray"}

    # template variables: label_values(metric, label) as Grafana's Prometheus data source runs it
    variables = {"model": TINY_MODEL, "application": APPLICATION, "__rate_interval": RATE_INTERVAL,
                 "__interval": f"{SCRAPE}s", "__range": f"{int(end - start)}s"}
    boards = {p.name: json.loads(p.read_text()) for p in sorted((GRAFANA_DIR / "dashboards").glob("*.json"))}
    assert len(boards) == 2, boards.keys()
    for board in boards.values():
        for var in board["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["query"]["query"])
            assert m, var["query"]
            values = prom.api(f"label/{m.group(2)}/values", **{"match[]": m.group(1)})
            assert variables[var["name"]] in values, (var["name"], values)

    # every target of every panel: (where, expr with Grafana's variables in it, instant?)
    queries = [(f"{file} #{panel['id']} {panel['title']!r} {t['refId']}", t["expr"], bool(t.get("instant")))
               for file, board in boards.items() for panel in _panels(board) for t in panel.get("targets", [])]
    assert len(queries) >= 40, len(queries)

    # recording and alerting rules: loaded from the file, healthy; a healthy run raises no alert
    groups = prom.api("rules")["groups"]
    rule_files = {g["file"] for g in groups}
    assert rule_files == {str(PROMETHEUS_DIR / "rules" / "dsde.rules.yml")}, rule_files
    records = yaml.safe_load((PROMETHEUS_DIR / "rules" / "dsde.rules.yml").read_text())
    expected = {r["record"] for g in records["groups"] for r in g["rules"] if "record" in r}
    loaded = {r["name"] for g in groups for r in g["rules"] if r["type"] == "recording"}
    assert loaded == expected
    alerts = {r["name"]: r["state"] for g in groups for r in g["rules"] if r["type"] == "alerting"}
    assert alerts == {r["alert"]: "inactive" for g in records["groups"] for r in g["rules"] if "alert" in r}, alerts
    unhealthy = [(r["name"], r["health"], r.get("lastError")) for g in groups for r in g["rules"]
                 if r["health"] != "ok"]
    assert not unhealthy, unhealthy
    queries += [(f"recording rule {name}", name, False) for name in sorted(expected)]

    def evaluate(pending: list[tuple[str, str, bool]], end: float) -> dict[str, str]:
        """where -> problem; a query that does not parse is an error at once, one without data may be retried."""
        found: dict[str, str] = {}
        for where, raw, instant in pending:
            expr = _substitute(raw, {**variables, "__range": f"{int(end - start)}s"})
            try:
                result = prom.query(expr, at=end) if instant else prom.query_range(expr, start, end, SCRAPE)
            except PromQLError as e:
                pytest.fail(f"{where}: {expr}: {e}")
            if not finite_values(result):
                found[where] = f"{where}: {expr}: no finite data ({len(result)} series)"
        return found

    # the last reports of the run may still be on their way: retry what has no data yet, for a while (the window
    # only grows, so data once there stays)
    deadline = time.monotonic() + 30
    problems = evaluate(queries, end)
    while problems and time.monotonic() < deadline:
        time.sleep(SCRAPE)
        problems = evaluate([q for q in queries if q[0] in problems], time.time())
    assert not problems, "\n".join(problems.values())
    end = time.time()

    # the derived series mean what they say
    def last(expr: str) -> float:
        values = finite_values(prom.query_range(expr, start, end, SCRAPE))
        assert values, expr
        return values[-1]

    assert 0 <= last(f'model:dsde_spec_decode_acceptance_rate:rate1m{{model="{TINY_MODEL}"}}') <= 1
    assert 1 <= last(f'model:dsde_spec_decode_mean_acceptance_length:rate1m{{model="{TINY_MODEL}"}}') <= 21
    assert 1 <= last(f'model:dsde_tokens_per_target_forward:rate1m{{model="{TINY_MODEL}"}}') <= 21
    ttft = last(f'model:dsde_time_to_first_token_seconds:quantile_rate1m{{model="{TINY_MODEL}", quantile="0.5"}}')
    e2e = last(f'model:dsde_e2e_request_latency_seconds:quantile_rate1m{{model="{TINY_MODEL}", quantile="0.99"}}')
    assert 0 < ttft <= e2e
    healthy = prom.query_range(f'sum(ray_serve_deployment_replica_healthy{{application="{APPLICATION}"}})',
                               start, end, SCRAPE)
    assert max(finite_values(healthy)) == 1  # num_replicas: 1 in deploy/config.yaml
    code, _ = http_get(f"{live.base}/health")
    assert code == 200
