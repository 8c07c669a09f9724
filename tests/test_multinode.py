"""The service on several Ray nodes (tests/multinode_support.py: Ray's own Cluster on this machine), deployed with
`serve deploy` of deploy/config.yaml (tiny fp32 pair, placement by the nodes' custom resources, one STRICT_SPREAD
placement group per replica) and driven through the `openai` client:

(a) the draft, the target and the controller land on the nodes the config asks for, in the replica's placement
    group; `dsde check-config --address` passes that config against the cluster and names the role and resource of
    one it cannot place;
(c) the node that hosts the draft is lost in the middle of streams: every stream completes, equal to target-only
    (T=0, fp32); Ray restarts the draft on the spare node and speculation resumes;
(d) the node that hosts the target is lost in the middle of streams: each completes exactly after the restart or ends
    with a clear 503; none hangs;
(e) a Locust burst scales the deployment from one replica to two (autoscaling_config), (b) the two share the load
    (streams spread over both, each equal to the single-replica output), and the scale-down drains a replica without
    dropping a stream, its placement group removed with it.

Measured and printed (pytest -s): the time to scale up, the requests lost in (c) and (d), the throughput with one
and with two replicas. The tests run in this order and share one cluster and one application."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.llm import SpeculativeLLM
from dsde_core.models.loader import load_model
from tests.multinode_support import (
    BIN,
    DRAFT_RESOURCE,
    MODEL,
    SLOTS,
    MultiNode,
    Streamed,
    actor_node,
    complete,
    in_threads,
    join_all,
    multinode_cluster,
    placement_groups,
    replica_states,
    serve_config,
    serve_deploy,
    stream_completion,
    throughput,
)
from tests.service_support import free_port, http_get, make_tiny_pair, wait_for

pytest.importorskip("ray.serve")
pytest.importorskip("openai")

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "Once upon a time", "SELECT * FROM",
           "class Stack:", "Hello, world", "# TODO: write tests"]
FIGURES: dict[str, Any] = {}  # what the tests measure, printed at the end of the module
# target_ongoing_requests = max_batch_size (SLOTS); short delays and look-back so the test sees decisions in seconds
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": SLOTS, "upscale_delay_s": 1,
               "downscale_delay_s": 30, "look_back_period_s": 2}
pytestmark = pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_tiny_pair(tmp_path_factory.mktemp("tiny-models-multinode"))


@pytest.fixture(scope="module")
def reference(tiny_models: tuple[Path, Path]) -> Any:
    """dsde_core in-process, target-only: what one replica answers at temperature 0 (it is lossless)."""
    target, draft = tiny_models
    llm = SpeculativeLLM(load_model(str(target), torch.float32), load_model(str(draft), torch.float32),
                         EngineConfig(max_batch_size=1, max_seq_len=256, dtype="float32"), policy="off")
    cache: dict[tuple[str, int], str] = {}

    def text(prompt: str, max_tokens: int) -> str:
        if (prompt, max_tokens) not in cache:
            [res] = llm.generate([prompt], SamplingParams(max_tokens=max_tokens), policy="off")
            cache[prompt, max_tokens] = res.text
        return cache[prompt, max_tokens]

    return text


@pytest.fixture(scope="module")
def mn() -> Iterator[MultiNode]:
    with multinode_cluster() as cluster:
        yield cluster
    if FIGURES:
        print("\nmulti-node figures:\n" + "\n".join(f"  {k}: {v}" for k, v in FIGURES.items() if k[0] != "_"))


@pytest.fixture(scope="module")
def app(mn: MultiNode, tiny_models: tuple[Path, Path]) -> dict[str, Any]:
    """The application deployed with one replica (autoscaling up to one); returns its Serve config (the autoscaling
    tests redeploy it with max_replicas 2)."""
    target, draft = tiny_models
    config = serve_config(free_port(), target, draft, {**AUTOSCALING, "max_replicas": 1})
    t0 = time.monotonic()
    serve_deploy(mn, config)
    wait_for(lambda: replica_states().get("RUNNING") == 1 and _models_answer(_base(config)), 300, interval=2,
             what="the deployed application to answer")
    FIGURES["deploy until it answers"] = f"{time.monotonic() - t0:.0f}s"
    return config


def _base(config: dict[str, Any]) -> str:
    return f"http://127.0.0.1:{config['http_options']['port']}"


def _models_answer(base: str) -> bool:
    code, body = http_get(f"{base}/v1/models", timeout=5)
    return code == 200 and MODEL in body


def _state(base: str) -> dict[str, Any]:
    import json

    code, body = http_get(f"{base}/admin/state", timeout=30)
    assert code == 200, body
    return json.loads(body)


def _node_ids(mn: MultiNode) -> dict[str, str]:
    ids = {"head": mn.cluster.head_node.node_id}
    ids.update({role: node.node_id for role, node in mn.nodes.items()})
    return ids


# ---- (a) placement ----------------------------------------------------------------------------------------------
def test_draft_target_and_controller_land_on_the_nodes_the_config_asks_for(mn: MultiNode, app: dict[str, Any]) -> None:
    state = _state(_base(app))
    actors, nodes = state["actors"], _node_ids(mn)
    assert state["replica"], state
    placed = {role: actor_node(name, actors["namespace"]) for role, name in actors["names"].items()}
    assert placed == {"draft": nodes["draft"], "target": nodes["target"], "controller": nodes["head"]}, (placed, nodes)
    # in the replica's own placement group, one bundle each, spread over three nodes
    group = actors["placement"]
    assert group["strategy"] == "STRICT_SPREAD" and group["bundles"] == {"target": 0, "draft": 1, "controller": 2}
    pg = placement_groups()[group["group_id"]]
    assert pg["state"] == "CREATED" and pg["strategy"] == "STRICT_SPREAD", pg
    assert {pg["nodes"][i] for i in range(3)} == {nodes["target"], nodes["draft"], nodes["head"]}, pg
    assert all(state["workers"][role]["up"] for role in ("draft", "target", "policy")), state["workers"]


def test_check_config_checks_the_placement_against_the_running_cluster(mn: MultiNode, app: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(app))
    res = subprocess.run([str(BIN / "dsde"), "check-config", str(good), "--address", mn.dashboard],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "placement: one replica's actors fit the cluster at" in res.stdout and "(3 nodes)" in res.stdout
    bad_app = yaml.safe_load(yaml.safe_dump(app))
    bad_app["applications"][0]["args"]["draft_resources"] = {"dsde_gpu_draft": 1}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(bad_app))
    res = subprocess.run([str(BIN / "dsde"), "check-config", str(bad), "--address", mn.dashboard],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "the draft asks for dsde_gpu_draft 1 (no node has it)" in res.stderr, res.stderr
    assert DRAFT_RESOURCE not in res.stderr


def _streams_then(base: str, prompts: list[str], max_tokens: int, action: Any) -> tuple[list[Streamed], float]:
    """Stream each prompt in a thread; once every stream has text, run `action`; returns the streams (all ended,
    bounded) and the seconds `action` took."""
    outs = [Streamed(p) for p in prompts]
    threads, _ = in_threads([lambda o=o: stream_completion(base, o.prompt, max_tokens, out=o) for o in outs])
    wait_for(lambda: all(o.first_text.is_set() for o in outs), 120, interval=0.05, what="every stream's first text")
    assert not any(o.ended for o in outs), f"a stream ended before the action: make them longer: {outs}"
    t0 = time.monotonic()
    action()
    took = time.monotonic() - t0
    join_all(threads, 240, "the streams")
    return outs, took


def _exact(outs: list[Streamed], max_tokens: int, reference: Any) -> list[Streamed]:
    """The streams that did not complete with exactly their target-only output: the requests lost."""
    return [o for o in outs if not (o.completed and o.text == reference(o.prompt, max_tokens))]


def _back_on(mn: MultiNode, base: str, role: str, worker: str, since: float, timeout: float = 120) -> float:
    """Wait until the engine reaches `role` again and Ray has it on its (new) node; seconds since `since`."""
    wait_for(lambda: _state(base)["workers"][worker]["up"], timeout, what=f"the {role} to be back")
    actors = _state(base)["actors"]
    wait_for(lambda: actor_node(actors["names"][role], actors["namespace"]) == mn.nodes[role].node_id, timeout,
             what=f"the {role} actor alive on the spare {role} node")
    return time.monotonic() - since


# ---- (c) the draft's node lost -----------------------------------------------------------------------------------
def test_the_draft_node_lost_mid_stream_every_stream_completes_exactly(mn: MultiNode, app: dict[str, Any],
                                                                       reference: Any) -> None:
    from tests.service_support import http_post

    base, prompts, max_tokens = _base(app), PROMPTS[:2], 160  # two streams: the replica's two KV slots
    for p in prompts:
        reference(p, max_tokens)  # before the clock starts
    before = _state(base)
    group = before["actors"]["placement"]["group_id"]
    lost_at: list[float] = []

    def lose_the_draft_node() -> None:
        mn.replace("draft")
        lost_at.append(time.monotonic())

    outs, _ = _streams_then(base, prompts, max_tokens, lose_the_draft_node)
    lost = _exact(outs, max_tokens, reference)
    FIGURES["requests lost, draft node removed"] = f"{len(lost)} of {len(outs)}"
    assert not lost, lost
    back = _back_on(mn, base, "draft", "draft", lost_at[0])
    FIGURES["draft back on the spare node after"] = f"{back:.1f}s"
    after = _state(base)
    assert after["workers"]["draft"]["failures"] > before["workers"]["draft"]["failures"], after["workers"]
    assert after["actors"]["placement"]["group_id"] == group  # the same group: Ray moved the lost bundle
    pg = placement_groups()[group]
    assert pg["state"] == "CREATED" and pg["nodes"][1] == mn.nodes["draft"].node_id, pg
    # speculation resumes on the restarted draft, and stays exact
    code, out = http_post(f"{base}/v1/completions", {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 48,
                                                     "temperature": 0}, timeout=120)
    assert code == 200 and out["speculation"]["drafted"] > 0, out
    assert out["choices"][0]["text"] == reference(PROMPTS[2], 48)


# ---- (d) the target's node lost ----------------------------------------------------------------------------------
def test_the_target_node_lost_mid_stream_requests_complete_or_end_with_503(mn: MultiNode, app: dict[str, Any],
                                                                          reference: Any) -> None:
    base, prompts, max_tokens = _base(app), PROMPTS[2:4], 160
    for p in prompts:
        reference(p, max_tokens)
    before = _state(base)["workers"]["target"]
    lost_at: list[float] = []

    def lose_the_target_node() -> None:
        mn.replace("target")
        lost_at.append(time.monotonic())

    outs, _ = _streams_then(base, prompts, max_tokens, lose_the_target_node)
    lost = _exact(outs, max_tokens, reference)
    FIGURES["requests lost, target node removed"] = f"{len(lost)} of {len(outs)} (worker_wait_s 20)"
    for o in lost:  # none hangs (the join is bounded); one that did not complete ended with a clear 503
        assert o.error is not None and "503" in o.error, o
    for o in outs:
        if o not in lost:
            assert o.text == reference(o.prompt, max_tokens)
    back = _back_on(mn, base, "target", "target", lost_at[0])
    FIGURES["target back on the spare node after"] = f"{back:.1f}s"
    after = _state(base)["workers"]["target"]
    assert after["failures"] > before["failures"] and after["recoveries"] > before["recoveries"], after
    text, tokens, _ = complete(base, PROMPTS[4], 24)
    assert tokens == 24 and text == reference(PROMPTS[4], 24)


# ---- throughput with one replica, the baseline of (b) -------------------------------------------------------------
LOAD_TOKENS, LOAD_CONCURRENCY = 48, 4


def test_one_replica_answers_the_load_exactly(app: dict[str, Any], reference: Any) -> None:
    for p in PROMPTS:
        reference(p, LOAD_TOKENS)
    rate, results = throughput(_base(app), PROMPTS, LOAD_TOKENS, LOAD_CONCURRENCY)
    assert [text for text, _, _ in results] == [reference(p, LOAD_TOKENS) for p in PROMPTS]
    assert len({replica for _, _, replica in results}) == 1
    FIGURES["throughput, 1 replica"] = f"{rate:.1f} tok/s"
    FIGURES["_rate1"] = rate


# ---- (e) and (b): autoscaling -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def autoscaled(mn: MultiNode, app: dict[str, Any]) -> dict[str, Any]:
    """The same application with max_replicas 2: a change of autoscaling numbers only, which Serve applies to the
    running replica without restarting it (adding or removing an autoscaling_config would: its policy is part of
    Serve's code version)."""
    started = json_get(_base(app), "/health")["started"]
    config = yaml.safe_load(yaml.safe_dump(app))
    [deployment] = config["applications"][0]["deployments"]
    deployment["autoscaling_config"] = AUTOSCALING
    serve_deploy(mn, config)
    wait_for(lambda: _autoscaling_applied(), 60, interval=1, what="the autoscaling config to apply")
    assert json_get(_base(config), "/health")["started"] == started, "the redeploy replaced the replica"
    return config


def json_get(base: str, path: str) -> dict[str, Any]:
    import json

    code, body = http_get(f"{base}{path}", timeout=30)
    assert code == 200, body
    return json.loads(body)


def _autoscaling_applied() -> bool:
    from ray import serve

    app = serve.status().applications.get("dsde")
    return app is not None and app.status == "RUNNING" and replica_states() == {"RUNNING": 1}


@pytest.fixture(scope="module")
def scaled_up(mn: MultiNode, autoscaled: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small Locust burst (its command line: 6 users streaming short completions) until Serve runs a second
    replica; returns the seconds to Serve's decision and to the new replica RUNNING, and Locust's counts."""
    from tests.ops_support import locust_command, read_csv

    base = _base(autoscaled)
    prefix = tmp_path_factory.mktemp("locust") / "burst"
    cmd = ["nice", "-n", "10", *locust_command(
        base, prefix, "--users", "6", "--spawn-rate", "6", "--run-time", "150s", "--stop-timeout", "60",
        "--short-tokens", "32", "--long-tokens", "64", "--long-fraction", "0.25", "--prompts-per-workload", "4",
        "--max-prompt-chars", "400", "--model", MODEL)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    decided = ready = None
    try:
        deadline = t0 + 150
        while time.monotonic() < deadline and proc.poll() is None:
            states = replica_states()
            if decided is None and sum(states.values()) > 1:
                decided = time.monotonic() - t0
            if states.get("RUNNING", 0) >= 2:
                ready = time.monotonic() - t0
                break
            time.sleep(0.25)
    finally:
        if proc.poll() is None:
            proc.terminate()  # Locust stops its users, lets each finish its request (--stop-timeout), writes its CSV
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate(timeout=30)[0] + "\n(locust did not stop within 120s of SIGTERM: killed)"
    assert ready is not None, f"no second replica within 150s of the burst: {replica_states()}; locust: {out[-3000:]}"
    stats = {(r["Type"], r["Name"]): r for r in read_csv(Path(f"{prefix}_stats.csv"))}
    failures = read_csv(Path(f"{prefix}_failures.csv"))
    FIGURES["scale-up: decided after"] = f"{decided:.1f}s"
    FIGURES["scale-up: second replica RUNNING after"] = f"{ready:.1f}s"
    return {"decided": decided, "ready": ready, "failures": failures, "requests": int(stats[("", "Aggregated")][
        "Request Count"]), "failed": int(stats[("", "Aggregated")]["Failure Count"]), "locust": out}


def test_a_burst_scales_up_to_a_second_replica_without_a_failed_request(scaled_up: dict[str, Any]) -> None:
    assert scaled_up["decided"] is not None and scaled_up["decided"] <= scaled_up["ready"]
    assert scaled_up["failures"] == [] and scaled_up["failed"] == 0, scaled_up["locust"][-3000:]
    assert scaled_up["requests"] > 0
    groups = [pg for pg in placement_groups().values() if pg["name"].startswith("dsde-") and pg["state"] == "CREATED"]
    assert len(groups) == 2, groups  # each replica reserved its own group


def test_two_replicas_share_the_load_and_answer_exactly(autoscaled: dict[str, Any], scaled_up: dict[str, Any],
                                                        reference: Any) -> None:
    assert replica_states().get("RUNNING") == 2, replica_states()
    rate, results = throughput(_base(autoscaled), PROMPTS, LOAD_TOKENS, LOAD_CONCURRENCY)
    assert [text for text, _, _ in results] == [reference(p, LOAD_TOKENS) for p in PROMPTS]
    served = {replica for _, _, replica in results}
    assert len(served) == 2 and "" not in served, served  # both replicas took requests
    FIGURES["throughput, 2 replicas"] = f"{rate:.1f} tok/s"
    if "_rate1" in FIGURES:
        FIGURES["throughput, 2 / 1 replicas"] = f"{rate / FIGURES['_rate1']:.2f}x"


def test_scale_down_drains_a_replica_without_dropping_a_stream(mn: MultiNode, autoscaled: dict[str, Any],
                                                               scaled_up: dict[str, Any], reference: Any) -> None:
    """Two lanes of back-to-back streams (2 ongoing requests: one replica's target) until Serve has stopped the second
    replica: every stream completes exactly, also those the stopping replica was serving."""
    import threading

    base, max_tokens = _base(autoscaled), 96
    for p in PROMPTS:
        reference(p, max_tokens)
    stop, outs, lock = threading.Event(), [], threading.Lock()

    def lane(k: int) -> None:
        i = k
        while not stop.is_set():
            o = stream_completion(base, PROMPTS[i % len(PROMPTS)], max_tokens)
            with lock:
                outs.append(o)
            i += 2

    threads, _ = in_threads([lambda k=k: lane(k) for k in range(2)])
    stopping = None
    try:
        deadline = time.monotonic() + AUTOSCALING["downscale_delay_s"] + 120
        while time.monotonic() < deadline:
            states = replica_states()
            if stopping is None and states.get("RUNNING", 0) < 2:
                stopping = time.monotonic()
            if stopping is not None and states == {"RUNNING": 1}:
                break
            time.sleep(0.25)
        assert replica_states() == {"RUNNING": 1}, f"no scale-down within the deadline: {replica_states()}"
        time.sleep(2)  # a stream or two on the remaining replica after the other is gone
    finally:
        stop.set()
        join_all(threads, 200, "the lanes")
    remaining = json_get(base, "/admin/state")["replica"]
    gone = {o.replica for o in outs} - {remaining}
    lost = _exact(outs, max_tokens, reference)
    drained = [o for o in outs if o.replica in gone and o.started < stopping < o.ended]
    FIGURES["scale-down: streams lost"] = f"{len(lost)} of {len(outs)} ({len(drained)} drained from the replica " \
                                          f"stopped)"
    assert not lost, lost
    assert len(gone) == 1, ({o.replica for o in outs}, remaining)
    assert drained, "no stream was on the stopped replica when it began to stop"
    # the stopped replica's actors and placement group went with it
    groups = [pg for pg in placement_groups().values() if pg["name"].startswith("dsde-") and pg["state"] == "CREATED"]
    assert len(groups) == 1, groups
    assert json_get(base, "/admin/state")["actors"]["placement"]["group_id"] in placement_groups()
