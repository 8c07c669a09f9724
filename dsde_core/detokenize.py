"""Incremental detokenization with stop strings: text streams out as tokens are accepted. And a token's own bytes."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback tokens


@cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) alphabet back to bytes: printable bytes stand for themselves, the other 68 bytes
    for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(moved)}


def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """id -> the token's own bytes, what OpenAI's logprobs `bytes` hold: a character split across tokens has part of
    its UTF-8 in each, where the token decoded alone reads U+FFFD. Byte-level BPE (GPT-2, Qwen, Llama 3) maps its token
    string back through its alphabet; SentencePiece's byte tokens are <0xNN>; any other token: its text's UTF-8."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    table = _byte_level_table() if type(decoder).__name__ == "ByteLevel" else None

    def raw(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if table is not None and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            if m := _BYTE_TOKEN.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
        return tokenizer.decode([token_id]).encode()

    return raw


class TextStream:
    """Turns a growing list of token ids into text deltas; finds stop strings, even across token borders."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), min_ids: int = 0, keep_stop: bool = False,
                 skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special = skip_special  # special tokens (an eos let through, a template's markers) leave no text
        self.keep_stop = keep_stop  # the text ends after the stop string, not before it (include_stop_str_in_output)
        self.min_ids = min_ids  # a stop string counts only where an id from the min_ids-th on completes it (min_tokens)
        self._floor: int | None = 0 if min_ids <= 1 else None  # no counted stop string ends within text[:floor]
        self.ids: list[int] = []
        self.text = ""  # the text sent so far
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self.kept = 0  # of the last add's ids, those kept: all, or on a stop string up to the one completing it

    def add(self, ids: list[int]) -> str:
        """Append token ids; return the new text that is safe to send. On a stop string: sets `stopped` and keeps
        only the ids up to the one that completes it (`kept` of them), as decoding one token at a time would have
        stopped there; the text ends before the stop string (after it with keep_stop)."""
        before, self.kept = len(self.ids), len(ids)
        self.ids.extend(ids)
        full = self._decode(len(self.ids))
        if self.stop and self._stop_at(full) is not None:
            # the fewest of these ids whose text holds a stop string (speculation accepts several tokens a step)
            for self.kept in range(1, len(ids) + 1):
                text = self._decode(before + self.kept)
                if (hit := self._stop_at(text)) is not None:
                    break
            del self.ids[before + self.kept :]
            at, self.matched = hit
            self.stopped = True
            return self._send(text[: at + len(self.matched) if self.keep_stop else at])
        end = len(full)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            end = len(full.rstrip("\ufffd"))
        hold = 0  # hold back a suffix that may be the start of a stop string
        for s in self.stop:
            hold = max([hold] + [n for n in range(1, min(len(s), end + 1)) if full[end - n : end] == s[:n]])
        return self._send(full[: end - hold])

    def _decode(self, n: int) -> str:
        return self.tokenizer.decode(self.ids[:n], skip_special_tokens=self.skip_special)

    def _stop_at(self, text: str) -> tuple[int, str] | None:
        """The first stop string in `text` past what was sent that ends past the floor, and where it begins (None:
        nowhere)."""
        if self._floor is None and len(self.ids) >= self.min_ids - 1:
            self._floor = len(self._decode(self.min_ids - 1))  # the text of the ids that may not complete one
        if self._floor is None:
            return None
        start = max(0, len(self.text) - max(map(len, self.stop)))
        hits = [(i, s) for s in self.stop if (i := text.find(s, max(start, self._floor - len(s) + 1))) >= 0]
        return min(hits, key=lambda h: h[0]) if hits else None

    def flush(self) -> str:
        """At the end: send what was held back (unless a stop string ended the text)."""
        if self.stopped:
            return ""
        return self._send(self._decode(len(self.ids)))

    def _send(self, text: str) -> str:
        delta = text[len(self.text) :]  # text only grows: a prefix already sent is never taken back
        if delta:
            self.text = self.text + delta
        return delta
