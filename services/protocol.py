"""The OpenAI-compatible request bodies (pydantic, with bounds) and the error body.

Values are taken in JSON's own types as sent, never coerced into another (`Body`: `true` is no integer, `"0.5"` no
number), and an error names the type sent. Unknown fields are ignored, as OpenAI-compatible servers do, and named
in a warning in the log (as vLLM does);
OpenAI's fields that this server does not implement and that would change the answer (`suffix`, `best_of` other
than `n`, `tools`, `functions`, a `response_format` other than text) are a 400 naming the field, never ignored; so
are vLLM's structured-output fields (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
`structural_tag`, `structured_outputs`): a client that sends one relies on the output following it.
Log-probabilities: completions' `logprobs` (0-20 alternatives; with `echo`, the prompt's too), chat's `logprobs`
(true) with `top_logprobs` (0-20). Penalties:
OpenAI's `presence_penalty` and `frequency_penalty` (-2 to 2), and vLLM's `repetition_penalty` (0.01 to 10; 1 is
none). `logit_bias` (OpenAI's: token id -> bias in [-100, 100], at most 1024 ids). vLLM's `min_p`,
`min_tokens`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output` and `skip_special_tokens`.
The Responses API's body (ResponsesRequest) takes chat's sampling fields; what it asks for that needs stored state,
tools or reasoning is refused the same way, and its schema states the values of those fields that pass.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dsde_core.config import (
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    SpeculationParams,
)

MAX_STOP = 16
# vLLM's structured-output fields: each constrains what the model may say, which this server does not do
STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag", "structured_outputs")
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts per completions request (the engine's queue bounds prompts * n too)
MAX_STOP_CHARS = 256  # per stop string
GREEDY_BELOW = 1e-5  # a temperature under this is greedy (as in vLLM): 1 / T would overflow the logits
log = logging.getLogger("ray.serve")
JSON_KINDS = {list: "an array", dict: "an object", str: "a string"}
BODY_SHAPE_ERRORS = ("missing", "model_attributes_type", "model_type", "dict_type")  # pydantic's: no object given
TYPE_ERRORS = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",  # what was expected
               "string_type": "a string", "list_type": "an array", "dict_type": "an object", "model_type": "an object",
               "model_attributes_type": "an object"}


def json_kind(value: Any) -> str:
    """What a JSON value is, as an error message names it: a scalar as itself (true, null, 2.0), else its kind (a
    string, an array, an object)."""
    if value is None or isinstance(value, bool | int | float):
        return json.dumps(value)
    return JSON_KINDS.get(type(value), "something else")


def one_of(expected: str) -> WrapValidator:
    """A union field's one error, naming what it takes, in place of pydantic's one error per member type."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", "expected {expected}", {"expected": expected}) from None

    return WrapValidator(check)


def _integral(value: Any) -> Any:
    """A JSON number without a fractional part as the integer it is (JSON Schema's `integer`: `12.0` is 12, as a
    client's float arithmetic writes it); anything else goes on to the strict check (`12.5`, `true`, `"12"` fail)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


INTEGRAL = BeforeValidator(_integral)  # after a field's bounds in Annotated, so that the schema states them
Int = Annotated[int, INTEGRAL]  # an integer field of a request body: see _integral
TokenCount = Annotated[int, Field(ge=1, le=1 << 20), INTEGRAL]  # max_tokens and its aliases
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL]  # alternatives a token


def only(schema: dict[str, Any]) -> WithJsonSchema:
    """The schema of the values a field accepts, where its others are refused by a validator with a message of its
    own: clients (and schemathesis) read what is accepted instead of meeting it as a 400."""
    return WithJsonSchema(schema)


NULL = {"type": "null"}


def text_schema(max_chars: int | None = None) -> dict[str, Any]:
    """The schema of a non-empty string (of at most max_chars characters)."""
    return {"type": "string", "minLength": 1} | ({"maxLength": max_chars} if max_chars else {})


def array_schema(items: dict[str, Any], min_items: int, max_items: int | None = None) -> dict[str, Any]:
    """The schema of a list of min_items (to max_items) `items`."""
    return {"type": "array", "items": items, "minItems": min_items} | ({"maxItems": max_items} if max_items else {})


TOKEN_IDS = array_schema({"type": "integer"}, 1)  # a prompt's ids (the served schema bounds them: ingress._openapi)


class ErrorInfo(BaseModel):
    message: str
    type: str
    code: int | str | None = None
    param: str | None = None


class ErrorBody(BaseModel):
    error: ErrorInfo


def error_body(message: str, status: int, type_: str | None = None, param: str | None = None) -> dict[str, Any]:
    kind = type_ or ("invalid_request_error" if status < 500 else "server_error")
    return ErrorBody(error=ErrorInfo(message=message, type=kind, code=status, param=param)).model_dump()


class Refused(ValueError):
    """A model-level check's refusal, naming its field: pydantic gives a model validator's error no location, and
    OpenAI's error body names the field in `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def describe_invalid(errors: list[dict[str, Any]], content_type: str = "application/json") -> tuple[str, str | None]:
    """A request's validation errors (FastAPI's) as one message and the first field they name (OpenAI's `param`: a
    field error's location, else the field a model validator's Refused names).
    A body that is no JSON object at all gets one sentence saying what is wrong with it, not pydantic's words (a
    model validator's error is the body's too, and keeps its own words)."""
    for err in errors:
        loc, kind, given = tuple(err.get("loc", ())), err.get("type"), err.get("input")
        if kind == "json_invalid":
            at = f" at character {loc[1]}" if len(loc) > 1 else ""
            return f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'decode error')}{at})", None
        if loc != ("body",) or kind not in BODY_SHAPE_ERRORS:
            continue
        if isinstance(given, bytes | bytearray):  # FastAPI parses a body as JSON only when its Content-Type says so
            media = content_type.split(";")[0].strip() or "none"
            return f"the request body must be JSON: send it with Content-Type: application/json (got {media})", None
        if kind == "missing":
            return "the request body is empty: send a JSON object", None
        return f"the request body must be a JSON object, got {json_kind(given)}", None
    parts, param = [], None
    for err in errors:
        where = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if (expected := TYPE_ERRORS.get(err.get("type", ""))) is not None:  # in JSON's words, not pydantic's
            msg = f"expected {expected}, got {json_kind(err.get('input'))}"  # strict: nothing sent is coerced
        if where[-1:] == ["[key]"]:  # a mapping's key at fault: pydantic locates it at (field, key, "[key]")
            where, msg = where[:-2], f"key {where[-2]!r}: {msg}"
        loc = ".".join(where)
        param = param or loc or getattr(err.get("ctx", {}).get("error"), "param", None)
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request body", param


class Body(BaseModel):
    """A request body's object: JSON's own types as sent, none coerced into another (pydantic's strict mode), as at
    OpenAI: `"12"`, `12.5` or `true` is no integer, `"yes"` or `1` no boolean, `"0.5"` no number (an integer is
    one). A number without a fractional part is an integer (`Int`: JSON Schema's rule, which the schema states)."""

    model_config = ConfigDict(strict=True)


class SpeculationOptions(Body):
    """Per-request speculation control: off, or a ceiling on the speculation length."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    max_sl: Annotated[int, Field(ge=0, le=64), INTEGRAL] | None = None

    def params(self) -> SpeculationParams:
        return SpeculationParams(enabled=self.enabled, max_sl=self.max_sl)


class StreamOptions(Body):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _Common(Body):
    model_config = ConfigDict(extra="ignore")
    TOKENS_ALIAS: ClassVar[str | None] = None  # the endpoint's own name for max_tokens, which it also takes
    PROMPT_FIELD: ClassVar[str] = "prompt"  # the field the prompt's tokens come from, which an error about them names

    model: str = Field(min_length=1)
    max_tokens: TokenCount | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = Field(default=0, ge=-1, le=1 << 20)  # -1 or 0: no top-k (vLLM's convention)
    seed: Annotated[int, Field(ge=0, le=2**63 - 1), INTEGRAL] | None = None
    stop: Annotated[str | list[str] | None, one_of("a string or a list of strings"), only({"anyOf": [  # _stops
        text_schema(MAX_STOP_CHARS), array_schema(text_schema(MAX_STOP_CHARS), 0, MAX_STOP), NULL]})] = None
    n: Int = Field(default=1, ge=1, le=MAX_N)  # choices: n engine requests (choice i samples with seed + i)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)  # vLLM's
    logit_bias: dict[Annotated[int, Strict(False)], float] | None = None  # token id (a JSON key: a string) -> bias
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # vLLM's extra parameters, from here on
    min_tokens: Int = Field(default=0, ge=0, le=1 << 20)
    stop_token_ids: list[Int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculation: SpeculationOptions = Field(default_factory=SpeculationOptions)
    response_format: dict[str, Any] | None = None  # refused unless {"type": "text"} (_no_structured_output)

    @model_validator(mode="before")
    @classmethod
    def _no_structured_output(cls, data: Any) -> Any:
        if isinstance(data, dict):
            asked = [f for f in STRUCTURED if data.get(f) is not None]
            if asked:
                raise Refused(asked[0], f"{', '.join(asked)} (structured output) is not supported")
            fmt = data.get("response_format")
            if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
                raise Refused("response_format", f"response_format {fmt.get('type')!r} is not supported (only text)")
            ignored = sorted(str(f) for f in data if f not in cls.model_fields and f not in STRUCTURED)
            if ignored:  # a client that misspells a field learns it from the log, as vLLM's do
                log.warning("The request's fields %s are not known and were ignored", ", ".join(ignored))
        return data

    @model_validator(mode="after")
    def _max_tokens_alias(self) -> _Common:
        alias = getattr(self, self.TOKENS_ALIAS) if self.TOKENS_ALIAS else None
        if self.max_tokens is None and alias is not None:
            self.max_tokens = alias
        return self

    @property
    def tokens_field(self) -> str:
        """The field that gave the output's token bound, as the request named it (an error names that one)."""
        alias = getattr(self, self.TOKENS_ALIAS) if self.TOKENS_ALIAS else None
        return self.TOKENS_ALIAS if alias is not None and alias == self.max_tokens else "max_tokens"

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP or not all(stops):
            raise ValueError(f"stop must be at most {MAX_STOP} non-empty strings")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"each stop string must be at most {MAX_STOP_CHARS} characters, got {longest}")
        return v

    def sampling(self, max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        temperature = 0.0 if self.temperature < GREEDY_BELOW else self.temperature
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=self.top_p,
                              top_k=max(0, self.top_k), seed=self.seed, stop=stop, logprobs=self.logprob_count(),
                              prompt_logprobs=self.prompt_logprob_count(),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias or {},
                              min_p=self.min_p, min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids or (),
                              ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens)

    def logprob_count(self) -> int | None:
        """Alternatives per output token to report with its log-probability; None: no log-probabilities."""
        raise NotImplementedError

    def prompt_logprob_count(self) -> int | None:
        """Alternatives per prompt token to report with its log-probability; None: none (only an echo reports them)."""
        return None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Common:
        if self.stream_options is not None and not self.stream:  # OpenAI's and vLLM's rule
            raise Refused("stream_options", "stream_options is only allowed with stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's continuous_usage_stats; only with include_usage, as vLLM's)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: Annotated[str | list[str] | list[Int] | list[list[Int]],  # none empty (Engine.validate, _some_prompts)
                      one_of("a string, a list of strings, a list of token ids or a list of token-id lists"),
                      only({"anyOf": [text_schema(), array_schema(text_schema(), 1, MAX_PROMPTS), TOKEN_IDS,
                                      array_schema(TOKEN_IDS, 1, MAX_PROMPTS)]})]
    max_tokens: TokenCount | None = 16  # OpenAI's default for completions
    echo: bool = False  # the text starts with the prompt (and the log-probabilities with the prompt's)
    suffix: str | None = None  # refused unless empty (_unsupported)
    best_of: Int | None = None  # refused unless n (_unsupported)
    logprobs: LogprobCount | None = None  # alternatives per token (None: none)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        return self.logprobs if self.echo else None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise Refused("suffix", "suffix (text insertion) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise Refused("best_of",
                          f"best_of is not supported (ask for n={self.n} choices instead), got {self.best_of}")
        return self

    @model_validator(mode="after")
    def _some_prompts(self) -> CompletionRequest:
        if (count := len(self.prompts())) > MAX_PROMPTS:
            raise Refused("prompt", f"at most {MAX_PROMPTS} prompts per request, got {count}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts: a string or token ids is one; a list of strings or of token-id lists is several."""
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)


class ContentPart(Body):
    type: Literal["text"]
    text: str


class InputTextPart(Body):
    """The Responses API's text part: the user's `input_text`, or an earlier answer's `output_text` sent back."""

    type: Literal["input_text", "output_text"]
    text: str


def check_parts(content: Any, allowed: tuple[str, ...], where: str = "") -> None:
    """A refusal naming the first content part whose type is not text (`allowed`), led by `where` (its message's
    location: "input.2", say)."""
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind is not None and kind not in allowed:
            raise Refused(f"{where}.content" if where else "content", f"{where + ': ' if where else ''}content parts "
                          f"of type {kind!r} are not supported: this model takes text only")


class ChatMessage(Body):
    model_config = ConfigDict(extra="ignore")
    TEXT_PARTS: ClassVar[tuple[str, ...]] = ("text",)  # the content part types this message takes

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str | list[ContentPart] | None, one_of("a string or a list of text parts")] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        check_parts(v, cls.TEXT_PARTS)
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def as_dict(self) -> dict[str, str]:
        """The message as chat templates take it (a developer message is a system one)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class ChatCompletionRequest(_Common):
    TOKENS_ALIAS: ClassVar[str | None] = "max_completion_tokens"
    PROMPT_FIELD: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = False
    top_logprobs: LogprobCount | None = None
    add_generation_prompt: bool = True  # vLLM's: open the assistant's turn after the messages
    continue_final_message: bool = False  # vLLM's: the last message is the assistant's, its text continued (prefill)
    tools: list[Any] | None = None  # refused unless empty (_unsupported)
    functions: list[Any] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.tools or self.functions:
            raise Refused("tools" if self.tools else "functions",
                          "tools and functions (function calling) are not supported")
        return self

    @model_validator(mode="after")
    def _continuation(self) -> ChatCompletionRequest:
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise Refused("continue_final_message",
                          "continue_final_message needs add_generation_prompt false and an assistant's last message")
        return self

    def template_options(self) -> dict[str, bool]:
        """The chat template's switches: a new assistant turn (the default), or the last one continued."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise Refused("top_logprobs", "top_logprobs needs logprobs set to true")
        return self

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.messages]


class InputMessage(ChatMessage):
    """An item of the Responses API's `input`: a message (an earlier response's output message, sent back, is one)."""

    TEXT_PARTS: ClassVar[tuple[str, ...]] = ("input_text", "output_text")

    type: Literal["message"] = "message"
    content: Annotated[str | list[InputTextPart], one_of("a string or a list of input_text parts")]


INCLUDE_LOGPROBS = "message.output_text.logprobs"  # the Responses API's `include` entry that asks for them
STATEFUL = ("previous_response_id", "conversation", "prompt")  # fields that name something stored on the server


class ResponsesRequest(_Common):
    """OpenAI's Responses API (POST /v1/responses), stateless: `instructions` (a system message) then `input` (a
    string, one user message, or a list of messages) through the chat template, answered by one output message.
    Nothing is stored, so nothing can be named by id (`previous_response_id`, `conversation`, a stored `prompt`: 400;
    send the earlier turns in `input`, as with `store: false` at OpenAI). The sampling fields are chat's (vLLM's
    extras included) but `n` (one output); `max_output_tokens` bounds the output. Log-probabilities where `include`
    holds "message.output_text.logprobs" or `top_logprobs` is given. Tools, a text format other than text, reasoning
    and background runs are a 400, never ignored."""

    TOKENS_ALIAS: ClassVar[str | None] = "max_output_tokens"
    PROMPT_FIELD: ClassVar[str] = "input"

    input: Annotated[str | list[InputMessage], one_of("a string or a list of messages {role, content}")]
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    top_logprobs: LogprobCount | None = None
    include: list[str] | None = None  # INCLUDE_LOGPROBS; the others name items (tool calls, images) never made here
    # returned as given; OpenAI's bounds: 16 pairs, keys of at most 64 characters, values of at most 512
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)
    store: bool | None = None  # nothing is stored here: the response says store false
    user: str | None = None  # the rest of these are accepted and change nothing in the answer
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # the rest are refused (_unsupported) but for the values their schemas state
    n: Annotated[Int, only({"type": "integer", "minimum": 1, "maximum": 1})] = 1  # one output
    tool_choice: Annotated[str | dict[str, Any] | None, only({"enum": ["auto", "none", None]})] = None  # no tools
    tools: Annotated[list[Any] | None, only({"anyOf": [{"type": "array", "maxItems": 0}, NULL]})] = None
    text: Annotated[dict[str, Any] | None, only({"anyOf": [{"type": "object", "properties": {"format": {
        "anyOf": [{"type": "object", "properties": {"type": {"const": "text"}}}, NULL]}}}, NULL]})] = None
    reasoning: Annotated[dict[str, Any] | None, only({"anyOf": [  # this model does not reason
        {"type": "object", "additionalProperties": NULL}, NULL]})] = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping input to fit the context) is not done
    previous_response_id: Annotated[str | None, only(NULL)] = None  # STATEFUL
    conversation: Annotated[Any, only(NULL)] = None
    prompt: Annotated[Any, only(NULL)] = None
    background: Annotated[bool | None, only({"enum": [False, None]})] = None

    @model_validator(mode="before")
    @classmethod
    def _text_items(cls, data: Any) -> Any:
        """An input item other than a message, or a part other than text, named (the union's one error would not)."""
        items = data.get("input") if isinstance(data, dict) else None
        for i, item in enumerate(items if isinstance(items, list) else ()):
            kind = item.get("type", "message") if isinstance(item, dict) else "message"
            if kind != "message":
                raise Refused(f"input.{i}",
                              f"input.{i}: items of type {kind!r} are not supported (messages of text only)")
            content = item.get("content") if isinstance(item, dict) else None
            check_parts(content, InputMessage.TEXT_PARTS, f"input.{i}")
        return data

    @model_validator(mode="after")
    def _unsupported(self) -> ResponsesRequest:
        if isinstance(self.input, list) and not self.input:
            raise Refused("input", "input holds no messages")
        if self.n != 1:
            raise Refused("n", f"n: a response has one output, got n={self.n} (/v1/chat/completions takes n)")
        if self.tools:
            raise Refused("tools", "tools (function calling) are not supported")
        if self.tool_choice not in (None, "auto", "none"):
            raise Refused("tool_choice", f"tool_choice {self.tool_choice!r} needs tools, which are not supported")
        fmt = (self.text or {}).get("format")
        kind = fmt.get("type", "text") if isinstance(fmt, dict) else fmt
        if fmt is not None and kind != "text":
            raise Refused("text.format", f"text.format {kind!r} is not supported (only text)")
        if any(v is not None for v in (self.reasoning or {}).values()):
            raise Refused("reasoning", "reasoning is not supported: this model does not reason")
        if stateful := [f for f in STATEFUL if getattr(self, f) is not None]:
            raise Refused(stateful[0], f"{', '.join(stateful)} is not supported: this server stores no responses, "
                          "conversations or prompts (send the earlier turns in input)")
        if self.background:
            raise Refused("background", "background is not supported: a response is answered while the request waits")
        return self

    def logprob_count(self) -> int | None:
        asked = INCLUDE_LOGPROBS in (self.include or ()) or self.top_logprobs is not None
        return (self.top_logprobs or 0) if asked else None

    def chat(self) -> list[dict[str, str]]:
        turns = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else \
            [m.as_dict() for m in self.input]
        return ([{"role": "system", "content": self.instructions}] if self.instructions is not None else []) + turns

    def settings(self) -> dict[str, Any]:
        """The request's fields that the response object repeats, as this server applied them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": None, "store": False, "temperature": self.temperature,
                "text": {"format": {"type": "text"}}, "tool_choice": self.tool_choice or "auto", "tools": [],
                "top_logprobs": self.top_logprobs, "top_p": self.top_p, "truncation": "disabled", "user": self.user}


class TokenizeRequest(Body):
    """vLLM's /tokenize: a prompt's token ids, or chat messages' through the chat template."""

    # the schema states the one-of that _one_input checks (a null counts as absent)
    model_config = ConfigDict(extra="ignore", json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt (chat text has the template's own)
    add_generation_prompt: bool = True  # for messages

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise Refused("prompt" if self.messages is None else "messages", "give either prompt or messages")
        return self


class DetokenizeRequest(Body):
    """vLLM's /detokenize: token ids' text."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    tokens: list[Int] = Field(max_length=1 << 20)
