"""Incremental detokenization: deltas add up to the text; stop strings are found across token borders."""

from __future__ import annotations

from dsde_core.detokenize import TextStream


class CharTokenizer:
    """Token i is the string PIECES[i]; token 9 is a half UTF-8 character until token 10 completes it."""

    PIECES = ["a", "b", "c", " ", "EN", "D", "x", "y", "z"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = "".join(self.PIECES[i] if i < 9 else "" for i in ids)
        for n, i in enumerate(ids):
            if i == 9:
                text += "é" if n + 1 < len(ids) and ids[n + 1] == 10 else "\ufffd"
        return text


def test_deltas_concatenate_to_the_text() -> None:
    s = TextStream(CharTokenizer())
    parts = [s.add([0, 1]), s.add([2]), s.add([3, 6])]
    assert "".join(parts) == "abc x" == s.text
    assert not s.stopped


def test_stop_string_across_token_borders_truncates_the_text() -> None:
    s = TextStream(CharTokenizer(), stop=("END",))
    out = s.add([0, 1])
    out += s.add([4])  # "EN" may start "END": held back
    assert out == "ab" and not s.stopped
    out += s.add([5, 6])  # "D" completes the stop string
    assert s.stopped and out == "ab" and s.text == "ab"
    assert s.flush() == ""


def test_held_back_prefix_is_released_when_it_is_not_a_stop() -> None:
    s = TextStream(CharTokenizer(), stop=("END",))
    assert s.add([4]) == ""
    assert s.add([6]) == "ENx"


def test_flush_releases_held_back_text_at_the_end() -> None:
    s = TextStream(CharTokenizer(), stop=("END",))
    assert s.add([0, 4]) == "a"
    assert s.flush() == "EN"


def test_incomplete_utf8_waits_for_the_next_token() -> None:
    s = TextStream(CharTokenizer())
    assert s.add([0, 9]) == "a"
    assert s.add([10]) == "é"
