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
        self.kept = 0  # of the last add's ids, those kept: all, or on a stop string up to the one completing it

    def add(self, ids: list[int]) -> str:
        """Append token ids; return the new text that is safe to send. On a stop string: sets `stopped` and keeps
        only the ids up to the one that completes it (`kept` of them), as decoding one token at a time would have
        stopped there; the text ends before the stop string."""
        before, self.kept = len(self.ids), len(ids)
        self.ids.extend(ids)
        full = self._decode(len(self.ids))
        if self.stop and self._stop_at(full) is not None:
            # the fewest of these ids whose text holds a stop string (speculation accepts several tokens a step)
            for self.kept in range(1, len(ids) + 1):
                text = self._decode(before + self.kept)
                if (at := self._stop_at(text)) is not None:
                    break
            del self.ids[before + self.kept :]
            self.stopped = True
            return self._send(text[:at])
        end = len(full)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            end = len(full.rstrip("\ufffd"))
        hold = 0  # hold back a suffix that may be the start of a stop string
        for s in self.stop:
            hold = max([hold] + [n for n in range(1, min(len(s), end + 1)) if full[end - n : end] == s[:n]])
        return self._send(full[: end - hold])

    def _decode(self, n: int) -> str:
        return self.tokenizer.decode(self.ids[:n], skip_special_tokens=True)

    def _stop_at(self, text: str) -> int | None:
        """Where the first stop string begins in `text` past what was sent (None: nowhere)."""
        start = max(0, len(self.text) - max(map(len, self.stop)))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

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
