"""Graceful shutdown of `dsde serve` (a Ray cluster of its own, in a session of its own, stopped by stopping exactly
the processes this test started): on SIGTERM the running streams finish, a request sent meanwhile is refused with
503 and Retry-After, the process exits 0 and leaves no Ray process; an API key given with --api-key is enforced.
A SIGTERM to its whole process group (Ray's GCS included) stops it within seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.ops_support import session_pids, start_dsde_serve, stop_session
from tests.service_support import free_port, make_tiny_pair, wait_for

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve")
BIN = Path(sys.executable).parent
KEY = "sigterm-key"


def _start(tmp_path: Path) -> tuple[subprocess.Popen, list[str], threading.Thread, str]:
    """`dsde serve` on the tiny pair in a session of its own, ready: its process, its output lines so far (a
    thread goes on reading them), that thread and the base URL."""
    target, draft = make_tiny_pair(tmp_path / "models")
    port, metrics_port = free_port(), free_port()
    proc, lines, reader = start_dsde_serve(
        "--draft", str(draft), "--target", str(target), "--model-name", "tiny", "--dtype", "float32",
        "--max-batch-size", "4", "--max-seq-len", "1024", "--threads", "1", "--port", str(port),
        "--metrics-port", str(metrics_port), "--num-cpus", "2", "--api-key", KEY,
        "--prometheus-sd", "none")  # leave the machine's /tmp/ray alone
    return proc, lines, reader, f"http://127.0.0.1:{port}"


def test_sigterm_drains_running_streams_refuses_new_requests_and_exits_cleanly(tmp_path: Path) -> None:
    proc, lines, reader, base = _start(tmp_path)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401  # --api-key is enforced
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200

        results: list[dict] = [{} for _ in range(2)]
        first = [threading.Event() for _ in results]

        def long_stream(i: int) -> None:
            body = {"model": "tiny", "prompt": f"story {i}:", "max_tokens": 900, "temperature": 0, "stream": True,
                    "speculation": {"enabled": False}}  # one token a step: still running when SIGTERM comes
            text, reason, done = "", None, False
            with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=auth, timeout=180) as r:
                results[i]["status"] = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        choice = json.loads(line[6:])["choices"][0]
                        text += choice["text"]
                        reason = choice["finish_reason"] or reason
                        first[i].set()
            results[i].update(text=text, reason=reason, done=done)

        threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        assert all(ev.wait(120) for ev in first)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{base}/health", timeout=10).json()["status"] == "draining", 30, interval=0.1,
                 what="the replica to drain")
        refused = httpx.post(f"{base}/v1/completions", headers=auth, timeout=30,
                             json={"model": "tiny", "prompt": "late", "max_tokens": 4})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        for t in threads:
            t.join(180)
        for res in results:  # the running streams were not cut: they ran to their end
            assert res["status"] == 200 and res["done"] and res["reason"] in ("length", "stop"), res
            assert res["text"]
        assert proc.wait(120) == 0, "".join(lines)
        print(f"SIGTERM -> exit in {time.monotonic() - t0:.1f}s; " + " | ".join(
            line.strip() for line in lines if "drain" in line or "stopping" in line))
        assert any("drained" in line for line in lines), "".join(lines)
        wait_for(lambda: not session_pids(proc.pid), 30, what="every Ray process of `dsde serve` to exit")
    finally:
        stop_session(proc, grace=10)
        reader.join(5)


def test_a_sigterm_to_the_whole_process_group_stops_it_within_seconds(tmp_path: Path) -> None:
    """`kill -- -PGID`, systemd's default KillMode and `timeout` signal Ray's GCS and raylet too (they share the
    process group of `dsde serve`): the cluster is gone before anything could drain, and `dsde serve` says so and
    exits 0 instead of waiting a minute for the GCS to come back."""
    proc, lines, reader, base = _start(tmp_path)
    try:
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(45) == 0, "".join(lines)  # a bound against the minute's wait, not a speed figure
        reader.join(5)
        assert any("got the signal too" in line for line in lines), "".join(lines)
        wait_for(lambda: not session_pids(proc.pid), 30, what="every Ray process of `dsde serve` to exit")
    finally:
        stop_session(proc, grace=10)
        reader.join(5)
