"""Incremental detokenization: deltas add up to the text; stop strings are found across token borders. A token's
own bytes."""

from __future__ import annotations

import pytest

from dsde_core.detokenize import TextStream, token_bytes


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


def test_a_stop_string_keeps_the_ids_up_to_the_one_that_completes_it() -> None:
    """Several ids at once (a speculative step): those after the one completing the first stop string to end are
    dropped, so the ids are those of decoding one token at a time."""
    s = TextStream(CharTokenizer(), stop=("END", "bx"))
    assert s.add([0]) == "a" and s.kept == 1
    out = s.add([4, 5, 1, 6, 7])  # "END" ends at the 2nd id, "bx" at the 4th: the first to end wins
    assert s.stopped and s.kept == 2 and s.ids == [0, 4, 5] and out == "" and s.text == "a"
    t = TextStream(CharTokenizer(), stop=("bx", "xyz"))
    out = t.add([0, 1, 6, 7, 8])  # "bx" ends first, though "xyz" starts after it
    assert t.kept == 3 and t.ids == [0, 1, 6] and out == "a"


def test_keep_stop_ends_the_text_after_the_stop_string_and_names_it() -> None:
    """vLLM's include_stop_str_in_output: the text ends after the stop string, not before it; the same ids are kept."""
    s = TextStream(CharTokenizer(), stop=("xyz", "END"), keep_stop=True)
    out = s.add([0, 4])  # "EN" may start "END": held back
    out += s.add([5, 6, 7])  # "D" completes "END"; the rest of the step is dropped
    assert s.stopped and s.matched == "END" and s.kept == 1 and out == s.text == "aEND" and s.flush() == ""
    plain = TextStream(CharTokenizer(), stop=("xyz", "END"))
    assert plain.add([0, 4, 5, 6]) == "a" and plain.matched == "END" and plain.ids == s.ids


class SpecialTokenizer(CharTokenizer):
    """CharTokenizer with token 11, the special "<s>"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        mark = "" if skip_special_tokens else "<s>"
        return "".join(mark if i == 11 else CharTokenizer.decode(self, [i]) for i in ids)


def test_special_tokens_are_left_out_of_the_text_unless_asked_for() -> None:
    """vLLM's skip_special_tokens: by default a special token adds no text; kept, it does, and a stop string can
    match it (the text as sent). The ids are the same either way."""
    skip, keep = TextStream(SpecialTokenizer()), TextStream(SpecialTokenizer(), skip_special=False)
    assert [skip.add([0, 11]), skip.add([1])] == ["a", "b"] and skip.ids == [0, 11, 1]
    assert [keep.add([0, 11]), keep.add([1])] == ["a<s>", "b"] and keep.ids == [0, 11, 1]
    stopped = TextStream(SpecialTokenizer(), stop=("<s>",), skip_special=False)
    assert stopped.add([0, 11, 1]) == "a" and stopped.stopped and stopped.kept == 2
    assert TextStream(SpecialTokenizer(), stop=("<s>",)).add([0, 11, 1]) == "ab"


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


@pytest.mark.real_models
@pytest.mark.parametrize("text", ["\ua66e", "🦜🪿 and 𓀀", "é中文 😀", "hello <|im_end|>"])
def test_a_tokens_bytes_are_its_own_even_where_it_holds_part_of_a_character(text: str) -> None:
    """Qwen's byte-level BPE: a character split across tokens has part of its UTF-8 in each (decoded alone, each reads
    U+FFFD); the tokens' bytes joined are the text's UTF-8."""
    from transformers import AutoTokenizer

    from tests.service_support import qwen_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    ids = tokenizer(text)["input_ids"]
    raw = token_bytes(tokenizer)
    assert b"".join(raw(i) for i in ids) == text.encode()
    if text == "\ua66e":
        assert len(ids) == 2 and tokenizer.decode([ids[0]]) == "\ufffd"  # the case the bytes exist for


def test_byte_fallback_tokens_and_other_tokens() -> None:
    """SentencePiece's <0xNN> byte tokens are that byte; a tokenizer of neither kind gives its text's UTF-8."""

    class Pieces(CharTokenizer):
        def convert_ids_to_tokens(self, token_id: int) -> str:
            return "<0xE2>" if token_id == 9 else self.PIECES[token_id]

    raw = token_bytes(Pieces())
    assert raw(9) == b"\xe2" and raw(0) == b"a" and raw(4) == b"EN"


def test_under_min_ids_a_stop_string_does_not_count() -> None:
    """min_tokens: a stop string counts only where the min_ids-th id or a later one completes it, as vLLM checks."""
    s = TextStream(CharTokenizer(), ("c",), min_ids=4)
    assert s.add([0, 1, 2]) == "abc" and not s.stopped  # the 3rd id completed it: too early
    assert s.add([3, 2, 6]) == " " and s.stopped and s.kept == 2  # the 5th completes the next one
    early = TextStream(CharTokenizer(), ("c",), min_ids=3)
    assert early.add([0, 1, 2]) == "ab" and early.stopped
    across = TextStream(CharTokenizer(), ("END",), min_ids=2)  # begun by the 1st id, completed by the 2nd: counts
    assert across.add([4, 5]) == "" and across.stopped
    late = TextStream(CharTokenizer(), ("END",), min_ids=3)
    assert late.add([4, 5]) + late.flush() == "END" and not late.stopped
