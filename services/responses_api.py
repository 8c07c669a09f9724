"""OpenAI's Responses API objects (POST /v1/responses): the response and its stream's events, from the engine's outputs.

A response holds one output message with one `output_text` part. Its `status` is "completed", or "incomplete" with
`incomplete_details.reason` "max_output_tokens" where the output ran into its token bound (finish_reason "length");
`usage` counts input and output tokens; `speculation` is this server's, as on the other endpoints; the request's
settings are repeated as the server applied them (`store` false: nothing is stored).

A stream is server-sent events, each `event: <type>` with `data: {...}` numbered by `sequence_number`, in OpenAI's
order: response.created, response.in_progress, response.output_item.added, response.content_part.added, one
response.output_text.delta per piece of text (with its tokens' log-probabilities where asked), then
response.output_text.done, response.content_part.done, response.output_item.done and response.completed (or
response.incomplete). A request that fails mid-stream ends with an `error` event and response.failed. No
`data: [DONE]`, as OpenAI's.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dsde_core.request import RequestOutput
from services.completion_bodies import Reply, speculation_stats


def sse_event(obj: dict[str, Any]) -> str:
    """One server-sent event named by its type."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def status_of(last: RequestOutput | None) -> str:
    return "incomplete" if last is not None and last.finish_reason == "length" else "completed"


@dataclass
class ResponsesReply(Reply):
    """One Responses API request (one choice; `chat` true: chat's log-probability entries): its text so far and its
    events."""

    settings: dict[str, Any] = field(default_factory=dict)  # ResponsesRequest.settings()
    item_id: str = ""
    text: str = ""  # the output so far
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # the output's so far, where asked
    sequence: int = 0  # the next event's sequence_number

    def __post_init__(self) -> None:
        self.id = self.id or f"resp_{uuid.uuid4().hex}"
        self.item_id = self.item_id or f"msg_{uuid.uuid4().hex}"
        super().__post_init__()

    # ---- the objects --------------------------------------------------------------------------------
    def response(self, status: str, last: RequestOutput | None = None, error: dict[str, str] | None = None
                 ) -> dict[str, Any]:
        """The response object; an in-progress one has no output and no usage yet."""
        started = status != "in_progress"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": [self.message(status)] if started else [],
                "usage": self.response_usage() if started else None, **self.settings,
                "speculation": speculation_stats(last.stats) if last is not None else None}

    def message(self, status: str, content: bool = True) -> dict[str, Any]:
        """The output message of a response in `status` (an item is in_progress, completed or incomplete)."""
        item = status if status in ("in_progress", "completed") else "incomplete"
        return {"type": "message", "id": self.item_id, "status": item, "role": "assistant",
                "content": [self.part()] if content else []}

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}

    def response_usage(self) -> dict[str, Any]:
        u = self.usage()
        cached = {"cached_tokens": 0, "cache_write_tokens": 0}  # no prefix cache
        return {"input_tokens": u["prompt_tokens"], "input_tokens_details": cached,
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}

    def take_logprobs(self) -> list[dict[str, Any]]:
        """The recorded tokens' log-probability entries not yet taken (none where not asked), kept for the whole."""
        got = self.choices[0].logprobs(True)
        entries = got["content"] if got else []
        self.logprobs += entries
        return entries

    def body(self, finals: list[tuple[str, RequestOutput]]) -> dict[str, Any]:
        [(self.text, last)] = finals
        self.take_logprobs()
        return self.response(status_of(last), last)

    # ---- the stream ---------------------------------------------------------------------------------
    def event(self, type_: str, **fields: Any) -> str:
        self.sequence += 1
        return sse_event({"type": type_, "sequence_number": self.sequence - 1, **fields})

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def opening(self) -> list[str]:
        started = self.response("in_progress")
        return [self.event("response.created", response=started), self.event("response.in_progress", response=started),
                self.event("response.output_item.added", output_index=0, item=self.message("in_progress", False)),
                self.event("response.content_part.added", **self._where(), part=self.part())]

    def delta(self, text: str) -> str:
        self.text += text
        return self.event("response.output_text.delta", **self._where(), delta=text, logprobs=self.take_logprobs())

    def closing(self, last: RequestOutput) -> list[str]:
        self.take_logprobs()  # tokens recorded after the last text (an end-of-sequence)
        status = status_of(last)
        return [self.event("response.output_text.done", **self._where(), text=self.text, logprobs=self.logprobs),
                self.event("response.content_part.done", **self._where(), part=self.part()),
                self.event("response.output_item.done", output_index=0, item=self.message(status)),
                self.event(f"response.{status}", response=self.response(status, last))]

    def failed(self, message: str, code: str) -> list[str]:
        return [self.event("error", code=code, message=message, param=None),
                self.event("response.failed",
                           response=self.response("failed", error={"code": "server_error", "message": message}))]
