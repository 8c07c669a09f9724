"""Server mode: the workloads against an OpenAI-compatible HTTP server, streaming, at a fixed concurrency or a
Poisson request rate; figures named as `vllm bench serve` names them (see metrics.serve_metrics).

    dsde bench --url http://127.0.0.1:8000 --workloads mixed --num-prompts 32 --concurrency 4
    dsde bench --url http://127.0.0.1:8000 --request-rate 0.5 --max-concurrency 8

Each request is one streamed `/v1/chat/completions` (default; the server applies the chat template) or
`/v1/completions` call with model, messages|prompt, max_tokens, temperature, stream=true and
stream_options.include_usage (token counts come from the final usage chunk; when a server sends none, content
chunks are counted instead and the result says so), or (`--api responses`) a streamed `/v1/responses` call with
model, input, max_output_tokens and temperature (its text in `response.output_text.delta` events, its usage in
the final `response.completed` or `response.incomplete` event; an `error` or `response.failed` event fails it).
TTFT is measured to the first chunk that carries text; ITL is the gap between consecutive text chunks (one
speculative step streams several tokens in one chunk).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dsde_bench.metrics import DEFAULT_PERCENTILES, StreamRecord, serve_metrics
from dsde_bench.workloads import Prompt
from dsde_core.errors import ConfigError

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}
RESPONSE_ENDS = ("response.completed", "response.incomplete")  # the Responses API's last event, with the usage


@dataclass(frozen=True)
class ServeConfig:
    url: str
    api: str = "chat"  # "chat": /v1/chat/completions, "completions": /v1/completions, "responses": /v1/responses
    model: str | None = None  # None: the first model of GET /v1/models
    max_tokens: int = 64
    temperature: float = 0.0
    concurrency: int | None = 1  # requests in flight (vllm: --max-concurrency); None: unbounded
    request_rate: float = math.inf  # requests per second, Poisson arrivals; inf: all at once (bounded by concurrency)
    seed: int = 0
    timeout_s: float = 600.0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token; never written to the results

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.api not in ENDPOINTS:
            raise ConfigError(f"api must be one of {', '.join(map(repr, ENDPOINTS))}, got {self.api!r}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ConfigError(f"request_rate must be > 0 (inf: no pacing), got {self.request_rate}")
        if not all(0 <= q <= 100 for q in self.percentiles):
            raise ConfigError(f"percentiles must be in [0, 100], got {self.percentiles}")

    @property
    def endpoint(self) -> str:
        return ENDPOINTS[self.api]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of n Poisson arrivals at `rate` per second (all 0 for an infinite rate)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def request_body(cfg: ServeConfig, model: str, text: str, seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "temperature": cfg.temperature, "stream": True, "seed": seed}
    if cfg.api == "responses":
        return body | {"input": text, "max_output_tokens": cfg.max_tokens}
    body |= {"max_tokens": cfg.max_tokens, "stream_options": {"include_usage": True}}
    if cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


# One streamed chunk (a completions or chat chunk, or a Responses API event), read by this client and by the Locust
# file (load_tests/locustfile.py). A field the format requires and the chunk lacks is a KeyError: a malformed stream.
def chunk_usage(obj: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A chunk's usage (as prompt_tokens / completion_tokens) and speculation counts, where it carries them: a
    completions or chat chunk's own, or the response in the Responses API's last event."""
    if obj.get("type") not in RESPONSE_ENDS:
        return obj.get("usage"), obj.get("speculation")
    response = obj["response"]
    usage = response.get("usage")
    if usage:
        usage = {"prompt_tokens": usage.get("input_tokens", 0), "completion_tokens": usage["output_tokens"]}
    return usage, response.get("speculation")


def chunk_error(obj: dict[str, Any]) -> Any:
    """A chunk's error, if it is one: a completions or chat error chunk, or the Responses API's `error` event (its
    message) or `response.failed` event (its response's error)."""
    if obj.get("type") == "error":
        return obj.get("message") or obj
    if obj.get("type") == "response.failed":
        return obj["response"].get("error") or "response.failed"
    return obj.get("error")


def chunk_text(obj: dict[str, Any]) -> str:
    """The text of one streamed chunk (chat delta content, completion text, a Responses API text delta)."""
    if obj.get("type") == "response.output_text.delta":
        return obj["delta"] or ""
    return "".join(((c.get("delta") or {}).get("content") if "delta" in c else c.get("text")) or ""
                   for c in obj.get("choices") or [])


async def stream_one(client: Any, cfg: ServeConfig, model: str, text: str, seed: int) -> StreamRecord:
    """One streamed request; never raises for a failed request (the record says why)."""
    start = time.perf_counter()
    rec = StreamRecord(start, [], 0)
    chunks = 0
    usage = spec = None
    ended = cfg.api != "responses"  # a Responses stream ends with its final event (there is no [DONE])
    try:
        async with client.stream("POST", cfg.url.rstrip("/") + cfg.endpoint,
                                 json=request_body(cfg, model, text, seed), timeout=cfg.timeout_s) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                return StreamRecord(start, [], 0, ok=False, error=f"HTTP {resp.status_code}: {body[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if (error := chunk_error(obj)) is not None:
                    return StreamRecord(start, rec.chunk_times, 0, ok=False, error=str(error)[:300])
                if chunk_text(obj):
                    rec.chunk_times.append(time.perf_counter())
                    chunks += 1
                last_usage, last_spec = chunk_usage(obj)
                usage, spec = last_usage or usage, last_spec or spec
                ended = ended or obj.get("type") in RESPONSE_ENDS
    except Exception as e:  # network errors, timeouts, bad JSON: a failed request, not a failed benchmark
        return StreamRecord(start, rec.chunk_times, 0, ok=False, error=f"{type(e).__name__}: {e}")
    if not ended:
        return StreamRecord(start, rec.chunk_times, 0, ok=False, error="the stream ended before its final event")
    rec.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    rec.prompt_tokens = int(usage["prompt_tokens"]) if usage else 0
    rec.usage_reported = usage is not None
    rec.speculation = spec
    return rec


async def discover_model(client: Any, url: str, model: str | None = None) -> str:
    """The model to send: `model` if the server lists it, else (None) the server's first. Also the run's first
    contact, so a server that is not there, that wants a key, or that serves no such model is a clear error before
    any request is timed (a server without the model list, 404, is taken at its word for a given `model`)."""
    import httpx

    where = url.rstrip("/") + "/v1/models"
    try:
        resp = await client.get(where, timeout=30.0)
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach {url} ({type(e).__name__}: {e}); is the server running?") from None
    if resp.status_code == 401:
        raise ConfigError(f"{where} answered 401: the server wants an API key; pass --api-key or set DSDE_API_KEY")
    if resp.status_code == 404 and model is not None:
        return model
    if resp.status_code != 200:
        raise ConfigError(f"{where} answered {resp.status_code}: {resp.text[:200]}")
    ids = [m["id"] for m in resp.json().get("data") or []]
    if model is None and not ids:
        raise ConfigError(f"{where} lists no model; pass --model")
    if model is not None and ids and model not in ids:
        raise ConfigError(f"--model {model!r}: the server serves {', '.join(map(repr, ids))} ({where})")
    return model or ids[0]


async def run_serve(prompts: Sequence[Prompt], cfg: ServeConfig, transport: Any = None) -> dict[str, Any]:
    """Send every prompt, paced by the arrival process and bounded by the concurrency. Returns the results document
    (metrics + per-request records). `transport`: an httpx transport (tests)."""
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with httpx.AsyncClient(transport=transport, timeout=cfg.timeout_s, headers=headers) as client:
        model = await discover_model(client, cfg.url, cfg.model)
        sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
        offsets = arrival_times(len(prompts), cfg.request_rate, cfg.seed)
        t0 = time.perf_counter()

        async def one(i: int, p: Prompt) -> StreamRecord:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await stream_one(client, cfg, model, p.text, cfg.seed + i)
            async with sem:
                return await stream_one(client, cfg, model, p.text, cfg.seed + i)

        records = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        duration = time.perf_counter() - t0
    metrics = serve_metrics(records, duration, cfg.percentiles)
    usage_ok = all(r.usage_reported for r in records if r.ok)
    spec = [r.speculation for r in records if r.ok and r.speculation]
    if spec:
        drafted = sum(s.get("drafted", 0) for s in spec)
        metrics["acceptance_rate"] = sum(s.get("accepted", 0) for s in spec) / drafted if drafted else 0.0
        metrics["mean_sl"] = sum(s.get("mean_sl", 0.0) for s in spec) / len(spec)
    return {
        "model": model,
        "config": {**{k: v for k, v in asdict(cfg).items() if k != "api_key"},
                   "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate},
        "metrics": metrics,
        "token_counts": "server usage" if usage_ok else "content chunks (the server sent no usage)",
        "errors": [r.error for r in records if not r.ok][:10],
        "requests": [{"prompt_id": p.id, "workload": p.workload, "ok": r.ok, "ttft_s": r.ttft, "e2el_s": r.e2el,
                      "output_tokens": r.output_tokens, "chunks": len(r.chunk_times)}
                     for p, r in zip(prompts, records, strict=True)],
    }


def run_serve_sync(prompts: Sequence[Prompt], cfg: ServeConfig, transport: Any = None) -> dict[str, Any]:
    return asyncio.run(run_serve(prompts, cfg, transport))
