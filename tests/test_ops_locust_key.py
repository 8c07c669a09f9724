"""load_tests/locustfile.py against a server that wants an API key (a stdlib HTTP server speaking the two streamed
endpoints): with --api-key (or $DSDE_API_KEY) every request carries the bearer token and passes; without it the run
fails at /v1/models, where it should, instead of timing 401s."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.ops_support import ROOT, locust_command, read_csv

KEY = "locust-key"


class _KeyedServer(BaseHTTPRequestHandler):
    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {KEY}":
            return True
        self._send(401, "application/json", json.dumps({"error": {"message": "bad key"}}).encode())
        return False

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self._authorized():
            self._send(200, "application/json", json.dumps({"data": [{"id": "keyed"}]}).encode())

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if not self._authorized():
            return
        chat = self.path.endswith("/chat/completions")
        chunks = [{"choices": [{"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w}]}
                  for w in ("one", " two", " three")]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(200, "text/event-stream", body.encode())

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def keyed() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeyedServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _locust(base: str, prefix: Path, env: dict[str, str], *flags: str) -> dict[tuple[str, str], dict[str, str]]:
    cmd = locust_command(base, prefix, "--users", "2", "--spawn-rate", "2", "--run-time", "4s",
                         "--prompts-per-workload", "2", "--workloads", "chat", *flags)
    subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    return {(r["Type"], r["Name"]): r for r in read_csv(Path(f"{prefix}_stats.csv"))}


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_key_goes_with_every_request(keyed: str, tmp_path: Path, how: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DSDE_API_KEY"}
    flags: tuple[str, ...] = ("--api-key", KEY) if how == "flag" else ()
    if how == "env":
        env["DSDE_API_KEY"] = KEY
    stats = _locust(keyed, tmp_path / "with", env, *flags)
    total = stats[("", "Aggregated")]
    assert int(total["Request Count"]) > 2 and int(total["Failure Count"]) == 0, total
    assert int(stats[("LLM", "E2E")]["Request Count"]) > 0


def test_without_the_key_the_run_stops_at_the_model_list(keyed: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DSDE_API_KEY"}
    stats = _locust(keyed, tmp_path / "without", env, "--run-time", "300s")  # it must end long before (timeout 120)
    models = stats[("GET", "GET /v1/models")]
    assert int(models["Failure Count"]) == int(models["Request Count"]) > 0, models
    assert not any(name.endswith("(stream)") for _, name in stats), stats.keys()


@pytest.mark.parametrize(("flags", "says"), [
    (("--workloads", "bogus"), "locustfile: error: unknown workload 'bogus'"),
    (("--long-fraction", "2"), "locustfile: error: --long-fraction must be in [0, 1]"),
    (("--responses-fraction", "-0.1"), "locustfile: error: --responses-fraction must be in [0, 1]"),
    (("--short-tokens", "0"), "locustfile: error: --short-tokens and --long-tokens must be >= 1"),
])
def test_a_bad_option_ends_the_run_before_it_starts_in_one_line(keyed: str, tmp_path: Path, flags: tuple[str, ...],
                                                                 says: str) -> None:
    res = subprocess.run(locust_command(keyed, tmp_path / "bad", "--run-time", "300s", *flags), capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode != 0 and says in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "bad_stats.csv").exists() or all(
        int(row["Request Count"]) == 0 for row in read_csv(tmp_path / "bad_stats.csv"))  # no run
