"""Helpers for the operations tests (tests/test_ops_*.py): the tools the setup installs, a Ray cluster started the way
the README deploys one (`ray start --head` with its dashboard, which writes Prometheus' service-discovery file, then
`serve deploy` of deploy/config.yaml with tiny models), and a real Prometheus server with its HTTP API.

Everything listens on 127.0.0.1 only, on free ports, in temp dirs of its own; a test stops exactly the processes it
started (never `ray stop`)."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray._private import ray_constants

from tests.service_support import free_port, http_get, pin_policy, wait_for

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
SD_FILE_NAME = ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE
TINY_MODEL = "tiny"


def tool(name: str) -> Path:
    """A command-line tool the setup installs (into the venv's bin, beside this Python): fail, never skip, without."""
    for candidate in (BIN / name, shutil.which(name)):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    pytest.fail(f"`{name}` is not installed: `make setup` installs it (docs/operations.md)", pytrace=False)


def locust_command(base: str, csv_prefix: Path, *flags: str) -> list[str]:
    """load_tests/locustfile.py headless against `base`, its statistics in `csv_prefix`_*.csv, with `flags`."""
    return [str(tool("locust")), "-f", str(ROOT / "load_tests" / "locustfile.py"), "--headless", "--host", base,
            "--csv", str(csv_prefix), "--only-summary", *flags]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def ray_env() -> dict[str, str]:
    """Environment for `ray start` / `serve`: auth off as the README says, workers at normal priority (a load
    generator shares these cores), application metrics reported every 2 s instead of 10 s, and every address of the
    cluster on 127.0.0.1 (Ray's single-machine mode; otherwise it advertises the host's network address, and the
    service-discovery file would send Prometheus there)."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", RAY_worker_niceness="0",
               RAY_metrics_report_interval_ms="2000", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    return env


def session_pids(sid: int) -> list[int]:
    """Processes of session `sid` (Ray's workers have their own process groups, not sessions)."""
    pids = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        with contextlib.suppress(OSError):
            if os.getsid(pid) == sid:
                pids.append(pid)
    return pids


def stop_session(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGINT, SIGTERM, then SIGKILL to the session `proc` leads (started with start_new_session), and only to it."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not session_pids(proc.pid), 20, what="the session's processes to exit")
    for pid in session_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_dsde_serve(*flags: str) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """`dsde serve FLAGS` in a session of its own, ready: its process, its output lines so far (a thread goes on
    reading them) and that thread. A start that fails stops the session and fails with the output."""
    proc = subprocess.Popen([str(BIN / "dsde"), "serve", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=ray_env(), start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("ready" in line for line in lines) or proc.poll() is not None, 300, interval=1,
                 what="dsde serve to be ready")
        assert proc.poll() is None, "".join(lines)
    except BaseException:
        stop_session(proc, grace=10)
        raise
    return proc, lines, reader


@dataclass
class RayHead:
    temp_dir: Path
    dashboard: str  # http://127.0.0.1:PORT
    metrics_port: int

    @property
    def sd_file(self) -> Path:
        """Prometheus' file_sd file that Ray's dashboard keeps current (deploy/prometheus/prometheus.yml reads the
        same file under /tmp/ray, Ray's default temp dir)."""
        return self.temp_dir / SD_FILE_NAME


@contextlib.contextmanager
def ray_head(num_cpus: int = 2) -> Iterator[RayHead]:
    """`ray start --head --block` with its dashboard, on 127.0.0.1, in its own session and temp dir."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rops", dir="/tmp"))  # short: Ray's socket paths have a length limit
    ports = {name: free_port() for name in ("gcs", "dashboard", "client", "metrics", "agent", "agent_grpc",
                                            "runtime_env", "node_manager", "object_manager")}
    cmd = [str(tool("ray")), "start", "--head", "--block", f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}",
           "--node-ip-address=127.0.0.1", f"--port={ports['gcs']}", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={ports['dashboard']}", f"--ray-client-server-port={ports['client']}",
           f"--metrics-export-port={ports['metrics']}", f"--dashboard-agent-listen-port={ports['agent']}",
           f"--dashboard-agent-grpc-port={ports['agent_grpc']}", f"--runtime-env-agent-port={ports['runtime_env']}",
           f"--node-manager-port={ports['node_manager']}", f"--object-manager-port={ports['object_manager']}",
           "--object-store-memory=268435456", "--disable-usage-stats"]
    log = open(temp_dir / "ray-start.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ray_env(), start_new_session=True)
    head = RayHead(temp_dir, f"http://127.0.0.1:{ports['dashboard']}", ports["metrics"])
    try:
        wait_for(lambda: proc.poll() is None and http_get(f"{head.dashboard}/api/version", timeout=5)[0] == 200, 120,
                 interval=1, what="ray start --head")
        yield head
    finally:
        stop_session(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def tiny_serve_config(http_port: int, target: Path, draft: Path, max_batch_size: int = 4) -> dict[str, Any]:
    """deploy/config.yaml itself with only the HTTP port, the models (tiny, fp32, one thread) and the policy swapped:
    the paper's dsde, which drafts on every step, so that every speculation series has data (the default
    dsde-goodput stops drafting where its cost model sees no gain, as on the tiny pair)."""
    config = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())
    config["http_options"]["port"] = http_port
    app = config["applications"][0]
    app["args"].update(draft=str(draft), target=str(target), model_name=TINY_MODEL, dtype="float32",
                       max_batch_size=max_batch_size, max_seq_len=512, num_threads=1, draft_num_cpus=0,
                       target_num_cpus=0)
    pin_policy(app, "dsde")
    return config


def serve_deploy(head: RayHead, config: dict[str, Any], timeout: float = 240) -> str:
    """`serve deploy` a config on the head; waits until the app answers; returns its base URL."""
    path = head.temp_dir / "serve-config.yaml"
    path.write_text(yaml.safe_dump(config))
    res = subprocess.run([str(tool("serve")), "deploy", str(path), "-a", head.dashboard], capture_output=True,
                         text=True, timeout=120, env=ray_env())
    assert res.returncode == 0, res.stdout + res.stderr
    base = f"http://127.0.0.1:{config['http_options']['port']}"

    def ready() -> bool:
        code, body = http_get(f"{base}/v1/models", timeout=5)
        return code == 200 and TINY_MODEL in body

    wait_for(ready, timeout, interval=2, what="the deployed app to answer /v1/models")
    return base


# ---- Prometheus ------------------------------------------------------------------------------------------------
def prometheus_test_config(sd_file: Path, interval: str = "2s") -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with only the service-discovery file's path (Ray's temp dir of this test
    instead of /tmp/ray), the scrape and rule intervals (seconds instead of 15 s) and the rule files' paths changed."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "ray"]
    [sd] = job["file_sd_configs"]
    assert sd["files"][0].endswith(f"/tmp/ray/{SD_FILE_NAME}"), sd
    sd["files"] = [str(sd_file)]
    sd["refresh_interval"] = interval
    config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
    return config


class Prometheus:
    """A client of Prometheus' HTTP API (/api/v1)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params)
        code, body = http_get(f"{self.url}/api/v1/{path}" + (f"?{query}" if query else ""), timeout=30)
        payload = json.loads(body)
        if code != 200 or payload.get("status") != "success":
            raise PromQLError(f"{path} {params}: HTTP {code}: {payload.get('errorType')}: {payload.get('error')}")
        return payload["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        data = self.api("query", query=expr, **({"time": f"{at:.3f}"} if at is not None else {}))
        assert data["resultType"] == "vector", data
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
        assert data["resultType"] == "matrix", data
        return data["result"]


class PromQLError(AssertionError):
    pass


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    """The finite sample values of a vector or matrix result."""
    values: list[float] = []
    for series in result:
        for _, v in series.get("values") or [series["value"]]:
            if math.isfinite(float(v)):
                values.append(float(v))
    return values


@contextlib.contextmanager
def prometheus_server(config: dict[str, Any], workdir: Path) -> Iterator[Prometheus]:
    """The real Prometheus server (the setup's Debian package) on a free 127.0.0.1 port, with `config`."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    check = subprocess.run([str(tool("promtool")), "check", "config", str(config_path)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(tool("prometheus")), f"--config.file={config_path}",
                             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is None and http_get(f"{url}/-/ready", timeout=5)[0] == 200, 60, interval=0.5,
                 what="Prometheus to be ready")
        yield Prometheus(url)
    finally:
        stop_session(proc, grace=10)
        log.close()
