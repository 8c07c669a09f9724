"""The ingress: a FastAPI app on Ray Serve that owns the engine and speaks the OpenAI API.

    POST /v1/completions, POST /v1/chat/completions (stream: true -> server-sent events), GET /v1/models, GET /health

One replica = one engine: dsde_core's Engine, unchanged, over proxies to three actors it creates (draft host,
target host, controller; services.placement), stepped by dsde_core's AsyncEngine in a thread. Batching: every
request is added to the engine's waiting queue as it arrives, and the engine admits all waiting requests
into free KV slots at the start of each step, so requests arriving together enter the running batch together
and requests join and leave between steps (continuous batching). That queue is this service's equivalent of
@serve.batch, at token-step rather than request granularity; @serve.batch would hold requests back until a
batch fills and then run them as a closed group.

Errors: bad input is a 4xx with an OpenAI-style body {"error": {"message", "type", "code", "param"}}, never a
500 or a traceback; an unknown model is a 404. A failure inside the engine ends the affected requests with a
500 (or an error event in a stream); the engine keeps serving the others.
"""


import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsde_core.async_engine import AsyncEngine
from dsde_core.config import SamplingParams
from dsde_core.engine import Engine
from dsde_core.errors import ConfigError, VocabularyMismatchError
from dsde_core.request import RequestOutput
from services import transport
from services.config import PolicyConfig, ServiceConfig
from services.metrics import ObservedPolicy, ServiceMetrics
from services.metrics import current as current_metrics
from services.metrics import set_current as set_current_metrics
from services.placement import Actors, start_actors
from services.protocol import ChatCompletionRequest, CompletionRequest, error_body
from services.proxies import ControllerProxy, DraftProxy, TargetProxy
from services.responses import DONE, Reply, sse

log = logging.getLogger("ray.serve")

app = FastAPI(title="DSDE Serve", description="Speculative decoding with DSDE, OpenAI-compatible")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def _error_response(status: int, message: str, param: str | None = None, type_: str | None = None) -> JSONResponse:
    metrics = current_metrics()  # module state reached by reference (Serve ships the deployment class by value)
    if metrics is not None:
        metrics.on_error_status(status)
    return JSONResponse(error_body(message, status, type_, param), status_code=status)


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return _error_response(e.status, e.message, e.param, e.type)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    parts, param = [], None
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        param = param or loc or None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return _error_response(400, "; ".join(parts) or "invalid request body", param)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    message = e.detail if isinstance(e.detail, str) else "request failed"
    return _error_response(e.status_code, message, type_="not_found_error" if e.status_code == 404 else None)


@app.exception_handler(Exception)
async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error in the DSDE ingress")
    return _error_response(500, f"internal error: {type(e).__name__}")


def _check_vocab(actors: Actors) -> None:
    d, t = actors.draft_info, actors.target_info
    if d is None:
        return
    if d.vocab_size != t.vocab_size:
        raise VocabularyMismatchError(f"draft {d.name} has vocab size {d.vocab_size}, target {t.name} has "
                                      f"{t.vocab_size}: speculative decoding needs the same vocabulary")
    if d.tokenizer.get_vocab() != t.tokenizer.get_vocab():
        raise VocabularyMismatchError(f"draft {d.name} and target {t.name} have different tokenizers")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256, health_check_period_s=10,
                  health_check_timeout_s=60, graceful_shutdown_timeout_s=10)
@serve.ingress(app)
class DSDEServer:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.model = cfg.served_name
        transport.register()  # the proposals this engine forwards to the target travel packed
        self.actors = start_actors(cfg, PolicyConfig(policy=cfg.policy))
        _check_vocab(self.actors)
        self.tokenizer = self.actors.target_info.tokenizer
        self.metrics = ServiceMetrics(self.model)
        set_current_metrics(self.metrics)
        self.engine = Engine(
            TargetProxy(self.actors.target),
            DraftProxy(self.actors.draft) if self.actors.draft is not None else None,
            ObservedPolicy(ControllerProxy(self.actors.controller), self.metrics, load=self._load),
            self.tokenizer, cfg.engine_config(), eos_ids=self.actors.target_info.eos_ids,
            vocab_size=self.actors.target_info.vocab_size,
        )
        self.aengine = AsyncEngine(self.engine).start()
        self.policy = cfg.policy
        self.started = time.time()
        log.info("DSDE ingress ready: model %s, target %s, draft %s, policy %s", self.model, cfg.target, cfg.draft,
                 cfg.policy)

    def _load(self) -> tuple[int, int, int]:
        e = self.engine
        return len(e.running), len(e.waiting), e.config.max_batch_size - len(e.free_slots)

    # ---- Serve hooks --------------------------------------------------------------------------------
    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply a new user_config live: the controller makes a new policy current; models stay loaded."""
        cfg = PolicyConfig.from_dict(user_config)
        self.policy = await self.actors.controller.reconfigure.remote(cfg)
        log.info("DSDE policy reconfigured: %s", self.policy)

    async def check_health(self) -> None:
        if not self.aengine.alive:
            raise RuntimeError("the engine loop is not running")
        await asyncio.wait_for(asyncio.gather(*(a.ping.remote() for a in self.actors.all())), timeout=50)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.aengine.stop(timeout=5)
        with contextlib.suppress(Exception):
            self.actors.kill()

    # ---- routes -------------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        alive = self.aengine.alive
        running, waiting, _ = self._load()
        body = {"status": "ok" if alive else "engine stopped", "model": self.model, "policy": self.policy,
                "running": running, "waiting": waiting, "started": self.started}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "dsde",
                "max_model_len": self.cfg.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> Any:
        self._check_model(body.model)
        prompt = body.prompt
        ids = list(self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else [int(t) for t in prompt]
        return await self._generate(body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest) -> Any:
        self._check_model(body.model)
        try:
            text = self.tokenizer.apply_chat_template(body.chat(), tokenize=False, add_generation_prompt=True)
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from None
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return await self._generate(body, ids, chat=True)

    # ---- the work -----------------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model!r}", "model",
                           "not_found_error")

    def _params(self, body: CompletionRequest | ChatCompletionRequest, ids: list[int]) -> SamplingParams:
        room = self.cfg.max_seq_len - len(ids)
        if body.max_tokens is None and room < 1:
            raise APIError(400, f"the prompt ({len(ids)} tokens) leaves no room in the context window of "
                                f"{self.cfg.max_seq_len} tokens", "messages")
        try:
            params = body.sampling(body.max_tokens or room)
            self.engine.validate(ids, params)  # empty prompt, token ids, prompt + max_tokens > context window
        except ConfigError as e:
            raise APIError(400, str(e), "max_tokens" if "context window" in str(e) else None) from None
        return params

    async def _generate(self, body: CompletionRequest | ChatCompletionRequest, ids: list[int], chat: bool) -> Any:
        params = self._params(body, ids)
        reply = Reply(self.model, chat, len(ids))
        self.metrics.on_admit(len(ids))
        outputs = self._track(self.aengine.generate(ids, params, body.speculation.params()), reply)
        if body.stream:
            return StreamingResponse(self._stream(outputs, reply, body.include_usage), media_type="text/event-stream")
        text, last = [], None
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                text.append(out.text)
                last = out
        if last is None or last.finish_reason == "error":
            raise APIError(500, (last and last.error) or "generation failed")
        return reply.body("".join(text), last.finish_reason, last.stats)

    async def _track(self, outputs: AsyncIterator[RequestOutput], reply: Reply) -> AsyncIterator[RequestOutput]:
        """A request's outputs, counted into `reply` and the metrics; closing it early cancels the request."""
        last = None
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    reply.completion_tokens += len(out.token_ids)
                    self.metrics.on_output(out)
                    last = out
                    yield out
        finally:
            finished = last is not None and last.finished
            self.metrics.on_finish(last.finish_reason if finished else "cancelled", last.stats if finished else None)

    async def _stream(self, outputs: AsyncIterator[RequestOutput], reply: Reply, include_usage: bool
                      ) -> AsyncIterator[str]:
        async with contextlib.aclosing(outputs):
            if reply.chat:
                yield sse(reply.chunk("", role=True))
            async for out in outputs:
                if out.finish_reason == "error":
                    yield sse(error_body(out.error or "generation failed", 500))
                    break
                if out.text:
                    yield sse(reply.chunk(out.text))
                if out.finished:
                    yield sse(reply.chunk(None if reply.chat else "", out.finish_reason, stats=out.stats))
            if include_usage:
                yield sse(reply.usage_chunk())
            yield DONE
