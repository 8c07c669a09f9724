"""The reliability pieces of the service without a Ray cluster: the request timeout, the request guard (API key,
body size), the proxies' translation of Ray's failures, the new config bounds and request bounds, and an idle
engine bringing a failed worker back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import Request
from pydantic import ValidationError

from dsde_core.async_engine import AsyncEngine
from dsde_core.config import SamplingParams
from dsde_core.errors import ConfigError, WorkerStateLost, WorkerUnavailable
from dsde_core.request import RequestOutput
from services.app import deployment_options
from services.config import ServiceConfig
from services.protocol import CompletionRequest
from tests.test_engine_recovery import Flaky, _engine

pytest.importorskip("ray")


# ---- the request timeout ------------------------------------------------------------------------------------
def test_with_deadline_ends_a_slow_request_with_a_timeout_error_and_closes_it() -> None:
    from services.ingress import with_deadline

    closed: list[bool] = []

    async def slow() -> AsyncIterator[RequestOutput]:
        try:
            yield RequestOutput("r", [1], "a")
            await asyncio.sleep(30)
            yield RequestOutput("r", [2], "b", True, "length")
        finally:
            closed.append(True)  # AsyncEngine's generator cancels its request here

    async def main() -> list[RequestOutput]:
        return [o async for o in with_deadline(slow(), 0.2, "r")]

    t0 = time.perf_counter()
    outs = asyncio.run(main())
    assert time.perf_counter() - t0 < 5
    assert [o.text for o in outs] == ["a", ""] and closed == [True]
    last = outs[-1]
    assert last.finished and last.finish_reason == "error" and last.error_type == "timeout"
    assert "within 0.2s" in last.error

    async def quick() -> AsyncIterator[RequestOutput]:
        yield RequestOutput("q", [1], "x", True, "stop")

    async def main2() -> list[RequestOutput]:
        return [o async for o in with_deadline(quick(), None, "q")]

    assert [o.finish_reason for o in asyncio.run(main2())] == ["stop"]


# ---- the request guard -------------------------------------------------------------------------------------
@pytest.fixture
def guarded() -> Any:
    """A small FastAPI app behind services.ingress.RequestGuard, driven in-process."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from services import ingress

    app = FastAPI()
    app.add_middleware(ingress.RequestGuard)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    saved = dict(ingress._guard)
    ingress._guard.update(api_key="k1", max_bytes=2048)
    try:
        yield TestClient(app)
    finally:
        ingress._guard.clear()
        ingress._guard.update(saved)


def test_guard_wants_the_bearer_key_everywhere_but_health(guarded: Any) -> None:
    assert guarded.get("/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer k2"}, {"Authorization": "k1"}, {"Authorization": "Bearer k1 "}):
        r = guarded.post("/echo", content=b"{}", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    assert guarded.get("/nowhere").status_code == 401
    r = guarded.post("/echo", content=b"x" * 100, headers={"Authorization": "Bearer k1"})
    assert r.status_code == 200 and r.json() == {"bytes": 100}  # the body read by the guard is replayed whole


def test_guard_refuses_bodies_over_the_limit_with_and_without_content_length(guarded: Any) -> None:
    auth = {"Authorization": "Bearer k1"}
    r = guarded.post("/echo", content=b"x" * 2049, headers=auth)
    assert r.status_code == 413 and "2048 bytes" in r.json()["error"]["message"]
    r = guarded.post("/echo", content=iter([b"x" * 1500, b"x" * 1500]), headers=auth)  # chunked: no Content-Length
    assert r.status_code == 413
    r = guarded.post("/echo", content=iter([b"x" * 1000, b"x" * 1000]), headers=auth)
    assert r.status_code == 200 and r.json() == {"bytes": 2000}
    r = guarded.post("/echo", content=b"{}", headers={**auth, "Content-Length": "abc"})
    assert r.status_code == 400


# ---- the proxies -------------------------------------------------------------------------------------------
def test_proxies_translate_ray_failures_into_worker_unavailable() -> None:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

    from services.proxies import translate

    for exc in (ActorDiedError(), ActorUnavailableError("the actor is restarting", None)):
        out = translate("target", exc)
        assert isinstance(out, WorkerUnavailable) and out.role == "target"
        assert str(out).startswith("the target is unavailable: " + type(exc).__name__)
    lost = WorkerStateLost("draft", "slot 3 is not open here")
    out = translate("draft", RayTaskError("propose", "traceback", lost).as_instanceof_cause())
    assert out is lost and out.role == "draft"
    bug = RayTaskError("verify", "traceback", ValueError("a bug")).as_instanceof_cause()
    assert translate("target", bug) is bug  # a bug in a worker is not an outage: a fault (the next test)


def test_a_fault_raised_in_the_draft_actor_leaves_requests_target_only() -> None:
    """What a propose that raised inside the draft actor looks like after services.proxies (Ray's RayTaskError,
    re-raised as itself): a fault; the requests complete target-only and the draft is tried again."""
    from ray.exceptions import RayTaskError

    engine, parties = _engine()
    draft: Flaky = parties["draft"]
    draft.fault_at = ("propose", 2)
    remote_traceback = "Traceback (most recent call last):\n  File ...\nMemoryError: out of memory\n"
    draft.error = lambda name: RayTaskError(name, remote_traceback, MemoryError("out of memory")).as_instanceof_cause()
    reqs = [engine.add_request([1, 2, 3, 4 + i], SamplingParams(max_tokens=24)) for i in range(4)]
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        engine.step()
    assert all(r.finish_reason == "length" and len(r.output_ids) == 24 for r in reqs)
    h = engine.health["draft"]
    assert h.faults == h.failures == h.recoveries == 1
    assert h.last_error == "RayTaskError(MemoryError): MemoryError: out of memory"


def test_worker_errors_survive_pickling() -> None:
    import pickle

    e = pickle.loads(pickle.dumps(WorkerStateLost("target", "slot 1 is not open here")))
    assert type(e) is WorkerStateLost and e.role == "target" and str(e) == "the target is unavailable: slot 1 " \
                                                                           "is not open here"


# ---- configuration and request bounds ----------------------------------------------------------------------
def test_service_config_reliability_fields() -> None:
    cfg = ServiceConfig(max_batch_size=4, max_queue=10, worker_wait_s=5, graceful_shutdown_timeout_s=12, api_key="")
    assert cfg.api_key is None and cfg.engine_config().worker_wait_s == 5
    assert "api_key" not in repr(ServiceConfig(api_key="secret")) and "secret" not in repr(ServiceConfig(api_key="s"))
    opts = deployment_options(cfg)
    assert opts["max_ongoing_requests"] > 14 and opts["graceful_shutdown_timeout_s"] == 12
    for bad, word in [({"max_queue": -1}, "max_queue"), ({"actor_max_restarts": -2}, "actor_max_restarts"),
                      ({"worker_wait_s": 0}, "worker_wait_s"), ({"request_timeout_s": 0}, "request_timeout_s"),
                      ({"max_request_bytes": 10}, "max_request_bytes"), ({"retry_after_s": -1}, "retry_after_s")]:
        with pytest.raises(ConfigError, match=word):
            ServiceConfig.from_args(bad)


def test_request_bounds_on_stop_and_tiny_temperatures() -> None:
    with pytest.raises(ValidationError, match="256 characters"):
        CompletionRequest(model="m", prompt="p", stop="x" * 257)
    with pytest.raises(ValidationError, match="at most 16"):
        CompletionRequest(model="m", prompt="p", stop=["a"] * 17)
    assert CompletionRequest(model="m", prompt="p", temperature=1e-30).sampling(4).temperature == 0.0
    assert CompletionRequest(model="m", prompt="p", temperature=0.5).sampling(4).temperature == 0.5


# ---- an idle engine brings a failed worker back --------------------------------------------------------------
def test_an_idle_async_engine_still_probes_a_failed_worker() -> None:
    engine, parties = _engine()
    draft: Flaky = parties["draft"]
    draft.kill_at = ("propose", 2)
    aeng = AsyncEngine(engine).start()
    try:
        async def run() -> list[RequestOutput]:
            return [o async for o in aeng.generate([1, 2, 3, 4], SamplingParams(max_tokens=20))]

        outs = asyncio.run(run())
        assert outs[-1].finish_reason == "length" and engine.health["draft"].down
        draft.restart()  # comes back while no request runs
        deadline = time.monotonic() + 10
        while engine.health["draft"].down and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.health["draft"].down and not engine.health["draft"].pending
        assert draft.num_open() == 0
    finally:
        aeng.stop()


# ---- what the fuzzing found --------------------------------------------------------------------------------
def test_the_step_cost_model_stays_finite_under_a_steady_load() -> None:
    """A steady batch never varies some features: without a bound, RLS with forgetting let its covariance grow as
    0.98^-n and overflow after ~10^4 steps, and the engine's next plan failed every running request."""
    import math

    from dsde_core.cost import OnlineCostModel

    model = OnlineCostModel()
    for _ in range(20_000):
        model.observe(4, 0.05, 3, 3, 0.01)
    est = model.estimate(1)
    assert all(math.isfinite(v) for v in (est.verify_s, est.verify_per_token_s, est.draft_fwd_s,
                                          est.draft_per_token_s))
    assert 0 < est.step_s([3]) < 1  # no overflow, no nonsense


def test_the_schema_states_the_served_model_the_context_window_and_the_vocabulary() -> None:
    """schemathesis sent bodies the schema allowed and the replica refused: /v1/completions' token ids past the
    vocabulary and max_tokens past the context window (400, 176 of 178), /tokenize's and /detokenize's unknown models
    (404). The schema states this replica's name and limits now."""
    from services.ingress import app, configure_guard

    def props(schema: dict[str, Any], name: str) -> dict[str, Any]:
        return schema["components"]["schemas"][name]["properties"]

    def ints(prop: dict[str, Any]) -> list[tuple[float, float]]:  # (minimum, maximum) of every integer in it
        found = [(prop.get("minimum"), prop.get("maximum"))] if prop.get("type") == "integer" else []
        subs = prop.get("anyOf", []) + ([prop["items"]] if isinstance(prop.get("items"), dict) else [])
        return found + [b for sub in subs for b in ints(sub)]

    try:
        configure_guard(None, 1 << 20, "served", max_seq_len=64, vocab_size=100)
        schema = app.openapi()
        comp, chat = props(schema, "CompletionRequest"), props(schema, "ChatCompletionRequest")
        for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
            assert props(schema, name)["model"]["enum"] == ["served"], name
        path = schema["paths"]["/v1/models/{model}"]["get"]["parameters"]
        assert [p["schema"]["enum"] for p in path if p["name"] == "model"] == [["served"]]
        assert ints(comp["max_tokens"]) == [(1, 63)] and ints(chat["max_completion_tokens"]) == [(1, 63)]
        assert ints(comp["prompt"]) == [(0, 99), (0, 99)]  # list[int] and list[list[int]]
        assert ints(props(schema, "DetokenizeRequest")["tokens"]) == [(0, 99)]
        assert ints(chat["stop_token_ids"]) == [(0, 99)]
        configure_guard(None, 1 << 20)  # a replica that has not started its model: the static models' bounds
        bare = props(app.openapi(), "CompletionRequest")
        assert "enum" not in bare["model"] and ints(bare["max_tokens"]) == [(1, 1 << 20)]
        assert ints(bare["prompt"]) == [(None, None), (None, None)]
    finally:
        configure_guard(None, 1 << 20)


def test_the_tokenize_schema_accepts_exactly_the_bodies_the_endpoint_accepts() -> None:
    """/tokenize takes a prompt or messages, not both and not neither: its schema's oneOf says what its validator
    checks (schemathesis' bodies were mostly refused while the schema allowed both and neither)."""
    from services.protocol import TokenizeRequest, describe_invalid
    from tests.service_support import schema_verdicts

    msgs = [{"role": "user", "content": "hi"}]
    bodies = [{"prompt": "hi"}, {"messages": msgs}, {"prompt": "hi", "messages": None},
              {"prompt": None, "messages": msgs}, {}, {"prompt": "hi", "messages": msgs}, {"prompt": None},
              {"prompt": None, "messages": None}]
    assert sum(schema_verdicts(TokenizeRequest, [{"model": "m", **b} for b in bodies])) == 4
    for body, param in (({}, "prompt"), ({"prompt": "hi", "messages": msgs}, "messages")):  # the error's `param`
        with pytest.raises(ValidationError) as e:
            TokenizeRequest(model="m", **body)
        assert describe_invalid(e.value.errors()) == ("give either prompt or messages", param)


def test_the_completions_schema_accepts_the_integers_and_stops_the_body_accepts_and_no_empty_prompt() -> None:
    """schemathesis' /v1/completions bodies were mostly refused (CI, 2026-12-01): it writes JSON Schema integers as
    27.0, which the strict body refused, and the schema allowed the empty prompts the engine refuses. The body takes
    integral numbers as integers now, and the schema states no prompt may be empty."""
    import jsonschema

    from services.protocol import CompletionRequest
    from tests.service_support import schema_verdicts

    stops = [("a", True), ("", False), ([], True), (["a", "b"], True), (["a", ""], False), (["x"] * 16, True),
             (["x"] * 17, False), ("x" * 256, True), ("x" * 257, False)]
    ints = [({"max_tokens": v}, ok) for v, ok in ((12, True), (12.0, True), (12.5, False), (True, False),
                                                  ("12", False), (0.0, False))]
    ints += [({"prompt": [5.0, 7]}, True), ({"prompt": [1.5]}, False), ({"prompt": [[1.0], [2, 3.0]]}, True),
             ({"n": 2.0}, True)]
    cases = [({"stop": stop}, ok) for stop, ok in stops] + ints
    bodies = [{"model": "m", "prompt": "hi", **body} for body, _ in cases]
    assert schema_verdicts(CompletionRequest, bodies) == [ok for _, ok in cases]
    schema = jsonschema.Draft202012Validator(CompletionRequest.model_json_schema())
    for empty in ("", [], [""], ["a", ""], [[]], [[1], []]):  # the body passes them on; Engine.validate refuses them
        assert not schema.is_valid({"model": "m", "prompt": empty}), empty
        assert CompletionRequest(model="m", prompt=empty).prompts()
    assert schema.is_valid({"model": "m", "prompt": ["a", "b"]}) and schema.is_valid({"model": "m", "prompt": [1]})


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token() -> None:
    import torch

    from tests.reference_sampling import target_probs

    logits = torch.tensor([[1.0, 3.0, 2.0]])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=5e-324))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0]]))


# ---- no remote code ------------------------------------------------------------------------------------------
def test_a_model_directory_with_remote_code_never_runs_it(save_tiny_model, tmp_path) -> None:
    """A config naming custom code (auto_map) next to a modeling file that would leave a marker when imported: the
    loader either loads the standard architecture or refuses, and the file is never executed."""
    import json as _json

    import torch

    from dsde_core.errors import DSDEError
    from dsde_core.models.loader import load_model

    path = save_tiny_model("remote")
    marker = tmp_path / "remote-code-ran"
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import Qwen2Config as EvilConfig\n"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py"):
        (path / name).write_text(code)
    config = _json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (path / "config.json").write_text(_json.dumps(config))
    tok = path / "tokenizer_config.json"
    tok.write_text(_json.dumps({**_json.loads(tok.read_text()),
                                "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    try:
        loaded = load_model(str(path), dtype=torch.float32)
    except (DSDEError, ValueError, OSError):
        loaded = None  # refusing is fine
    assert not marker.exists(), "remote code from the model directory was executed"
    if loaded is not None:
        assert type(loaded.model).__module__.startswith("dsde_core")


def test_every_from_pretrained_of_the_service_passes_trust_remote_code_false() -> None:
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    calls = 0
    for path in [*(root / "dsde_core").rglob("*.py"), *(root / "services").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "from_pretrained":
                calls += 1
                kw = {k.arg: k.value for k in node.keywords}
                assert "trust_remote_code" in kw and getattr(kw["trust_remote_code"], "value", None) is False, \
                    f"{path}:{node.lineno}"
    assert calls >= 4


def test_model_actors_get_a_bounded_onednn_cache() -> None:
    from services.placement import model_env

    assert model_env(ServiceConfig()) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}
    assert model_env(ServiceConfig(onednn_cache_capacity=None)) == {}
    with pytest.raises(ConfigError, match="onednn_cache_capacity"):
        ServiceConfig(onednn_cache_capacity=-1)
