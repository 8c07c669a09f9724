"""OpenAI response bodies and server-sent-event chunks, from the engine's outputs.

Beside the standard fields, every final body (and the last chunk of a stream) carries `speculation`: the
request's drafted and accepted tokens, acceptance rate, mean speculation length and target steps.

Log-probabilities, where a request asks for them, in OpenAI's two shapes: completions' {tokens, token_logprobs,
top_logprobs, text_offset} (offsets into the completion's text) and chat's {content: [{token, logprob, bytes,
top_logprobs}]}; a token's text is its id decoded alone. A stream's chunk carries those of the tokens recorded since
the last chunk (a token whose text the detokenizer still holds back rides with the next chunk that has text).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsde_core.request import RequestOutput, RequestStats
from dsde_core.sampling import TokenLogprob

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
    decode: Callable[[int], str] | None = None  # a token's text; set where the request asks for logprobs
    completion_tokens: int = 0
    _unsent: list[tuple[int, TokenLogprob]] = field(default_factory=list, init=False)  # recorded, not yet sent
    _offset: int = field(default=0, init=False)  # characters of the token texts sent (completions' text_offset)

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def record(self, out: RequestOutput) -> None:
        """Count one engine output's tokens and keep their log-probabilities for the next body or chunk."""
        self.completion_tokens += len(out.token_ids)
        self._unsent += zip(out.token_ids, out.logprobs or [], strict=False)

    def _logprobs(self) -> dict[str, Any] | None:
        """The unsent tokens' log-probabilities in this endpoint's shape (None where none were asked for)."""
        if self.decode is None:
            return None
        unsent, self._unsent = self._unsent, []
        texts = [self.decode(t) for t, _ in unsent]
        if self.chat:
            return {"content": [{**self._chat_entry(text, lp.logprob),
                                 "top_logprobs": [self._chat_entry(self.decode(i), v) for i, v in lp.top]}
                                for text, (_, lp) in zip(texts, unsent, strict=True)], "refusal": None}
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": texts, "token_logprobs": [lp.logprob for _, lp in unsent],
                "top_logprobs": [{self.decode(i): v for i, v in lp.top} for _, lp in unsent], "text_offset": offsets}

    @staticmethod
    def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, text: str, finish_reason: str | None, stats: RequestStats | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": self._logprobs(),
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(), "finish_reason": finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": self.usage(),
                "speculation": speculation_stats(stats)}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              stats: RequestStats | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None if role else self._logprobs(),
                      "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": self._logprobs(), "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if stats is not None:
            out["speculation"] = speculation_stats(stats)
        return out

    def usage_chunk(self) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage()}
