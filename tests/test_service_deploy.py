"""The two ways to start the service, each on a Ray cluster of its own (own ports, own temp dir), stopped by
stopping exactly the processes this test started (never `ray stop`):

- `serve deploy deploy/config.yaml` against `ray start --head`: reaches RUNNING, answers, and a changed
  user_config is applied live (same replica, models not reloaded, the new policy for later requests);
- `dsde serve`: prints its URL, answers, writes the Prometheus service-discovery file that a real Prometheus with
  deploy/prometheus/prometheus.yml scrapes the service's metrics through, and exits cleanly on SIGTERM, the file gone.

Slow (a cluster start each); the config is deploy/config.yaml itself with only ports and models swapped for tiny ones.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsde_core.policies import DEFAULT_POLICY
from tests.ops_support import (
    prometheus_server,
    prometheus_test_config,
    ray_env,
    ray_head,
    session_pids,
    start_dsde_serve,
    stop_session,
)
from tests.service_support import free_port, http_get, http_post, make_tiny_pair, wait_for

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytest.importorskip("ray.serve")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_tiny_pair(tmp_path_factory.mktemp("tiny-models-deploy"))


def _serve_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "serve"), *args], capture_output=True, text=True, timeout=timeout, env=ray_env())


def _app_status(dashboard: str) -> str:
    res = _serve_cli("status", "-a", dashboard, timeout=60)
    status = yaml.safe_load(res.stdout) or {}
    return ((status.get("applications") or {}).get("dsde") or {}).get("status", "")


def _health(base: str) -> dict[str, Any]:
    code, body = http_get(f"{base}/health")
    return json.loads(body) if code == 200 else {}


def test_serve_deploy_config_reaches_running_and_reconfigures_live(tiny_models: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    target, draft = tiny_models
    config = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())
    http_port = free_port()
    config["http_options"]["port"] = http_port
    app = config["applications"][0]
    assert app["import_path"] == "services.app:build_app" and app["route_prefix"] == "/"
    app["args"].update(draft=str(draft), target=str(target), model_name="tiny", dtype="float32", max_batch_size=2,
                       max_seq_len=256, num_threads=1, draft_num_cpus=0, target_num_cpus=0)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{http_port}"
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 12, "temperature": 0}

    with ray_head() as head:
        res = _serve_cli("deploy", str(path), "-a", head.dashboard)
        assert res.returncode == 0, res.stdout + res.stderr
        wait_for(lambda: _app_status(head.dashboard) == "RUNNING", 300, interval=2, what="RUNNING")
        code, out = http_post(f"{base}/v1/completions", body)
        assert code == 200 and out["choices"][0]["text"] and out["speculation"]["drafted"] > 0, out
        before = _health(base)
        assert before["policy"] == app["deployments"][0]["user_config"]["policy"] == DEFAULT_POLICY

        app["deployments"][0]["user_config"] = {"policy": "off"}
        path.write_text(yaml.safe_dump(config))
        res = _serve_cli("deploy", str(path), "-a", head.dashboard)
        assert res.returncode == 0, res.stdout + res.stderr
        wait_for(lambda: _health(base).get("policy") == "off", 120, interval=1, what="the new policy")
        code, out = http_post(f"{base}/v1/completions", body)
        assert code == 200 and out["speculation"]["drafted"] == 0, out
        assert _health(base)["started"] == before["started"]  # the same replica: the models were not reloaded
        _serve_cli("shutdown", "-a", head.dashboard, "-y", timeout=120)


def test_dsde_serve_answers_is_scraped_and_stops_cleanly_on_sigterm(tiny_models: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    target, draft = tiny_models
    port, metrics_port = free_port(), free_port()
    sd_file = tmp_path / "sd.json"  # not Ray's own under /tmp/ray: this test must not touch the machine's
    proc, lines, reader = start_dsde_serve(
        "--draft", str(draft), "--target", str(target), "--model-name", "tiny", "--dtype", "float32",
        "--max-batch-size", "2", "--max-seq-len", "256", "--threads", "1", "--port", str(port),
        "--metrics-port", str(metrics_port), "--num-cpus", "2", "--prometheus-sd", str(sd_file))
    try:
        assert any(f"http://127.0.0.1:{port}/v1" in line for line in lines), "".join(lines)
        code, out = http_post(f"http://127.0.0.1:{port}/v1/chat/completions",
                              {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert code == 200 and out["choices"][0]["message"]["role"] == "assistant", out
        [group] = json.loads(sd_file.read_text())
        assert group["labels"] == {"job": "ray"}, group
        assert [t.rsplit(":", 1)[1] for t in group["targets"]] == [str(metrics_port)], group
        with prometheus_server(prometheus_test_config(sd_file), tmp_path / "prometheus") as prom:
            wait_for(lambda: prom.query('sum(ray_dsde_requests_finished_total{model="tiny"}) >= 1'), 60, interval=1,
                     what="Prometheus to scrape the finished request through dsde serve's service-discovery file")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, "".join(lines)
        assert time.monotonic() - t0 < 90
        with pytest.raises(OSError):
            http_get(f"http://127.0.0.1:{port}/health", timeout=5)  # nothing listens any more
        assert any("stopping" in line for line in lines)
        assert not sd_file.exists()  # Prometheus forgets the target instead of scraping a dead port
        wait_for(lambda: not session_pids(proc.pid), 30, what="every Ray process of `dsde serve` to exit")
    finally:
        stop_session(proc, grace=10)
        reader.join(5)
