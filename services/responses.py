"""OpenAI response bodies and server-sent-event chunks, from the engine's outputs.

Beside the standard fields, every final body (and the last chunk of a stream) carries `speculation`: the
request's drafted and accepted tokens, acceptance rate, mean speculation length and target steps.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dsde_core.request import RequestStats

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def speculation_stats(stats: RequestStats | None) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {"drafted": stats.drafted, "accepted": stats.accepted, "acceptance_rate": stats.acceptance_rate,
            "mean_sl": stats.mean_sl, "mean_accepted_length": stats.mean_accepted_length, "steps": stats.steps}


@dataclass
class Reply:
    """One request's identity and running totals; builds its bodies and chunks."""

    model: str
    chat: bool
    prompt_tokens: int
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, text: str, finish_reason: str | None, stats: RequestStats | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": self.usage(),
                "speculation": speculation_stats(stats)}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              stats: RequestStats | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if stats is not None:
            out["speculation"] = speculation_stats(stats)
        return out

    def usage_chunk(self) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage()}
