"""Incremental detokenization with stop strings: text streams out as tokens are accepted."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Turns a growing list of token ids into text deltas; finds stop strings, even across token borders."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # the text sent so far
        self.stopped = False

    def add(self, ids: list[int]) -> str:
        """Append token ids; return the new text that is safe to send. Sets `stopped` on a stop string."""
        self.ids.extend(ids)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stop:
            start = max(0, len(self.text) - max(map(len, self.stop)))
            hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._send(full[: min(hits)])
        end = len(full)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            end = len(full.rstrip("\ufffd"))
        hold = 0  # hold back a suffix that may be the start of a stop string
        for s in self.stop:
            hold = max([hold] + [n for n in range(1, min(len(s), end + 1)) if full[end - n : end] == s[:n]])
        return self._send(full[: end - hold])

    def flush(self) -> str:
        """At the end: send what was held back (unless a stop string ended the text)."""
        if self.stopped:
            return ""
        return self._send(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _send(self, text: str) -> str:
        delta = text[len(self.text) :]  # text only grows: a prefix already sent is never taken back
        if delta:
            self.text = self.text + delta
        return delta
