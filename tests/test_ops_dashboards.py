"""The Grafana dashboards' structure and the Prometheus files, checked without a running service (the queries
themselves run against a real Prometheus in tests/test_ops_service.py): the JSON is what deploy/grafana/generate.py
writes, panel ids are unique, every panel and query names the dashboard's Prometheus data-source variable, every panel
has a unit, the layout fits the grid, every variable a query uses is defined, every `ray_dsde_*` series a query or a
rule reads is one the service exports; promtool accepts the scrape config and the rules, and the rules' unit tests
pass."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.ops_support import GRAFANA_DIR, PROMETHEUS_DIR, ROOT, tool

DS_REF = {"type": "prometheus", "uid": "${datasource}"}
TITLES = {"dsde-speculative-decoding.json": "DSDE / Speculative decoding", "dsde-serving.json": "DSDE / Serving"}
PANEL_TYPES = {"row", "timeseries", "stat", "heatmap", "bargauge", "gauge", "table", "text", "barchart", "histogram",
               "state-timeline"}
UNITS = {"percentunit", "percent", "s", "ms", "short", "none", "reqps", "ops", "bytes", "decbytes"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range", "__range_s"}
REQUIRED = {  # the panels, by title
    "dsde-speculative-decoding.json": {
        "Acceptance rate", "Mean acceptance length", "Accepted and drafted tokens/s", "Acceptance by draft position",
        "SL cap over time", "SL distribution", "KLD distribution", "WVIR distribution", "Speculation on / off",
        "Effective speedup estimate"},
    "dsde-serving.json": {
        "Requests running and waiting", "Time to first token", "Inter-token latency", "End-to-end latency",
        "Prompt and generation tokens/s", "KV slots in use", "Errors by status", "Healthy replicas",
        "Deployment status", "HTTP requests/s by route and status", "Replica requests/s"},
}


def _boards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted((GRAFANA_DIR / "dashboards").glob("*.json"))}


def _panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


@pytest.fixture(scope="module")
def boards() -> dict[str, dict[str, Any]]:
    found = _boards()
    assert set(found) == set(TITLES), found.keys()
    return found


def test_dashboards_are_what_the_generator_writes_here_and_in_the_chart() -> None:
    res = subprocess.run([sys.executable, str(GRAFANA_DIR / "generate.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    for name in TITLES:
        chart_copy = ROOT / "helm" / "dsde" / "dashboards" / name
        assert chart_copy.read_text() == (GRAFANA_DIR / "dashboards" / name).read_text()


def test_dashboard_metadata_and_variables(boards: dict[str, dict[str, Any]]) -> None:
    uids = [b["uid"] for b in boards.values()]
    assert len(set(uids)) == len(uids) and all(0 < len(u) <= 40 for u in uids)
    for name, board in boards.items():
        assert board["title"] == TITLES[name]
        assert board["id"] is None  # importable: Grafana assigns the id
        assert board["schemaVersion"] >= 41 and isinstance(board["version"], int)
        assert board["time"]["from"].startswith("now-") and board["refresh"]
        variables = {v["name"]: v for v in board["templating"]["list"]}
        ds = variables["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus"
        model = variables["model"]
        assert model["type"] == "query" and model["datasource"] == DS_REF
        assert model["query"]["query"] == model["definition"] == "label_values(ray_dsde_generation_tokens_total, model)"
        assert model["includeAll"] and model["multi"] and model["allValue"] == ".*"
        for var in variables.values():
            if var["type"] == "query":
                assert var["datasource"] == DS_REF, var["name"]
                assert re.fullmatch(r"label_values\(\w+, \w+\)", var["query"]["query"]), var["query"]


def test_panels_have_unique_ids_datasources_units_and_fit_the_grid(boards: dict[str, dict[str, Any]]) -> None:
    for name, board in boards.items():
        panels = list(_panels(board))
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids), (name, ids)
        titles = [p["title"] for p in panels if p["type"] != "row"]
        assert len(titles) == len(set(titles)), name
        assert REQUIRED[name] <= set(titles), REQUIRED[name] - set(titles)
        cells: dict[tuple[int, int], int] = {}
        for p in panels:
            where = f"{name} #{p['id']} {p['title']!r}"
            assert p["type"] in PANEL_TYPES, where
            g = p["gridPos"]
            assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["y"] >= 0, where
            for cx in range(g["x"], g["x"] + g["w"]):
                for cy in range(g["y"], g["y"] + g["h"]):
                    assert (cx, cy) not in cells, f"{where} overlaps panel #{cells[(cx, cy)]}"
                    cells[(cx, cy)] = p["id"]
            if p["type"] == "row":
                assert "targets" not in p, where
                continue
            assert p["datasource"] == DS_REF, where
            assert p.get("description"), where
            unit = p["fieldConfig"]["defaults"].get("unit")
            assert unit in UNITS or (isinstance(unit, str) and unit.startswith("suffix:")), f"{where}: unit {unit!r}"
            if p["type"] == "heatmap":
                y_unit = p["options"]["yAxis"].get("unit")
                assert y_unit in UNITS or y_unit.startswith("suffix:"), where
                assert all(t["format"] == "heatmap" for t in p["targets"]), where
            targets = p["targets"]
            assert targets, where
            ref_ids = [t["refId"] for t in targets]
            assert len(ref_ids) == len(set(ref_ids)), where
            for t in targets:
                assert t["datasource"] == DS_REF and t["expr"].strip(), where


def _variables_used(expr: str) -> set[str]:
    return {a or b for a, b in re.findall(r"\$\{(\w+)\}|\$(\w+)", expr)}


def test_every_variable_a_query_uses_is_defined(boards: dict[str, dict[str, Any]]) -> None:
    for name, board in boards.items():
        defined = {v["name"] for v in board["templating"]["list"]} | GRAFANA_VARIABLES
        for p in _panels(board):
            for t in p.get("targets", []):
                assert _variables_used(t["expr"]) <= defined, (name, p["title"], t["expr"])
                assert 'model=~"$model"' in t["expr"] or "ray_serve_" in t["expr"], (name, p["title"])


def _exported_series() -> set[str]:
    from services.metrics import METRICS, exported_name

    names = set()
    for metric, kind, *_ in METRICS:
        base = exported_name(metric, kind)
        names |= {f"{base}_{s}" for s in ("bucket", "sum", "count")} if kind == "histogram" else {base}
    return names


def test_every_dsde_series_read_by_a_panel_or_rule_is_exported(boards: dict[str, dict[str, Any]]) -> None:
    exported = _exported_series()
    exprs = [t["expr"] for b in boards.values() for p in _panels(b) for t in p.get("targets", [])]
    rules = yaml.safe_load((PROMETHEUS_DIR / "rules" / "dsde.rules.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    used = {m for e in exprs for m in re.findall(r"\bray_dsde_\w+", e)}
    assert used and used <= exported, used - exported


def test_promtool_accepts_the_config_and_rules_and_the_rule_unit_tests_pass() -> None:
    promtool = str(tool("promtool"))
    res = subprocess.run([promtool, "check", "config", "prometheus.yml"], capture_output=True, text=True, timeout=60,
                         cwd=PROMETHEUS_DIR)
    assert res.returncode == 0 and "SUCCESS: 1 rule files found" in res.stdout, res.stdout + res.stderr
    res = subprocess.run([promtool, "check", "rules", "rules/dsde.rules.yml"], capture_output=True, text=True,
                         timeout=60, cwd=PROMETHEUS_DIR)
    assert res.returncode == 0, res.stdout + res.stderr
    res = subprocess.run([promtool, "test", "rules", "dsde.rules.test.yml"], capture_output=True, text=True,
                         timeout=60, cwd=PROMETHEUS_DIR / "rules")
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_grafana_provisioning_points_at_the_local_prometheus_and_the_dashboards() -> None:
    prov = GRAFANA_DIR / "provisioning"
    [ds] = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://127.0.0.1:9090"
    scrape = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert ds["jsonData"]["timeInterval"] == scrape  # Grafana's $__rate_interval follows the scrape interval
    [provider] = yaml.safe_load((prov / "dashboards" / "dsde.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards/dsde"
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert '-v "$PWD/deploy/grafana/dashboards:/var/lib/grafana/dashboards/dsde:ro"' in operations
