"""A Ray cluster of several nodes on this one machine for tests/test_multinode.py: Ray's own
`ray.cluster_utils.Cluster` (each node a raylet with its own resources; `remove_node` kills one as a lost machine
would be, without a drain), the service deployed on it with the `serve` CLI against the head's dashboard, and the
questions the tests ask of it (which node hosts an actor, how many replicas run, a stream through the `openai`
client that names the replica that served it).

The nodes play the parts of a real split placement: the head runs Serve, the ingress replicas and the controllers
(it advertises HEAD_RESOURCE), a "CPU node" hosts drafts (DRAFT_RESOURCE) and a "GPU node" targets (TARGET_RESOURCE);
a spare of either kind is added before one is removed, so that Ray has somewhere to restart its actors.

Everything is bounded (client timeouts, wait_for deadlines) and started by this process, which stops exactly what it
started (never `ray stop`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.service_support import free_port, http_get, pin_policy, wait_for

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "tiny"
HEAD_RESOURCE, DRAFT_RESOURCE, TARGET_RESOURCE = "dsde_head", "dsde_draft", "dsde_target"
SLOTS = 2  # each node kind holds the actors of two replicas

# The cluster's environment (set in this process before the nodes start; they and their workers inherit it): auth off
# for the `serve` CLI, workers at normal priority, Serve's autoscaling metrics pushed every half second instead of
# every 10 s (the time to scale up is then the autoscaler's own), Ray's application metrics every 2 s.
CLUSTER_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0",
               "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
               "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}
# A lost node is declared dead after 3 missed health checks a second apart (Ray's default: 5 of 3 s).
SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3,
                 "metrics_report_interval_ms": 2000}


@dataclass
class MultiNode:
    """The running cluster: the head and a node per role; `spares` are nodes added to take over a removed one."""

    cluster: Any  # ray.cluster_utils.Cluster
    dashboard: str  # http://127.0.0.1:PORT, for `serve deploy -a` and `dsde check-config --address`
    temp_dir: Path
    nodes: dict[str, Any] = field(default_factory=dict)  # "draft" / "target" -> its current ray._private.node.Node

    def add(self, role: str) -> Any:
        """A new node of `role` ("draft" or "target"): its resource, one logical CPU. Returns it (not yet `nodes`)."""
        resource = {"draft": DRAFT_RESOURCE, "target": TARGET_RESOURCE}[role]
        node = self.cluster.add_node(num_cpus=1, resources={resource: SLOTS}, object_store_memory=80 * 2**20,
                                     log_to_stderr=False)
        self.cluster.wait_for_nodes(timeout=60)
        return node

    def replace(self, role: str) -> tuple[Any, Any]:
        """Add a spare node of `role`, then remove the current one at once, as a machine that is lost (no drain);
        returns (removed, spare). The spare becomes the role's node."""
        spare = self.add(role)
        removed = self.nodes[role]
        self.cluster.remove_node(removed, allow_graceful=False)
        self.nodes[role] = spare
        return removed, spare


@contextlib.contextmanager
def multinode_cluster() -> Iterator[MultiNode]:
    """A head (dashboard on a free port, Serve's resource) and a draft and a target node; this process is connected as
    a driver to the head. Stopped, with every node, at the end."""
    import ray
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "the multi-node tests start (and stop) their own cluster"
    saved = {k: os.environ.get(k) for k in [*CLUSTER_ENV, "RAY_ADDRESS"]}
    os.environ.update(CLUSTER_ENV)
    os.environ.pop("RAY_ADDRESS", None)
    temp_dir = Path(tempfile.mkdtemp(prefix="rmn", dir="/tmp"))  # short: Ray's socket paths have a length limit
    # Cluster writes the head's address to /tmp/ray/ray_current_cluster whatever its temp_dir, and fails where no Ray
    # has made /tmp/ray yet (a fresh machine)
    Path("/tmp/ray").mkdir(exist_ok=True)
    dashboard_port = free_port()
    cluster = Cluster(initialize_head=True, shutdown_at_exit=False, head_node_args={
        "num_cpus": 2, "resources": {HEAD_RESOURCE: 16}, "include_dashboard": True, "dashboard_host": "127.0.0.1",
        "dashboard_port": dashboard_port, "temp_dir": str(temp_dir),
        "object_store_memory": 150 * 2**20, "_system_config": SYSTEM_CONFIG, "log_to_stderr": False})
    mn = MultiNode(cluster, f"http://127.0.0.1:{dashboard_port}", temp_dir)
    try:
        # the driver joins while the head is the only node: it attaches to the head's raylet, never to one removed
        ray.init(address=cluster.address, namespace="dsde-multinode", log_to_driver=False)
        mn.nodes = {"draft": mn.add("draft"), "target": mn.add("target")}
        wait_for(lambda: http_get(f"{mn.dashboard}/api/version", timeout=5)[0] == 200, 120, interval=1,
                 what="the head's dashboard")
        yield mn
    finally:
        with contextlib.suppress(Exception):
            serve_cli("shutdown", "-a", mn.dashboard, "-y", timeout=60)
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def serve_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, **CLUSTER_ENV}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([str(BIN / "serve"), *args], capture_output=True, text=True, timeout=timeout, env=env)


def serve_config(http_port: int, target: Path, draft: Path, autoscaling: dict[str, Any], **args: Any
                 ) -> dict[str, Any]:
    """deploy/config.yaml with the tiny fp32 pair, the paper's dsde policy, one thread per model, two KV slots, the
    HTTP proxy on the head only and the actors placed by the nodes' resources: one STRICT_SPREAD placement group per
    replica, whose bundles put the controller on the head, the draft on a draft node and the target on a target node.
    `args` override the app args; `autoscaling` is the deployment's autoscaling_config (deploy/config.yaml's shape:
    one that can only hold one replica until a test raises max_replicas, a change of numbers that Serve applies
    without a restart)."""
    config = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    config["proxy_location"] = "HeadOnly"
    [app] = config["applications"]
    app["args"].update(
        draft=str(draft), target=str(target), model_name=MODEL, dtype="float32", max_batch_size=SLOTS, max_queue=8,
        max_seq_len=256, num_threads=1, draft_num_cpus=0, target_num_cpus=0, placement_strategy="STRICT_SPREAD",
        draft_resources={DRAFT_RESOURCE: 1}, target_resources={TARGET_RESOURCE: 1},
        controller_resources={HEAD_RESOURCE: 0.01}, actor_max_restarts=5, worker_wait_s=20, placement_timeout_s=120,
        request_timeout_s=180, **args)
    pin_policy(app, "dsde")  # always drafts: these tests watch the draft, not the policy
    [deployment] = app["deployments"]
    assert "num_replicas" not in deployment and deployment["autoscaling_config"]["max_replicas"] >= 1
    deployment["autoscaling_config"] = dict(autoscaling)
    # the ingress replicas on the head: a node that is removed takes no replica (and no HTTP stream) with it
    deployment["ray_actor_options"] = {"num_cpus": 0, "resources": {HEAD_RESOURCE: 1}}
    deployment["graceful_shutdown_timeout_s"] = 60
    return config


def serve_deploy(mn: MultiNode, config: dict[str, Any]) -> None:
    path = mn.temp_dir / f"serve-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(config))
    res = serve_cli("deploy", str(path), "-a", mn.dashboard)
    assert res.returncode == 0, res.stdout + res.stderr


def replica_states() -> dict[str, int]:
    """Serve's replica states of the DSDEServer deployment, e.g. {"RUNNING": 2, "STARTING": 1}."""
    from ray import serve

    app = serve.status().applications.get("dsde")
    if app is None or "DSDEServer" not in app.deployments:
        return {}
    return {str(k): v for k, v in app.deployments["DSDEServer"].replica_states.items()}


def actor_node(name: str, namespace: str) -> str:
    """The node id (hex) of the live actor named `name`; AssertionError while it has none (restarting)."""
    from ray.util.state import list_actors

    alive = list_actors(filters=[("name", "=", name), ("state", "=", "ALIVE")], raise_on_missing_output=False)
    assert len(alive) == 1, f"actor {name}: {len(alive)} alive"
    return alive[0].node_id


def placement_groups() -> dict[str, dict[str, Any]]:
    """placement group id -> its state, strategy and bundles' nodes (Ray's GCS table)."""
    from ray.util import placement_group_table

    return {pg_id: {"state": pg["state"], "strategy": pg["strategy"], "name": pg["name"],
                    "nodes": dict(pg.get("bundles_to_node_id") or {})} for pg_id, pg in placement_group_table().items()}


# ---- the client -------------------------------------------------------------------------------------------------
@dataclass
class Streamed:
    """One streamed completion through the `openai` client."""

    prompt: str
    text: str = ""
    replica: str = ""  # x-dsde-replica: the replica that served it
    finish_reason: str | None = None
    error: str | None = None  # the APIError of an error event or status
    status: int | None = None
    started: float = 0.0
    ended: float = 0.0
    first_text: threading.Event = field(default_factory=threading.Event)

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason in ("length", "stop")


def stream_completion(base: str, prompt: str, max_tokens: int, timeout: float = 150,
                      out: Streamed | None = None) -> Streamed:
    """Stream a greedy completion of `prompt` through the openai client (into `out` as it goes, if given); never
    raises for an API error (recorded)."""
    import openai

    out = out or Streamed(prompt)
    out.started = time.monotonic()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=timeout, max_retries=0)
    try:
        with client.completions.with_streaming_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                                temperature=0, stream=True) as response:
            out.replica = response.headers.get("x-dsde-replica", "")
            out.status = response.status_code
            for chunk in response.parse():
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                out.text += choice.text or ""
                if out.text:
                    out.first_text.set()
                out.finish_reason = choice.finish_reason or out.finish_reason
    except openai.APIError as e:
        out.error = f"{type(e).__name__}: {getattr(e, 'code', None)}: {e.message}"
        out.status = getattr(e, "status_code", out.status)
    finally:
        out.ended = time.monotonic()
        out.first_text.set()  # whoever waits for it stops waiting
        client.close()
    return out


def in_threads(calls: list[Any]) -> tuple[list[threading.Thread], list[Any]]:
    """Start each zero-argument call in a thread; returns the threads and a list their results fill, in order."""
    results: list[Any] = [None] * len(calls)

    def run(i: int, call: Any) -> None:
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    return threads, results


def join_all(threads: list[threading.Thread], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"{what}: still running after {timeout:.0f}s"


def complete(base: str, prompt: str, max_tokens: int, timeout: float = 150) -> tuple[str, int, str]:
    """A greedy completion (not streamed) through the openai client: (text, completion tokens, replica)."""
    import openai

    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=timeout, max_retries=0) as client:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                          temperature=0)
        body = raw.parse()
        return body.choices[0].text, body.usage.completion_tokens, raw.headers.get("x-dsde-replica", "")


def throughput(base: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[float, list[Any]]:
    """Every prompt completed by `concurrency` client threads: (completion tokens per second, the results in order)."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: complete(base, p, max_tokens), prompts, timeout=300))
    return sum(tokens for _, tokens, _ in results) / (time.monotonic() - t0), results
