"""Completions and chat completions response bodies and server-sent-event chunks, from the engine's outputs
(the Responses API's are services.responses_api's).

Beside the standard fields, every final body (and the last chunk of a stream) carries `speculation`: the
request's drafted and accepted tokens, acceptance rate, mean speculation length and target steps (a body's over all
its choices; a stream's on each choice's last chunk, that choice's).

A request for n choices is n engine requests per prompt (choice k is prompt k // n's, sampling with seed + k % n where
a seed is given); a stream interleaves their chunks, each with its choice's index, and `usage` counts each prompt once
and every choice's tokens.

Log-probabilities, where a request asks for them, in OpenAI's two shapes: completions' {tokens, token_logprobs,
top_logprobs, text_offset} (offsets into the completion's text) and chat's {content: [{token, logprob, bytes,
top_logprobs}]}; a token's text is its id decoded alone, its bytes its own (part of a character's UTF-8 where the
character spans tokens, whose text then reads U+FFFD). A stream's chunk carries those of the tokens recorded since
the last chunk (a token whose text the detokenizer still holds back rides with the next chunk that has text).
Completions' `echo` starts each choice's text with the prompt (a stream: its first chunk), and its log-probabilities
with the prompt's (the first prompt token's null, as OpenAI's).
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


def combined(stats: list[RequestStats | None]) -> RequestStats | None:
    """The speculation figures of several choices as one request's (their sums; rates over the sums)."""
    known = [s for s in stats if s is not None]
    if len(known) <= 1:
        return known[0] if known else None
    return RequestStats(steps=sum(s.steps for s in known), drafted=sum(s.drafted for s in known),
                        accepted=sum(s.accepted for s in known), sl=[k for s in known for k in s.sl])


@dataclass
class Choice:
    """One choice's running totals: its tokens, and the log-probabilities not yet sent."""

    index: int
    decode: Callable[[int], str] | None = None  # a token's text; set where the request asks for logprobs
    prompt_ids: list[int] | None = None  # an echo's prompt, whose log-probabilities come first
    raw: Callable[[int], bytes] | None = None  # a token's own bytes (chat's `bytes`); None: its text's UTF-8
    echo: str = ""  # completions' echo: the prompt's text, which the choice's text starts with
    completion_tokens: int = 0
    unsent: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)  # recorded, not yet sent
    offset: int = 0  # characters of the token texts sent (completions' text_offset)

    def record(self, out: RequestOutput) -> None:
        """Count one engine output's tokens and keep their log-probabilities for the next body or chunk (an echo's
        prompt tokens first, the first one with none, as OpenAI's)."""
        self.completion_tokens += len(out.token_ids)
        if out.prompt_logprobs is not None and self.prompt_ids:
            self.unsent += [(self.prompt_ids[0], None), *zip(self.prompt_ids[1:], out.prompt_logprobs, strict=True)]
        self.unsent += zip(out.token_ids, out.logprobs or [], strict=False)

    def logprobs(self, chat: bool) -> dict[str, Any] | None:
        """The unsent tokens' log-probabilities in the endpoint's shape (None where none were asked for)."""
        if self.decode is None:
            return None
        unsent, self.unsent = self.unsent, []
        texts = [self.decode(t) for t, _ in unsent]
        if chat:
            return {"content": [{**self._chat_entry(t, lp.logprob, text),
                                 "top_logprobs": [self._chat_entry(i, v) for i, v in lp.top]}
                                for text, (t, lp) in zip(texts, unsent, strict=True)], "refusal": None}
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": texts, "token_logprobs": [lp and lp.logprob for _, lp in unsent],
                "top_logprobs": [lp and {self.decode(i): v for i, v in lp.top} for _, lp in unsent],
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, logprob: float, text: str | None = None) -> dict[str, Any]:
        text = self.decode(token_id) if text is None else text  # decode is set: logprobs() returned early otherwise
        raw = self.raw(token_id) if self.raw is not None else text.encode()
        return {"token": text, "logprob": logprob, "bytes": list(raw)}


@dataclass
class Reply:
    """One request's identity and its choices' running totals (n per prompt; choice k is prompt k // n's, as OpenAI
    indexes them); builds its bodies and chunks."""

    model: str
    chat: bool
    prompt_tokens: int  # all prompts'
    n: int = 1
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    decode: Callable[[int], str] | None = None  # a token's text; set where the request asks for logprobs
    prompts: int = 1  # completions take several prompts
    echoes: list[str] | None = None  # completions' echo: each prompt's text, which its choices' texts start with
    prompt_ids: list[list[int]] | None = None  # with an echo and logprobs: each prompt, whose log-probabilities lead
    raw: Callable[[int], bytes] | None = None  # a token's own bytes (chat's logprobs); None: its text's UTF-8
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every stream chunk carries the usage so far
    choices: list[Choice] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.choices = [Choice(k, self.decode, self.prompt_ids[k // self.n] if self.prompt_ids else None, self.raw,
                               self.echoes[k // self.n] if self.echoes else "") for k in range(self.prompts * self.n)]

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def request_id(self, index: int) -> str:
        """The engine's id for choice `index` (the reply's own id for a single choice)."""
        return self.id if len(self.choices) == 1 else f"{self.id}-{index}"

    def record(self, out: RequestOutput, index: int = 0) -> None:
        self.choices[index].record(out)

    def usage(self) -> dict[str, int]:
        completion = sum(c.completion_tokens for c in self.choices)  # the prompt counts once, as OpenAI's n does
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, finals: list[tuple[str, RequestOutput]]) -> dict[str, Any]:
        """The whole response from each choice's (text, last output), in index order."""
        choices = []
        for c, (text, last) in zip(self.choices, finals, strict=True):
            end = _end(last)
            if self.chat:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": text},
                                "logprobs": c.logprobs(True), **end})
            else:
                choices.append({"index": c.index, "text": c.echo + text, "logprobs": c.logprobs(False), **end})
        return {**self._head(self.object), "choices": choices, "usage": self.usage(),
                "speculation": speculation_stats(combined([last.stats for _, last in finals]))}

    def chunk(self, text: str | None, last: RequestOutput | None = None, role: bool = False,
              index: int = 0) -> dict[str, Any]:
        """A stream chunk of choice `index`: its text, and where `last` (the choice's finished output) is given, how it
        ended and its speculation statistics."""
        c = self.choices[index]
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None if role else c.logprobs(True), **_end(last)}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": c.logprobs(False), **_end(last)}
            out = {**self._head("text_completion"), "choices": [choice]}
        if last is not None and last.stats is not None:
            out["speculation"] = speculation_stats(last.stats)
        if self.continuous_usage:
            out["usage"] = self.usage()
        return out

    def usage_chunk(self) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage()}


def _end(last: RequestOutput | None) -> dict[str, Any]:
    """A choice's finish_reason and vLLM's stop_reason (the stop_token_ids token or the stop string that ended it)."""
    return {"finish_reason": last and last.finish_reason, "stop_reason": last and last.stop_reason}
