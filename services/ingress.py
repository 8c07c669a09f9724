"""The ingress: a FastAPI app on Ray Serve that owns the engine and speaks the OpenAI API.

    POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (stream: true -> server-sent events),
    GET /v1/models, GET /health, GET /version

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

Load and failures (docs/failures.md): at most max_batch_size + max_queue requests are in the engine; more get
429 with Retry-After. A request unfinished after request_timeout_s ends with 504. A worker actor that dies is restarted
by Ray, a draft or controller that raises is tried again, and a target that raises ends only a request it fails on
alone; the engine recovers either way (dsde_core.recovery); a request that waited worker_wait_s for a target that did
not come back ends with 503. drain() (SIGTERM in `dsde serve`) refuses new requests with 503 and lets the running ones
finish. With an API key (api_key / $DSDE_API_KEY) every endpoint but /health wants `Authorization: Bearer <key>`; bodies
over max_request_bytes get 413.
"""


import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, RayActorError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsde_core import __version__
from dsde_core.async_engine import AsyncEngine
from dsde_core.config import SamplingParams
from dsde_core.detokenize import token_bytes
from dsde_core.engine import Engine
from dsde_core.errors import ConfigError, VocabularyMismatchError, WorkerUnavailable
from dsde_core.request import RequestOutput
from services import transport
from services.completion_bodies import DONE, Reply, sse
from services.config import PolicyConfig, ServiceConfig
from services.metrics import ObservedPolicy, ServiceMetrics
from services.metrics import current as current_metrics
from services.metrics import set_current as set_current_metrics
from services.placement import Actors, start_actors
from services.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
    describe_invalid,
    error_body,
)
from services.proxies import ControllerProxy, DraftProxy, TargetProxy
from services.responses_api import ResponsesReply

log = logging.getLogger("ray.serve")

app = FastAPI(title="DSDE Serve", description="Speculative decoding with DSDE, OpenAI-compatible")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.headers = status, message, param, type_, headers


def _error_response(status: int, message: str, param: str | None = None, type_: str | None = None,
                    headers: dict[str, str] | None = None) -> JSONResponse:
    metrics = current_metrics()  # module state reached by reference (Serve ships the deployment class by value)
    if metrics is not None:
        metrics.on_error_status(status)
    return JSONResponse(error_body(message, status, type_, param), status_code=status, headers=headers)


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return _error_response(e.status, e.message, e.param, e.type, e.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    message, param = describe_invalid(list(e.errors()), request.headers.get("content-type", ""))
    return _error_response(400, message, param)


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


# ---- the request guard: API key and body size ----------------------------------------------------------
_guard: dict[str, Any] = {"api_key": None, "max_bytes": 1 << 20, "model": None,  # set by DSDEServer.__init__
                          "max_seq_len": None, "vocab_size": None, "replica": ""}
OPEN_PATHS = frozenset({"/health"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def configure_guard(api_key: str | None, max_bytes: int, model: str | None = None, max_seq_len: int | None = None,
                    vocab_size: int | None = None, replica: str = "") -> None:
    """Set this process's guard (and the served name and limits the schema shows). A function, not a dict update in
    the replica: Serve ships the deployment class by value, so a module dict it names would be a copy; this module's
    functions are reached by reference."""
    _guard.update(api_key=api_key, max_bytes=max_bytes, model=model, max_seq_len=max_seq_len, vocab_size=vocab_size,
                  replica=replica)
    app.openapi_schema = None  # the schema states them: built again at the next read


def _route(scope: dict[str, Any]) -> str:
    """The path inside the app (Serve's route prefix, the ASGI root_path, removed)."""
    path, root = scope.get("path", "/"), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path or "/"


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class RequestGuard:
    """ASGI middleware in front of every route: the API key, checked like vLLM's (`Authorization: Bearer <key>`,
    401 otherwise) on every path but /health, and the body bound (413 over max_request_bytes, from the
    Content-Length or, without one, while the body is read). The body is read once here and replayed."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = _guard["api_key"]
        if key is not None and _route(scope) not in OPEN_PATHS:
            given = _header(scope, b"authorization") or ""
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                reply = _error_response(401, "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                                        type_="authentication_error", headers={"WWW-Authenticate": "Bearer"})
                await reply(scope, receive, send)
                return
        if scope.get("method") not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = _guard["max_bytes"]
        too_big = _error_response(413, f"the request body is larger than {limit} bytes (max_request_bytes)")
        length = _header(scope, b"content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > limit):
            reply = too_big if length.strip().isdigit() else _error_response(400, "invalid Content-Length header")
            await reply(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > limit:
                await too_big(scope, receive, send)
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: the client's disconnect, which cancels a stream

        await self.app(scope, replay, send)


class ReplicaHeader:
    """ASGI middleware: every response names the replica that answered (`x-dsde-replica`, Serve's replica id), so a
    client behind several replicas can tell them apart."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        replica = _guard["replica"]
        if scope["type"] != "http" or not replica:
            await self.app(scope, receive, send)
            return

        async def named(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-dsde-replica", replica.encode())]}
            await send(message)

        await self.app(scope, receive, named)


def replica_id() -> str:
    """Serve's id of this replica (the `replica` tag of Serve's metrics); "" outside a Serve replica."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica (a test builds the class by hand)
        return ""


app.add_middleware(RequestGuard)
app.add_middleware(ReplicaHeader)


def _bound_ints(schema: dict[str, Any], lo: int, hi: int) -> None:
    """Narrow every integer in a property's schema (its anyOf branches and array items, nested) to [lo, hi]."""
    if schema.get("type") == "integer":
        schema["minimum"] = max(schema.get("minimum", lo), lo)
        schema["maximum"] = min(schema.get("maximum", hi), hi)
    for sub in schema.get("anyOf", []):
        _bound_ints(sub, lo, hi)
    if isinstance(schema.get("items"), dict):
        _bound_ints(schema["items"], lo, hi)


_GENERATE = ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest")  # the request bodies that generate


def _openapi() -> dict[str, Any]:
    """FastAPI's OpenAPI schema, with what this replica serves stated where the static models cannot: `model` limited
    to the served name (the one value that is not a 404: in the bodies and in /v1/models/{model}), token counts to the
    context window, token ids to the vocabulary. Clients, and schemathesis, read them from the schema instead of
    meeting them as 4xx."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        models = schema.get("components", {}).get("schemas", {})

        def prop(name: str, field: str) -> dict[str, Any] | None:
            return models.get(name, {}).get("properties", {}).get(field)

        seq, vocab = _guard["max_seq_len"], _guard["vocab_size"]
        bounds = {}  # (schema, property) -> (lo, hi) of its integers
        if seq:  # a prompt holds at least one token
            bounds |= {(m, f): (0, seq - 1) for m in _GENERATE for f in ("max_tokens", "max_completion_tokens",
                                                                          "max_output_tokens", "min_tokens")}
        if vocab:
            bounds |= {("CompletionRequest", "prompt"): (0, vocab - 1), ("DetokenizeRequest", "tokens"): (0, vocab - 1)}
            bounds |= {(m, "stop_token_ids"): (0, vocab - 1) for m in _GENERATE}
        for (name, field), (lo, hi) in bounds.items():
            if (p := prop(name, field)) is not None:
                _bound_ints(p, lo, hi)
        if _guard["model"]:
            served = [_guard["model"]]
            for name in (*_GENERATE, "TokenizeRequest", "DetokenizeRequest"):
                if (p := prop(name, "model")) is not None:
                    p["enum"] = served
            for param in schema.get("paths", {}).get("/v1/models/{model}", {}).get("get", {}).get("parameters", []):
                if param.get("name") == "model":
                    param.setdefault("schema", {})["enum"] = served
    return app.openapi_schema


app.openapi = _openapi  # type: ignore[method-assign]


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: seed + index where a seed is given (the same seed would draw the same text)."""
    return params if index == 0 or params.seed is None else replace(params, seed=params.seed + index)


async def _collect(outputs: AsyncIterator[RequestOutput]) -> tuple[str, RequestOutput | None]:
    """A choice's whole text and its last output (None if it produced none)."""
    text, last = [], None
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            text.append(out.text)
            last = out
    return "".join(text), last


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The choices' outputs as they come, each with its index; closing it closes (so cancels) every choice."""
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out))
        finally:
            queue.put_nowait((i, None))  # this choice is done

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, out = await queue.get()
            if out is None:
                live -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Stream(StreamingResponse):
    """A streaming response that cancels its request however it ends, even if its body was never iterated (a
    client that left before the first chunk): the request joined the engine when it was admitted."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


ERROR_STATUS = {"unavailable": 503, "timeout": 504}  # RequestOutput.error_type -> HTTP status; otherwise 500


async def with_deadline(outputs: AsyncIterator[RequestOutput], timeout: float | None, req_id: str
                        ) -> AsyncIterator[RequestOutput]:
    """A request's outputs until `timeout` s from now; then one error output (error_type "timeout") and the source
    is closed, which cancels the request in the engine."""
    deadline = None if timeout is None else time.monotonic() + timeout
    async with contextlib.aclosing(outputs):
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out = await asyncio.wait_for(anext(outputs), wait)
            except StopAsyncIteration:
                return
            except TimeoutError:  # the wait cancelled the source's pending step: its finally cancels the request
                yield RequestOutput(req_id, [], "", True, "error",
                                    f"the request did not finish within {timeout:g}s (request_timeout_s)",
                                    error_type="timeout")
                return
            yield out
            if out.finished:
                return


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256, health_check_period_s=10,
                  health_check_timeout_s=60, graceful_shutdown_timeout_s=30)
@serve.ingress(app)
class DSDEServer:
    # Serve calls reconfigure right after __init__ with the deployment's user_config, which replaces the args'
    # policy: the note on a policy above max_sl waits for the one that applies (reconfigure, else the first health
    # check)
    _ceiling_noted = False

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.model = cfg.served_name
        transport.register()  # the proposals this engine forwards to the target travel packed
        self.policy_config = PolicyConfig(policy=cfg.policy)
        self.replica = replica_id()
        self.actors = start_actors(cfg, self.policy_config)
        _check_vocab(self.actors)
        configure_guard(cfg.api_key or os.environ.get("DSDE_API_KEY") or None, cfg.max_request_bytes, self.model,
                        cfg.max_seq_len, self.actors.target_info.vocab_size, self.replica)
        self.tokenizer = self.actors.target_info.tokenizer
        self._token_bytes = token_bytes(self.tokenizer)  # logprobs' `bytes`: a token's own, not its text's
        self.metrics = ServiceMetrics(self.model, self.replica, cfg.max_batch_size)
        set_current_metrics(self.metrics)
        self.controller = ControllerProxy(self.actors.controller)
        self.engine = Engine(
            TargetProxy(self.actors.target),
            DraftProxy(self.actors.draft) if self.actors.draft is not None else None,
            ObservedPolicy(self.controller, self.metrics, load=self._load),
            self.tokenizer, cfg.engine_config(), eos_ids=self.actors.target_info.eos_ids,
            vocab_size=self.actors.target_info.vocab_size,
        )
        self.engine.recovery_hooks.append(self._on_recovered)
        self.aengine = AsyncEngine(self.engine, admit_wait_s=cfg.admit_wait_s).start()
        self.policy = cfg.policy
        self.draining = False
        self.started = time.time()
        log.info("DSDE ingress ready: model %s, target %s, draft %s, policy %s", self.model, cfg.target, cfg.draft,
                 cfg.policy)

    def _note_ceiling(self) -> None:
        self._ceiling_noted = True
        if note := self.policy_config.ceiling_note(self.cfg.max_sl):
            log.warning(note)

    def _load(self) -> tuple[int, int, int]:
        e = self.engine
        health = {role: h for role, h in e.health.items() if role != "draft" or e.draft}
        self.metrics.on_workers({r: not h.down for r, h in health.items()}, {r: h.failures for r, h in health.items()})
        self.metrics.on_prefill_chunks(dict(e.prefill_chunks))
        return len(e.running), len(e.waiting), e.config.max_batch_size - len(e.free_slots)

    def _on_recovered(self, role: str) -> None:
        """The engine reached a failed actor again (its state is rebuilt). A restarted controller started from the
        build-time policy: give it the current one (the engine thread; a plain actor call)."""
        log.warning("the %s actor answers again; its state was rebuilt from the committed tokens", role)
        self._load()  # the gauges (dsde_worker_up) now, not at the next request
        if role == "policy":
            with contextlib.suppress(WorkerUnavailable):
                self.policy = self.controller.reconfigure(self.policy_config)

    # ---- Serve hooks --------------------------------------------------------------------------------
    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply a new user_config live: the controller makes a new policy current; models stay loaded."""
        cfg = PolicyConfig.from_dict(user_config)
        self.policy = await self.actors.controller.reconfigure.remote(cfg)
        self.policy_config = cfg
        log.info("DSDE policy reconfigured: %s", self.policy)
        self._note_ceiling()

    async def check_health(self) -> None:
        """Healthy while the engine loop runs and no actor is dead for good. An actor that is restarting is not a
        failure (the engine waits for it); one that used up its restarts is: Serve then replaces the replica."""
        if not self.aengine.alive:
            raise RuntimeError("the engine loop is not running")
        if not self._ceiling_noted:  # the args' policy applies: no user_config replaced it
            self._note_ceiling()
        with contextlib.suppress(Exception):  # the gauges, also while idle; never a reason to fail the check
            self.metrics.on_load(*self._load())  # current values of the load and worker gauges
            self.metrics.refresh()  # the last values of the others (cap, cost model)
        for name, actor in self.actors.named().items():
            try:
                await asyncio.wait_for(actor.ping.remote(), timeout=30)
            except ActorDiedError as e:
                raise RuntimeError(f"the {name} actor is dead and will not be restarted: {e}") from None
            except (RayActorError, TimeoutError):
                continue
        with contextlib.suppress(RayActorError, TimeoutError):  # a controller restarted between two steps
            described = await asyncio.wait_for(self.actors.controller.describe.remote(), timeout=30)
            if described["policy"] != self.policy:
                self.policy = await self.actors.controller.reconfigure.remote(self.policy_config)

    async def drain(self) -> int:
        """Refuse new requests from now on (503); returns how many are still in the engine."""
        self.draining = True
        return len(self.engine.requests)

    async def in_flight(self) -> int:
        return len(self.engine.requests)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.aengine.stop(timeout=5)
        with contextlib.suppress(Exception):
            self.actors.kill()

    # ---- routes -------------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        state = self.engine.state()
        workers = {role: w["up"] for role, w in state["workers"].items()}
        if not self.aengine.alive:
            status = "engine stopped"
        elif self.draining:
            status = "draining"
        else:
            status = "ok" if all(workers.values()) else "degraded"
        body = {"status": status, "model": self.model, "policy": self.policy, "running": state["running"],
                "waiting": state["waiting"], "slots_in_use": state["slots_in_use"], "workers": workers,
                "started": self.started}
        return JSONResponse(body, status_code=200 if status in ("ok", "degraded") else 503)

    @app.get("/version")
    async def version(self) -> dict[str, str]:
        """vLLM's: the server's version."""
        return {"version": __version__}

    @app.get("/admin/state")
    async def admin_state(self) -> dict[str, Any]:
        """Every piece of per-request state, where it lives: the engine's counts and each party's health, and
        the slots the draft and target hold open and the requests the controller tracks (actor calls)."""

        async def ask(actor: Any, method: str) -> int | None:
            if actor is None:
                return None
            try:
                return await asyncio.wait_for(getattr(actor, method).remote(), timeout=10)
            except (RayActorError, TimeoutError):
                return None  # down or restarting

        state = self.engine.state()
        state["target_slots_open"] = await ask(self.actors.target, "num_open")
        state["draft_slots_open"] = await ask(self.actors.draft, "num_open")
        state["controller_tracked"] = await ask(self.actors.controller, "num_tracked")
        state["draining"] = self.draining
        state["actors"] = {"namespace": self.actors.namespace, "names": self.actors.names,
                           "placement": self.actors.placement()}
        state["replica"] = self.replica
        state["capacity"] = {"max_batch_size": self.cfg.max_batch_size, "max_queue": self.cfg.max_queue}
        return state

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card()]}

    @app.get("/v1/models/{model:path}")
    async def model_card(self, model: str) -> dict[str, Any]:
        self._check_model(model)
        return self._card()

    def _card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": int(self.started), "owned_by": "dsde",
                "max_model_len": self.cfg.max_seq_len}

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: the served tokenizer's ids for a prompt, or for chat messages through the chat template."""
        self._check_model(body.model)
        if body.messages is not None:
            ids = self._chat_ids([m.as_dict() for m in body.messages], add_generation_prompt=body.add_generation_prompt)
        else:
            ids = list(self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
        return {"count": len(ids), "max_model_len": self.cfg.max_seq_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        self._check_model(body.model)
        try:
            self.engine.check_ids(body.tokens, "token ids")
        except ConfigError as e:
            raise APIError(400, str(e), "tokens") from None
        return {"prompt": self.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> Any:
        self._check_model(body.model)
        prompts = body.prompts()
        ids = [list(self.tokenizer(p)["input_ids"]) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        return await self._generate(body, ids, chat=False, echo=prompts if body.echo else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest) -> Any:
        self._check_model(body.model)
        return await self._generate(body, [self._chat_ids(body.chat(), **body.template_options())], chat=True)

    @app.post("/v1/responses")
    async def responses(self, body: ResponsesRequest) -> Any:
        """OpenAI's Responses API, stateless (services.responses_api): the input as chat messages, one output."""
        self._check_model(body.model)
        return await self._generate(body, [self._chat_ids(body.chat(), add_generation_prompt=True)], chat=True,
                                    settings=body.settings())

    @app.api_route("/v1/responses/{response_id:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def stored_response(self, response_id: str) -> None:
        """A stored response's routes (retrieve, its input items, cancel, delete): there are none to find."""
        raise APIError(404, f"no response {response_id.split('/')[0]!r}: this server stores no responses (each is "
                            "answered statelessly, as with store false)", "response_id", "not_found_error")

    def _chat_ids(self, messages: list[dict[str, str]], **options: bool) -> list[int]:
        """The messages' token ids through the chat template (which holds its own special tokens); 400 if it fails."""
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **options)
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ---- the work -----------------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model!r}", "model",
                           "not_found_error")

    def _params(self, body: CompletionRequest | ChatCompletionRequest, ids: list[int], which: str = ""
                ) -> SamplingParams:
        """The sampling of one prompt's choices; a 400 otherwise, its message led by `which` ("prompt 2: ")."""
        room = self.cfg.max_seq_len - len(ids)
        if body.max_tokens is None and room < 1:
            raise APIError(400, f"{which}the prompt ({len(ids)} tokens) leaves no room in the context window of "
                                f"{self.cfg.max_seq_len} tokens", body.PROMPT_FIELD)
        try:
            params = body.sampling(body.max_tokens or room)
            self.engine.validate(ids, params, body.tokens_field)  # empty prompt, ids, prompt + bound > context
        except ConfigError as e:  # e.field: the engine's name for the input at fault, "prompt" this endpoint's
            raise APIError(400, which + str(e), body.PROMPT_FIELD if e.field == "prompt" else e.field) from None
        return params

    def _admit(self, n: int = 1) -> None:
        """Refuse a request the engine must not take: 503 while draining, 429 when the queue has no room for its n
        choices (n per prompt; 400 where it never could)."""
        retry = {"Retry-After": str(self.cfg.retry_after_s)}
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests", type_="server_error",
                           headers=retry)
        limit = self.cfg.max_batch_size + self.cfg.max_queue
        if n > limit:
            raise APIError(400, f"{n} choices (n per prompt) exceed this server's capacity of {limit} requests "
                                f"(max_batch_size + max_queue)", "n")
        if len(self.engine.requests) + n > limit:
            raise APIError(429, f"the server is at capacity ({self.cfg.max_batch_size} running and "
                                f"{self.cfg.max_queue} waiting requests); retry after {self.cfg.retry_after_s}s",
                           type_="rate_limit_error", headers=retry)

    async def _generate(self, body: CompletionRequest | ChatCompletionRequest | ResponsesRequest,
                        prompts: list[list[int]], chat: bool, echo: list[str] | list[list[int]] | None = None,
                        settings: dict[str, Any] | None = None) -> Any:
        """n choices per prompt, each its own engine request: choice k is prompt k // n's, with seed + k % n. `echo`:
        the prompts as sent, which their choices' texts start with (token ids decoded once they are checked).
        `settings`: a Responses API request's (ResponsesRequest.settings), answered as a response object."""
        params = [self._params(body, ids, f"prompt {i}: " if len(prompts) > 1 else "") for i, ids in enumerate(prompts)]
        echoes = None if echo is None else [p if isinstance(p, str) else self.tokenizer.decode(ids)
                                            for p, ids in zip(echo, prompts, strict=True)]
        n = body.n
        self._admit(len(prompts) * n)
        asks = params[0].prompt_logprobs is not None
        make = Reply if settings is None else partial(ResponsesReply, settings=settings)
        reply = make(self.model, chat, sum(map(len, prompts)), n,
                      decode=None if params[0].logprobs is None else self._token_text, prompts=len(prompts),
                      echoes=echoes, prompt_ids=prompts if asks else None, raw=self._token_bytes,
                      continuous_usage=body.continuous_usage)
        # each choice joins the engine's queue now (the queue bound above counts it at once)
        outputs = [self._track(self.aengine.submit(prompts[k // n], choice_params(params[k // n], k % n),
                                                   body.speculation.params(), reply.request_id(k)), reply, k)
                   for k in range(len(reply.choices))]
        for k in range(len(reply.choices)):
            self.metrics.on_admit(len(prompts[k // n]))
        if body.stream:
            events = self._events(merge(outputs), reply) if isinstance(reply, ResponsesReply) else \
                self._stream(merge(outputs), reply, body.include_usage)
            return _Stream(events, on_close=lambda: self._cancel_all(reply))
        try:
            finals = await asyncio.gather(*(_collect(o) for o in outputs))
        finally:  # a choice whose task never started (the client left at once) is cancelled here
            self._cancel_all(reply)
        for _, last in finals:
            if last is None or last.finish_reason == "error":
                status = ERROR_STATUS.get(last.error_type, 500) if last is not None else 500
                headers = {"Retry-After": str(self.cfg.retry_after_s)} if status == 503 else None
                raise APIError(status, (last and last.error) or "generation failed", headers=headers)
        return reply.body(finals)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _cancel_all(self, reply: Reply) -> None:
        for i in range(len(reply.choices)):  # a finished choice's cancel is a no-op
            self.aengine.cancel(reply.request_id(i))

    async def _track(self, outputs: AsyncIterator[RequestOutput], reply: Reply, index: int = 0
                     ) -> AsyncIterator[RequestOutput]:
        """A choice's outputs (ended by an error output at request_timeout_s), counted into `reply` and the
        metrics; closing it early cancels the request."""
        last = None
        try:
            timed = with_deadline(outputs, self.cfg.request_timeout_s, reply.request_id(index))
            async with contextlib.aclosing(timed):
                async for out in timed:
                    reply.record(out, index)
                    self.metrics.on_output(out)
                    last = out
                    yield out
        finally:
            finished = last is not None and last.finished
            self.metrics.on_finish(last.finish_reason if finished else "cancelled", last.stats if finished else None)

    async def _stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]], reply: Reply, include_usage: bool
                      ) -> AsyncIterator[str]:
        async with contextlib.aclosing(outputs):
            if reply.chat:
                for i in range(len(reply.choices)):
                    yield sse(reply.chunk("", role=True, index=i))
            echoes = {c.index: c.echo for c in reply.choices}  # each choice's first chunk starts with its echo
            async for i, out in outputs:
                if out.finish_reason == "error":  # one choice failed: the stream ends (the others are cancelled)
                    yield sse(error_body(out.error or "generation failed", ERROR_STATUS.get(out.error_type, 500)))
                    break
                if text := echoes.pop(i, "") + out.text:
                    yield sse(reply.chunk(text, index=i))
                if out.finished:
                    yield sse(reply.chunk(None if reply.chat else "", out, index=i))
            if include_usage:
                yield sse(reply.usage_chunk())
            yield DONE

    async def _events(self, outputs: AsyncIterator[tuple[int, RequestOutput]], reply: ResponsesReply
                      ) -> AsyncIterator[str]:
        """A Responses API stream: its opening events, a delta per piece of text, its closing (or failing) events."""
        async with contextlib.aclosing(outputs):
            for opening in reply.opening():
                yield opening
            async for _, out in outputs:
                if out.finish_reason == "error":
                    for failing in reply.failed(out.error or "generation failed", out.error_type or "server_error"):
                        yield failing
                    return
                if out.text:
                    yield reply.delta(out.text)
                if out.finished:
                    for closing in reply.closing(out):
                        yield closing
