"""The local tokenizer's work per request is bounded: pieces of CHUNK_CHARS, EXACT_CHARS in all."""

from __future__ import annotations

from telemetry.tokens import CHUNK_CHARS, EXACT_CHARS, bounded, chunks, count_texts, estimate_usage, load_local_tokenizer


def spy() -> tuple[list[int], object]:
    seen: list[int] = []

    def encode(text: str) -> int:
        seen.append(len(text))
        return len(text.split())  # one token a word: exact for what the test builds

    return seen, encode


def test_a_huge_text_is_tokenized_in_bounded_pieces_and_the_rest_estimated():
    seen, encode = spy()
    text = "word " * 800_000  # 4 MB
    count = bounded(encode)  # type: ignore[arg-type]
    tokens = count(text)
    assert max(seen) <= CHUNK_CHARS and sum(seen) <= EXACT_CHARS
    assert abs(tokens - 800_000) <= 800_000 * 0.001  # the rest at the density counted: exact for uniform text
    assert "".join(chunks(text[:100_000])) == text[:100_000]
    assert all(piece.endswith(" ") for piece in list(chunks(text[:100_000]))[:-1])  # cut between words


def test_a_request_tokenizes_at_most_exact_chars_over_all_its_texts():
    seen, encode = spy()
    texts = ["alpha beta " * 20_000] * 10  # 2.2 MB in ten messages
    total = count_texts(bounded(encode), texts)  # type: ignore[arg-type]
    assert sum(seen) <= EXACT_CHARS and max(seen) <= CHUNK_CHARS
    assert abs(total - 400_000) <= 400


def test_the_real_tokenizer_counts_long_punctuation_without_encoding_it_whole():
    count = load_local_tokenizer()
    short = "!?" * 1000
    assert count(short) == 2000  # WordPiece: a token per punctuation mark
    usage = estimate_usage(count, {"messages": [{"role": "user", "content": "!?" * 2_000_000}]}, None)
    assert 3_900_000 <= usage.input_tokens <= 4_100_000 and usage.estimated
