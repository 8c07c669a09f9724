"""Soak: the service under moderate load for a few minutes, with zero failed requests and resident memory that does
not grow after warm-up. Not a test (minutes long); prints its figures and exits non-zero when a criterion fails.

    .venv/bin/python benchmarks/soak.py                       # tiny pair, 8 Locust users, 6 minutes
    .venv/bin/python benchmarks/soak.py --duration 600 --users 12
    .venv/bin/python benchmarks/soak.py --real --users 4      # the embedded Qwen2.5-Coder pair (slow on a CPU)

It starts `dsde serve` in a session of its own (own ports, workers at nice 0), drives it with Locust through its
command line (load_tests/locustfile.py when present: streamed chat and text completions with real prompts;
otherwise a minimal streaming user written here), samples the resident memory (RSS) of every process of that
session every few seconds (the ingress replica, the draft, target and controller actors, the Serve proxy and
controller, Ray's own processes), then stops the service with SIGTERM (graceful: drained first).

Criteria: Locust reports zero failed requests; after warm-up (the first --warmup seconds) the total RSS grows by
at most --max-growth (default 5%) from the mean of the first post-warm-up samples to the mean of the last ones;
at the end no request state is left (/admin/state: all counts zero).

--chaos N: every N seconds of load, SIGKILL the process of one model or controller actor in turn (draft, controller,
target: a crash, not a clean exit); Ray restarts it and the engine recovers (README "Failure behaviour"). Criteria
then: zero failed requests all the same, every actor up at the end with each kill counted as one failure in
/admin/state, no state left, a clean SIGTERM. The RSS is reported, not judged (a restarted actor starts afresh).
Each actor may be restarted actor_max_restarts (3) times, so a run kills each at most that often.

    .venv/bin/python benchmarks/soak.py --chaos 40           # 8 kills in 6 minutes: 3, 3 and 2

The tiny pair (random weights, the real Qwen tokenizer; tests/service_support.make_tiny_pair) makes requests
short, so many more of them pass through the ingress, the engine and the actors in the same minutes: what
a soak is for. Locust runs at nice 10 so that the service's workers keep the CPU (notes: a load generator on the
same two cores starves Ray's workers).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

from dsde_bench.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LOCUSTFILE = ROOT / "load_tests" / "locustfile.py"

MINIMAL_USER = '''
import json, random
from locust import HttpUser, between, task

PROMPTS = ["def fibonacci(n):", "Write a haiku about the sea.", "SELECT * FROM orders WHERE", "Once upon a time",
           "Explain recursion in one sentence.", "import numpy as np\\n", "The capital of France is"]


class StreamingUser(HttpUser):
    wait_time = between(0.1, 0.5)

    def on_start(self):
        self.model = self.client.get("/v1/models").json()["data"][0]["id"]

    @task
    def stream(self):
        chat = random.random() < 0.5
        body = {"model": self.model, "stream": True, "temperature": 0,
                "max_tokens": random.choice([16, 32, 32, 64, 256])}
        if chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": random.choice(PROMPTS)}]
        else:
            path, body["prompt"] = "/v1/completions", random.choice(PROMPTS)
        with self.client.post(path, json=body, stream=True, catch_response=True, name=path, timeout=600) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
                return
            done = False
            for line in r.iter_lines():
                line = line.decode() if isinstance(line, bytes) else line
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                    r.failure(line)
                    return
            if not done:
                r.failure("no [DONE]")
'''


def session_rss(sid: int) -> dict[str, int]:
    """RSS in bytes of every live process of session `sid`, keyed 'pid name'."""
    out = {}
    for p in session_processes(sid):
        with contextlib.suppress(psutil.Error):  # it may end between the listing and this read
            out[f"{p.pid} {command(p)[:60] or p.info['name']}"] = p.memory_info().rss
    return out


def session_processes(sid: int) -> Iterator[psutil.Process]:
    """The live processes of session `sid` (the service this script started, and only those), with their pid, name
    and command line read."""
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            ours = os.getsid(p.pid) == sid
        except OSError:  # it ended since the listing
            continue
        if ours:
            yield p


def command(p: psutil.Process) -> str:
    return " ".join(p.info["cmdline"] or [])


CHAOS = (("draft", "DraftHost"), ("policy", "Controller"), ("target", "TargetHost"))  # /admin/state role, actor class
MAX_KILLS = 3  # each actor's restarts (the app arg actor_max_restarts' default)
CHAOS_QUIET_S = 30  # no kill in the last seconds of load: the last one's actor is back before the end


def actor_pid(sid: int, cls: str) -> int | None:
    """The live process of session `sid` that hosts an actor of class `cls` (Ray titles it ray::Cls or
    ray::Cls.method()); None while there is none (restarting)."""
    title = re.compile(rf"ray::{cls}(\.|\s|$)")
    return next((p.pid for p in session_processes(sid) if title.match(command(p))), None)


def _start_service(args: argparse.Namespace, port: int, metrics_port: int, workdir: Path) -> subprocess.Popen:
    cmd = [str(BIN / "dsde"), "serve", "--port", str(port), "--metrics-port", str(metrics_port),
           "--max-batch-size", str(args.batch), "--num-cpus", "2", "--model-name", "soak"]
    if not args.real:
        sys.path.insert(0, str(ROOT))
        from tests.service_support import make_tiny_pair

        target, draft = make_tiny_pair(workdir / "models")
        cmd += ["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--max-seq-len", "1024",
                "--threads", "1"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    log = open(workdir / "serve.log", "w")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dsde serve exited with {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError, ValueError):  # ValueError: not JSON yet (Serve's own 404 or 503)
            if httpx.get(f"{url}/health", timeout=5).json().get("status") == "ok":
                return
        time.sleep(2)
    raise RuntimeError(f"dsde serve was not ready after {timeout:.0f}s")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to `dsde serve` alone (it drains, then stops Serve and its Ray), SIGKILL to its group if it hangs."""
    proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(120)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    for p in session_processes(proc.pid):  # stragglers of the session this script started, and only those
        with contextlib.suppress(psutil.Error):
            p.kill()


def _kill(sid: int, actor: tuple[str, str], t: float) -> dict[str, Any]:
    role, cls = actor
    pid = actor_pid(sid, cls)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    print(f"soak: t={t:5.0f}s chaos: " + (f"SIGKILL {cls} (pid {pid})" if pid else f"no {cls} process"), flush=True)
    return {"t_s": round(t, 1), "role": role, "actor": cls, "pid": pid}


def _locust(args: argparse.Namespace, url: str, workdir: Path) -> subprocess.Popen:
    locustfile = LOCUSTFILE
    extra: list[str] = []
    if not locustfile.exists():
        locustfile = workdir / "locustfile.py"
        locustfile.write_text(MINIMAL_USER)
    else:
        extra = ["--short-tokens", "32", "--long-tokens", str(args.long_tokens), "--long-fraction", "0.25"]
    cmd = [str(BIN / "locust"), "-f", str(locustfile), "--headless", "--host", url, "--users", str(args.users),
           "--spawn-rate", str(args.users), "--run-time", f"{args.duration}s", "--csv", str(workdir / "locust"),
           "--only-summary", "--stop-timeout", "120", *extra]
    log = open(workdir / "locust.log", "w")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=lambda: os.nice(10))


def _locust_totals(workdir: Path) -> tuple[int, int, dict[str, Any]]:
    with open(workdir / "locust_stats.csv") as f:
        rows = list(csv.DictReader(f))
    total = next(r for r in rows if r["Name"] == "Aggregated")
    per_name = {f"{r['Type']} {r['Name']}": r for r in rows if r["Name"] != "Aggregated"}
    http = [r for r in per_name.values() if r["Type"] != "LLM"]
    requests = sum(int(r["Request Count"]) for r in http)
    failures = int(total["Failure Count"])
    return requests, failures, per_name


def _slope_mb_per_min(samples: list[tuple[float, int]]) -> float:
    if len(samples) < 2:
        return 0.0
    ts = [t for t, _ in samples]
    ys = [v / 2**20 for _, v in samples]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=int, default=360, help="seconds of load (default 360)")
    ap.add_argument("--warmup", type=int, default=150, help="seconds not counted for memory growth (default 150)")
    ap.add_argument("--users", type=int, default=8, help="Locust users, each streaming one request at a time")
    ap.add_argument("--batch", type=int, default=8, help="the service's max_batch_size")
    ap.add_argument("--long-tokens", type=int, default=256, help="max_tokens of the long requests (a quarter)")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth after warm-up (fraction)")
    ap.add_argument("--real", action="store_true", help="the embedded pair instead of the tiny one")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    ap.add_argument("--chaos", type=float, default=0.0, metavar="N",
                    help="SIGKILL one actor (draft, controller, target in turn) every N seconds of load (default: off)")
    args = ap.parse_args()
    if args.warmup >= args.duration:
        ap.error("--warmup must be shorter than --duration")
    kills = int((args.duration - CHAOS_QUIET_S) // args.chaos) if args.chaos > 0 else 0  # the last long before the end
    if args.chaos < 0 or -(-kills // len(CHAOS)) > MAX_KILLS:
        ap.error(f"--chaos {args.chaos:g} kills an actor more than {MAX_KILLS} times in {args.duration}s (Ray restarts "
                 f"each at most {MAX_KILLS} times): take a longer interval")

    workdir = Path(tempfile.mkdtemp(prefix="dsde-soak-"))
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    t_start = time.perf_counter()
    proc = _start_service(args, port, metrics_port, workdir)
    samples: list[tuple[float, int]] = []
    per_process: list[dict[str, int]] = []
    killed: list[dict[str, Any]] = []
    try:
        _wait_ready(url, proc, 900 if args.real else 300)
        print(f"soak: service ready in {time.perf_counter() - t_start:.0f}s at {url} (logs in {workdir})", flush=True)
        locust = _locust(args, url, workdir)
        t0 = time.perf_counter()
        while locust.poll() is None:
            rss = session_rss(proc.pid)
            t = time.perf_counter() - t0
            samples.append((t, sum(rss.values())))
            per_process.append(rss)
            print(f"soak: t={t:5.0f}s rss={samples[-1][1] / 2**20:7.0f} MiB ({len(rss)} processes)", flush=True)
            if len(killed) < kills and t >= args.chaos * (len(killed) + 1):
                killed.append(_kill(proc.pid, CHAOS[len(killed) % len(CHAOS)], t))
            time.sleep(args.interval)
        state = httpx.get(f"{url}/admin/state", timeout=30).json()
    finally:
        _stop(proc)
    requests, failures, per_name = _locust_totals(workdir)
    stopped_cleanly = proc.returncode == 0 and "dsde serve: drained" in (workdir / "serve.log").read_text()

    after = [(t, v) for t, v in samples if args.warmup <= t <= args.duration]
    k = max(1, len(after) // 4)
    first, last = statistics.fmean(v for _, v in after[:k]), statistics.fmean(v for _, v in after[-k:])
    growth = (last - first) / first
    slope = _slope_mb_per_min(after)
    leftover = {key: state[key] for key in ("running", "waiting", "requests", "slots_in_use", "target_slots_open",
                                            "draft_slots_open", "controller_tracked", "tried_alone",
                                            "draft_tried_alone", "draft_off")}
    e2e = per_name.get("LLM E2E") or {}
    figures = {
        "duration_s": args.duration, "users": args.users, "models": "real" if args.real else "tiny",
        "requests": requests, "failures": failures, "requests_per_s": requests / args.duration,
        "e2e_median_ms": float(e2e.get("Median Response Time") or 0), "e2e_p99_ms": float(e2e.get("99%") or 0),
        "rss_warm_mib": first / 2**20, "rss_end_mib": last / 2**20, "rss_growth": growth,
        "rss_slope_mib_per_min": slope, "leftover_state": leftover,
        "worker_failures": {role: w["failures"] for role, w in state["workers"].items()},
        "stopped_cleanly": stopped_cleanly, "chaos_s": args.chaos, "kills": killed,
        "workers_up": {role: w["up"] for role, w in state["workers"].items()},
    }
    biggest = sorted(per_process[-1].items(), key=lambda kv: -kv[1])[:6] if per_process else []
    warm_index = next((i for i, (t, _) in enumerate(samples) if t >= args.warmup), 0)
    grew = sorted(((rss - per_process[warm_index].get(name, rss), name) for name, rss in per_process[-1].items()),
                  reverse=True)[:4] if per_process else []
    figures["rss_growth_by_process_mib"] = {name: delta / 2**20 for delta, name in grew}
    print("\nsoak figures")
    print(f"  {requests} requests in {args.duration}s ({figures['requests_per_s']:.1f}/s) by {args.users} users, "
          f"{failures} failed; E2E median {figures['e2e_median_ms']:.0f} ms, p99 {figures['e2e_p99_ms']:.0f} ms")
    print(f"  RSS after warm-up {first / 2**20:.0f} MiB -> end {last / 2**20:.0f} MiB ({100 * growth:+.1f}%), "
          f"slope {slope:+.1f} MiB/min over {len(after)} samples")
    for name, rss in biggest:
        print(f"    {rss / 2**20:7.0f} MiB  {name}")
    print("  grew most after warm-up: " + ", ".join(f"{name.split(' ', 1)[1].strip()[:40]} {d / 2**20:+.0f} MiB"
                                                 for d, name in grew))
    print(f"  state left at the end: {leftover}; worker failures: {figures['worker_failures']}; SIGTERM: "
          f"{'drained, exit 0' if stopped_cleanly else 'NOT clean (see serve.log)'}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    ok = failures == 0 and requests > 0 and not any(leftover.values()) and stopped_cleanly
    if kills:  # every kill found its actor, counted once; every actor back
        per_role = {role: sum(k["role"] == role for k in killed) for role, _ in CHAOS}
        print(f"  chaos: {len(killed)} kills {per_role}; workers up at the end: {figures['workers_up']}")
        ok = ok and all(k["pid"] for k in killed) and all(figures["workers_up"].values()) and all(
            figures["worker_failures"][role] == n for role, n in per_role.items())
    else:
        ok = ok and growth <= args.max_growth
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
