"""OpenAI's Responses API without a Ray cluster: the request body's checks and its chat messages, and the response
object and stream events, each read back through the `openai` package's own models (strict validation), as a client
would parse them. tests/test_service.py drives the endpoint with the real client."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter, ValidationError

from dsde_core.errors import ConfigError
from dsde_core.request import RequestOutput, RequestStats
from dsde_core.sampling import TokenLogprob
from services.protocol import ResponsesRequest, describe_invalid
from services.responses_api import ResponsesReply
from tests.service_support import schema_verdicts

openai_responses = pytest.importorskip("openai.types.responses")
STREAM_EVENT = TypeAdapter(openai_responses.ResponseStreamEvent)


def _request(**fields: object) -> ResponsesRequest:
    return ResponsesRequest(model="m", **{"input": "hi", **fields})


def _reply(request: ResponsesRequest, decode: object = None) -> ResponsesReply:
    return ResponsesReply("m", True, prompt_tokens=4, decode=decode, settings=request.settings())


def _events(raw: list[str]) -> list[dict]:
    """Each server-sent event's data, after checking that its `event:` line names its type."""
    out = []
    for text in raw:
        head, data, blank = text.split("\n", 2)
        obj = json.loads(data.removeprefix("data: "))
        assert head == f"event: {obj['type']}" and blank == "\n"
        out.append(obj)
    return out


def test_input_and_instructions_become_chat_messages() -> None:
    assert _request(instructions="Be brief.").chat() == [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "hi"}]
    earlier = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]}  # a response's output item
    parts = [{"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "hi"}]
    turns = [{"role": "user", "content": parts}, earlier, {"role": "developer", "content": "Now in French."}]
    assert _request(input=turns).chat() == [{"role": "user", "content": "Say hi"},
                                            {"role": "assistant", "content": "Hello!"},
                                            {"role": "system", "content": "Now in French."}]
    body = _request(max_output_tokens=7, temperature=0, seed=3)
    assert body.max_tokens == 7 and body.sampling(7).temperature == 0 and body.sampling(7).seed == 3


def test_a_context_window_error_names_the_token_bound_as_the_request_did() -> None:
    """max_output_tokens (and chat's max_completion_tokens) set max_tokens; the error names the field that was sent."""
    from dsde_core.config import SamplingParams
    from services.protocol import ChatCompletionRequest
    from tests.tiny import tiny_engine

    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert _request(max_output_tokens=9).tokens_field == "max_output_tokens"
    assert _request(max_tokens=9).tokens_field == "max_tokens" and _request().tokens_field == "max_tokens"
    assert ChatCompletionRequest(**chat, max_completion_tokens=9).tokens_field == "max_completion_tokens"
    assert ChatCompletionRequest(**chat, max_tokens=9, max_completion_tokens=5).tokens_field == "max_tokens"
    engine = tiny_engine()
    window = engine.config.max_seq_len
    with pytest.raises(ConfigError, match=rf"\+ max_output_tokens \({window}\) = {window + 2} exceeds"):
        engine.validate([1, 2], SamplingParams(max_tokens=window), "max_output_tokens")


def test_log_probabilities_where_include_or_top_logprobs_asks() -> None:
    assert _request().logprob_count() is None
    assert _request(include=["message.output_text.logprobs"]).logprob_count() == 0
    assert _request(include=["message.output_text.logprobs"], top_logprobs=3).logprob_count() == 3
    assert _request(top_logprobs=2).logprob_count() == 2
    assert _request(include=["reasoning.encrypted_content"]).logprob_count() is None  # names nothing made here


@pytest.mark.parametrize(("fields", "says", "param"), [
    ({"input": []}, "no messages", "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]}, "input.0: items of type "
     "'function_call_output'", "input.0"),
    ({"input": ["hi", {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.1: content parts of type 'input_image'", "input.1.content"),
    ({"input": [{"content": "no role"}]}, "a string or a list of messages", "input"),
    ({"input": 5}, "a string or a list of messages", "input"),
    ({"n": 2}, "one output", "n"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools", "tools"),
    ({"tool_choice": "required"}, "needs tools", "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "json_schema", "text.format"),
    ({"text": {"format": "json"}}, "'json'", "text.format"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "previous_response_id"),
    ({"conversation": "conv_1"}, "stores no responses", "conversation"),
    ({"background": True}, "background", "background"),
    ({"stream_options": {"include_obfuscation": False}}, "only allowed with stream: true", "stream_options"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    ({"metadata": {"k": 1}}, "metadata", "metadata.k"),
    ({"metadata": {"k" * 65: "v"}}, "at most 64 characters", "metadata"),  # a key: the mapping (message: key 'kk..')
    ({"metadata": {"k": "v" * 513}}, "at most 512 characters", "metadata.k"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "at most 16 items", "metadata"),
])
def test_what_the_responses_api_asks_and_this_server_does_not_do_is_refused(fields: dict, says: str,
                                                                             param: str) -> None:
    """Refused with a message naming the field, and the field as the error body's `param` (a model validator's
    refusal too, which pydantic gives no location)."""
    with pytest.raises(ValidationError, match=says) as e:
        _request(**fields)
    message, named = describe_invalid(e.value.errors())
    assert says in message and named == param, (message, named)


def test_a_metadata_key_too_long_is_named_by_its_mapping_and_in_the_message() -> None:
    """The row above matches pydantic's own text; the body's message also names the key (describe_invalid)."""
    with pytest.raises(ValidationError) as e:
        _request(metadata={"k" * 65: "v"})
    assert describe_invalid(e.value.errors()) == (
        f"metadata: key '{'k' * 65}': String should have at most 64 characters", "metadata")


def test_accepted_fields_that_change_nothing_are_not_refused() -> None:
    body = _request(store=True, user="u", tool_choice="auto", parallel_tool_calls=False, truncation="disabled",
                    reasoning={"effort": None}, text={"format": {"type": "text"}}, service_tier="auto",
                    metadata={"k": "v"}, stream=True, stream_options={"include_obfuscation": False})
    settings = body.settings()
    assert settings["store"] is False and settings["metadata"] == {"k": "v"} and settings["user"] == "u"
    assert settings["parallel_tool_calls"] is False and settings["tool_choice"] == "auto" and settings["tools"] == []


def test_the_response_object_parses_as_the_openai_clients() -> None:
    request = _request(instructions="Be brief.", max_output_tokens=2, temperature=0.5, metadata={"k": "v"})
    reply = _reply(request)
    reply.record(RequestOutput(reply.id, [5, 6], "Hi there"))
    stats = RequestStats(steps=1, drafted=3, accepted=1, sl=[3])
    body = reply.body([("Hi there", RequestOutput(reply.id, [], "", True, "length", stats=stats))])
    parsed = openai_responses.Response.model_validate(body)  # the client's own model, strictly
    assert parsed.output_text == "Hi there" and parsed.id.startswith("resp_") and parsed.object == "response"
    assert parsed.status == "incomplete" and parsed.incomplete_details.reason == "max_output_tokens"
    assert parsed.output[0].status == "incomplete" and parsed.output[0].id.startswith("msg_")
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens, parsed.usage.total_tokens) == (4, 2, 6)
    assert parsed.instructions == "Be brief." and parsed.temperature == 0.5 and parsed.metadata == {"k": "v"}
    assert parsed.max_output_tokens == 2 and parsed.store is False and parsed.error is None
    assert body["speculation"]["drafted"] == 3 and body["speculation"]["accepted"] == 1
    done = _reply(request).body([("ok", RequestOutput("r", [], "", True, "stop"))])
    assert done["status"] == "completed" and done["incomplete_details"] is None and done["completed_at"] >= 0


def test_the_stream_goes_as_openais_and_each_event_parses_as_the_clients() -> None:
    decode = {1: "He", 2: "llo", 3: "!"}.__getitem__
    reply = _reply(_request(include=["message.output_text.logprobs"], top_logprobs=1), decode)
    raw = reply.opening()
    reply.record(RequestOutput(reply.id, [1, 2], "Hello", logprobs=[TokenLogprob(-0.1, ((1, -0.1),)),
                                                                  TokenLogprob(-0.2, ((2, -0.2),))]))
    raw.append(reply.delta("Hello"))
    reply.record(RequestOutput(reply.id, [3], "", logprobs=[TokenLogprob(-0.3, ((3, -0.3),))]))  # text held back
    last = RequestOutput(reply.id, [], "!", True, "stop", stats=RequestStats(steps=2, drafted=2, accepted=1, sl=[2]))
    raw += [reply.delta("!"), *reply.closing(last)]
    events = _events(raw)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    parsed = [STREAM_EVENT.validate_python(e) for e in events]  # the client's own event models, strictly
    assert parsed[0].response.status == "in_progress" and parsed[0].response.output == []
    deltas = [e for e in parsed if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == parsed[6].text == "Hello!"
    assert [[lp.token for lp in d.logprobs] for d in deltas] == [["He", "llo"], ["!"]]  # each token once
    assert [lp.token for lp in parsed[6].logprobs] == ["He", "llo", "!"]
    final = parsed[-1].response
    assert final.status == "completed" and final.output_text == "Hello!" and final.usage.output_tokens == 3
    assert {e.item_id for e in parsed if hasattr(e, "item_id")} == {final.output[0].id}
    assert events[-1]["response"]["speculation"]["steps"] == 2


def test_a_stream_that_ends_early_says_incomplete_or_failed() -> None:
    reply = _reply(_request(max_output_tokens=1))
    reply.opening()
    reply.record(RequestOutput(reply.id, [5], "x"))
    events = _events([reply.delta("x"), *reply.closing(RequestOutput(reply.id, [], "", True, "length"))])
    assert events[-1]["type"] == "response.incomplete"
    assert STREAM_EVENT.validate_python(events[-1]).response.incomplete_details.reason == "max_output_tokens"
    failing = _reply(_request())
    failing.opening()
    error, failed = [STREAM_EVENT.validate_python(e) for e in _events(failing.failed("the target is gone",
                                                                                     "unavailable"))]
    assert error.type == "error" and error.message == "the target is gone" and error.code == "unavailable"
    assert failed.type == "response.failed" and failed.response.error.message == "the target is gone"
    assert (error.sequence_number, failed.sequence_number) == (4, 5)


def test_the_schema_allows_exactly_the_refused_fields_accepted_values() -> None:
    """A client (and schemathesis, whose bodies must mostly be accepted) reads from the schema which values of the
    refused fields pass; the validator and the schema agree on each."""
    bodies = [{}, {"n": 1}, {"n": 2}, {"tools": []}, {"tools": [{"type": "function"}]}, {"tool_choice": "none"},
              {"tool_choice": "required"}, {"text": {"format": {"type": "text"}}}, {"text": {"format": None}},
              {"text": {"format": {"type": "json_object"}}}, {"reasoning": {"effort": None}},
              {"reasoning": {"summary": "auto"}}, {"previous_response_id": None}, {"previous_response_id": "r"},
              {"conversation": {"id": "c"}}, {"prompt": {"id": "p"}}, {"background": False}, {"background": True},
              {"truncation": "disabled"}, {"truncation": "auto"}]
    assert sum(schema_verdicts(ResponsesRequest, [{"model": "m", "input": "hi", **b} for b in bodies])) == 10
