"""The streaming HTTP client against a fake OpenAI-compatible server (httpx.MockTransport)."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from dsde_bench.serve_client import ServeConfig, arrival_times, chunk_text, request_body, run_serve_sync
from dsde_bench.workloads import Prompt
from dsde_core.errors import ConfigError

PROMPTS = [Prompt("code", f"p{i}", f"write function {i}") for i in range(5)]


def _sse(objs: list[dict]) -> bytes:
    return "".join(f"data: {json.dumps(o)}\n\n" for o in objs).encode() + b"data: [DONE]\n\n"


def _events(objs: list[dict]) -> bytes:
    """The Responses API's framing: each event named, no [DONE]."""
    return "".join(f"event: {o['type']}\ndata: {json.dumps(o)}\n\n" for o in objs).encode()


def responses_stream(pieces: list[str], usage: bool, end: str | None = "response.incomplete") -> bytes:
    """A /v1/responses stream as OpenAI's (and this server's) events: text deltas, then `end` with the response."""
    events: list[dict] = [{"type": "response.created", "response": {"status": "in_progress"}}]
    events += [{"type": "response.output_text.delta", "delta": p} for p in pieces]
    response = {"status": "incomplete", "speculation": {"drafted": 8, "accepted": 6, "mean_sl": 4.0}}
    if usage:
        response["usage"] = {"input_tokens": 7, "output_tokens": 9, "total_tokens": 16}
    if end == "response.failed":
        response = {"status": "failed", "error": {"code": "unavailable", "message": "the target is down"}}
        events.append({"type": "error", "code": "unavailable", "message": "the target is down"})
    return _events(events + ([{"type": end, "response": response}] if end else []))


def fake_server(seen: list[dict], fail_on: str | None = None, usage: bool = True, key: str | None = None,
                end: str | None = "response.incomplete"):
    def handler(request: httpx.Request) -> httpx.Response:
        if key is not None and request.headers.get("authorization") != f"Bearer {key}":
            return httpx.Response(401, json={"error": {"message": "bad key", "type": "authentication_error"}})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        seen.append({"path": request.url.path, **body})
        text = body["messages"][0]["content"] if "messages" in body else body.get("prompt", body.get("input"))
        if fail_on and fail_on in text:
            return httpx.Response(400, json={"error": {"message": "bad", "type": "invalid_request_error"}})
        chat = request.url.path.endswith("chat/completions")
        pieces = ["def ", "f(x):", "\n    return x"]
        if request.url.path == "/v1/responses":
            return httpx.Response(200, content=responses_stream(pieces, usage, end),
                                  headers={"content-type": "text/event-stream"})
        chunks: list[dict] = []
        if chat:
            chunks.append({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for p in pieces:
            chunks.append({"choices": [{"index": 0, "delta": {"content": p}}]} if chat else
                          {"choices": [{"index": 0, "text": p}]})
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                       "speculation": {"drafted": 8, "accepted": 6, "mean_sl": 4.0}})
        if usage:
            chunks.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}})
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
def test_streams_and_reports_vllm_names(api: str) -> None:
    seen: list[dict] = []
    cfg = ServeConfig(url="http://fake:8000", api=api, max_tokens=9, concurrency=2)
    res = run_serve_sync(PROMPTS, cfg, transport=fake_server(seen))
    m = res["metrics"]
    assert res["model"] == "fake-model" and m["completed"] == 5 and m["failed"] == 0
    assert m["total_output_tokens"] == 45 and m["total_input_tokens"] == 35
    assert res["token_counts"] == "server usage"
    assert m["acceptance_rate"] == pytest.approx(0.75) and m["mean_sl"] == pytest.approx(4.0)
    for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p90_itl_ms", "mean_e2el_ms", "p50_e2el_ms",
                "mean_tpot_ms", "request_throughput", "output_throughput"):
        assert key in m and not math.isnan(m[key])
    assert all(r["chunks"] == 3 for r in res["requests"])  # the empty role chunk is not a token
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}[api]
    bound = "max_output_tokens" if api == "responses" else "max_tokens"
    assert all(s["path"] == path and s["stream"] and s[bound] == 9 and s["model"] == "fake-model" for s in seen)
    assert all(("messages" in s) == (api == "chat") and ("input" in s) == (api == "responses") for s in seen)
    assert all(("stream_options" in s) == (api != "responses") for s in seen)  # OpenAI's Responses API has none


def test_failed_requests_are_counted_not_raised() -> None:
    cfg = ServeConfig(url="http://fake:8000", model="fake-model")
    res = run_serve_sync(PROMPTS, cfg, transport=fake_server([], fail_on="function 3"))
    assert res["metrics"]["completed"] == 4 and res["metrics"]["failed"] == 1
    assert "HTTP 400" in res["errors"][0]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_without_usage_chunks_are_counted(api: str) -> None:
    cfg = ServeConfig(url="http://fake:8000", model="fake-model", api=api)
    res = run_serve_sync(PROMPTS[:2], cfg, transport=fake_server([], usage=False))
    assert res["metrics"]["total_output_tokens"] == 6 and "content chunks" in res["token_counts"]


@pytest.mark.parametrize(("end", "says"), [("response.failed", "the target is down"),
                                           (None, "the stream ended before its final event")])
def test_a_responses_stream_that_fails_or_stops_short_is_a_failed_request(end: str | None, says: str) -> None:
    cfg = ServeConfig(url="http://fake:8000", model="fake-model", api="responses")
    res = run_serve_sync(PROMPTS[:2], cfg, transport=fake_server([], end=end))
    assert res["metrics"]["completed"] == 0 and res["metrics"]["failed"] == 2 and says in res["errors"][0]


def test_poisson_arrivals() -> None:
    a = arrival_times(200, 4.0, seed=1)
    assert a == arrival_times(200, 4.0, seed=1) and a[0] == 0.0 and a == sorted(a)
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert 0.15 < sum(gaps) / len(gaps) < 0.35  # mean 1 / rate = 0.25
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]


def test_config_and_bodies() -> None:
    with pytest.raises(ConfigError):
        ServeConfig(url="localhost:8000")
    with pytest.raises(ConfigError):
        ServeConfig(url="http://x", request_rate=0)
    with pytest.raises(ConfigError, match="api must be one of 'chat', 'completions', 'responses', got 'embeddings'"):
        ServeConfig(url="http://x", api="embeddings")
    b = request_body(ServeConfig(url="http://x", api="completions", temperature=1.0), "m", "hi", 3)
    assert b["prompt"] == "hi" and b["temperature"] == 1.0 and b["stream_options"] == {"include_usage": True}
    assert chunk_text({"choices": [{"delta": {"content": "a"}}]}) == "a"
    assert chunk_text({"choices": [{"text": "b"}]}) == "b" and chunk_text({"choices": []}) == ""
    assert chunk_text({"type": "response.output_text.delta", "delta": "c"}) == "c"
    b = request_body(ServeConfig(url="http://x", api="responses"), "m", "hi", 3)
    assert b == {"model": "m", "temperature": 0.0, "stream": True, "seed": 3, "input": "hi", "max_output_tokens": 64}


def test_free_port_hands_out_distinct_bindable_ports_outside_the_ephemeral_range() -> None:
    import socket

    from dsde_bench.ports import _ephemeral_low, free_port

    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(20000 <= p < max(_ephemeral_low(), 22000) for p in ports)
    with socket.socket() as s:  # the port is free: a server can bind it
        s.bind(("127.0.0.1", ports[0]))


def test_an_api_key_goes_as_a_bearer_token_and_never_into_the_results() -> None:
    seen: list[dict] = []
    cfg = ServeConfig(url="http://fake:8000", api_key="s3cret")
    res = run_serve_sync(PROMPTS[:2], cfg, transport=fake_server(seen, key="s3cret"))
    assert res["metrics"]["completed"] == 2 and len(seen) == 2  # every request, and /v1/models, passed the check
    assert "s3cret" not in json.dumps(res) and "s3cret" not in repr(cfg)
    with pytest.raises(ConfigError, match="answered 401: the server wants an API key; pass --api-key"):
        run_serve_sync(PROMPTS[:1], ServeConfig(url="http://fake:8000"), transport=fake_server([], key="s3cret"))


def test_a_model_the_server_does_not_serve_is_a_clear_error_before_any_request() -> None:
    seen: list[dict] = []
    with pytest.raises(ConfigError, match=r"--model 'nope': the server serves 'fake-model' \(http://fake:8000/v1/"):
        run_serve_sync(PROMPTS[:2], ServeConfig(url="http://fake:8000", model="nope"), transport=fake_server(seen))
    assert seen == []  # nothing sent
    res = run_serve_sync(PROMPTS[:1], ServeConfig(url="http://fake:8000", model="fake-model"),
                         transport=fake_server(seen))
    assert res["model"] == "fake-model" and res["metrics"]["completed"] == 1

    def no_model_list(request: httpx.Request) -> httpx.Response:  # a server without /v1/models takes --model as given
        if request.url.path == "/v1/models":
            return httpx.Response(404, json={"error": {"message": "not found"}})
        return fake_server(seen).handle_request(request)

    res = run_serve_sync(PROMPTS[:1], ServeConfig(url="http://fake:8000", model="mine"),
                         transport=httpx.MockTransport(no_model_list))
    assert res["model"] == "mine" and res["metrics"]["completed"] == 1


def test_a_run_where_no_request_completed_exits_non_zero(tmp_path, capsys, monkeypatch) -> None:
    from dsde_bench import serve_client
    from dsde_cli import bench as cli

    real = serve_client.run_serve_sync

    def failing(prompts, cfg, transport=None):
        return real(prompts, cfg, transport=fake_server([], fail_on=" "))  # every prompt has a space: all 400

    monkeypatch.setattr(serve_client, "run_serve_sync", failing)
    rc = cli.main(["--url", "http://fake:8000", "--num-prompts", "1", "--workloads", "code", "--out",
                   str(tmp_path / "s.json"), "--no-report"])
    err = capsys.readouterr().err
    assert rc == 1 and "error: no request completed; the first error: HTTP 400" in err, err
    assert json.loads((tmp_path / "s.json").read_text())["runs"][0]["errors"]  # the errors are kept


def test_a_server_that_is_not_there_is_a_clear_error(tmp_path, capsys) -> None:
    from dsde_bench.ports import free_port
    from dsde_cli import bench as cli

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("All connection attempts failed", request=request)

    with pytest.raises(ConfigError, match=r"cannot reach http://fake:8000 \(ConnectError: All connection attempts "
                                          r"failed\); is the server running\?"):
        run_serve_sync(PROMPTS[:1], ServeConfig(url="http://fake:8000"), transport=httpx.MockTransport(refuse))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rc = cli.main(["--url", url, "--num-prompts", "1", "--results-dir", str(tmp_path), "--no-report"])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot reach {url}" in err and "Traceback" not in err, err
    rc = cli.main(["--simulate", "--tiny", "--api-key", "k", "--results-dir", str(tmp_path), "--no-report"])
    assert rc == 2 and "--api-key does not apply to --simulate: only --url reads it" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
