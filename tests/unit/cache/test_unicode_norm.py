"""Keys and embedding texts are normalised in linear time: stream-safe NFKC, bounded per call."""

from __future__ import annotations

import unicodedata

import pytest

from policies.cache import scope
from policies.edge_quality import features
from policies.unicode_norm import CGJ, MAX_NON_STARTERS, nfkc_collapsed, stream_safe

# The quadratic case of CPython's canonical reordering: one run of marks of two combining classes.
HOSTILE = "a" + "\u0301" * 5000 + "\u0316" * 5000


def longest_non_starter_run(text: str) -> int:
    longest = run = 0
    for char in unicodedata.normalize("NFKD", text):
        run = run + 1 if unicodedata.combining(char) else 0
        longest = max(longest, run)
    return longest


def test_what_is_normalised_is_stream_safe():
    # before the fix NFKC reordered one run of 10,000 marks (insertion sort: ~10^8 steps)
    assert longest_non_starter_run(stream_safe(HOSTILE)) == MAX_NON_STARTERS
    assert longest_non_starter_run(scope.normalise(HOSTILE)) <= MAX_NON_STARTERS
    # characters that decompose into non-starters only count too (U+0344 -> U+0308 U+0301)
    assert longest_non_starter_run(stream_safe("a" + "\u0344" * 100)) <= 2 * MAX_NON_STARTERS


def test_ordinary_text_is_normalised_exactly_as_nfkc():
    for text in ("ﬁne  café\u00a0 ｆｕｌｌ", "e\u0301\u0316 x", "Ａ\u0300" * 40, "plain ascii\ttext\n", "한국어 ① ㎏"):
        assert nfkc_collapsed(text) == " ".join(unicodedata.normalize("NFKC", text).split())
    assert stream_safe("e" + "\u0301" * MAX_NON_STARTERS) == "e" + "\u0301" * MAX_NON_STARTERS
    assert CGJ in stream_safe("e" + "\u0301" * (MAX_NON_STARTERS + 1))


def test_normalisation_work_per_call_is_bounded(monkeypatch: pytest.MonkeyPatch):
    seen: list[int] = []
    real = unicodedata.normalize

    def spy(form: str, text: str) -> str:
        seen.append(len(text))
        return real(form, text)

    monkeypatch.setattr(unicodedata, "normalize", spy)
    huge = "é" * (3 * scope.NORMALISE_MAX_CHARS)
    key_text = scope.normalise(huge)
    assert max(seen) <= scope.NORMALISE_MAX_CHARS
    assert key_text != scope.normalise(huge[:-1] + "e")  # the tail still decides the key
    assert key_text == scope.normalise("é" * (3 * scope.NORMALISE_MAX_CHARS))
    seen.clear()
    embedded = scope.embedding_text({"messages": [{"role": "user", "content": huge}]})
    assert embedded == "é" * scope.EMBED_MAX_CHARS and max(seen) <= 2 * scope.EMBED_MAX_CHARS
    seen.clear()
    assert features.normalise(huge) == "é" * features.SAMPLE_CHARS and max(seen) <= 2 * features.SAMPLE_CHARS
