"""The token estimate's two ways of counting give the same number on every text."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.trim.messages import RUNS_MIN_CHARS, estimate_by_regex, estimate_by_runs, estimate_tokens

# word characters, spaces of both kinds, line breaks, punctuation and non-ASCII of every class
# (letters, digits, spaces, an arrow as Claude Code's Read numbers its lines)
_PIECES = ["a", "Z", "_", "9", "abcdefghij", " ", "   ", "\t", "\n", "\n\n", "\r", "\x0b", "\x1c", ".", "(", "→",
           "é", "漢", "²", "٠", "\x85", "\xa0", "\u2028", "\u3000", "😀"]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=80))
def test_runs_count_equals_the_regex_count(pieces: list[str]) -> None:
    text = "".join(pieces)
    assert estimate_by_runs(text) == estimate_by_regex(text)


def test_every_character_alone_and_in_runs_counts_the_same() -> None:
    for code in range(0x3000):
        c = chr(code)
        if 0xD800 <= code < 0xE000:
            continue
        for text in (c, c + c, "a" + c + "a", " " + c, c + "\n", c + "     x", c * 9):
            assert estimate_by_runs(text) == estimate_by_regex(text), (hex(code), text)


def test_source_files_count_the_same_both_ways_and_long_texts_take_the_runs() -> None:
    root = Path(__file__).resolve().parents[3]
    files = sorted((root / "gateway").rglob("*.py"))[:40]
    assert files
    for path in files:
        text = path.read_text()
        numbered = "".join(f"{i:>6}→{line}\n" for i, line in enumerate(text.splitlines(), 1))  # a Read tool's listing
        for t in (text, numbered):
            assert estimate_by_runs(t) == estimate_by_regex(t)
    long_text = "x" * RUNS_MIN_CHARS
    assert estimate_tokens(long_text) == estimate_by_regex(long_text) == RUNS_MIN_CHARS // 4


def test_many_distinct_non_ascii_characters_fall_back_to_the_regex() -> None:
    text = "".join(chr(0x4E00 + i) for i in range(40))
    assert estimate_by_runs(text) is None
    assert estimate_tokens(text * 20) == estimate_by_regex(text * 20)
