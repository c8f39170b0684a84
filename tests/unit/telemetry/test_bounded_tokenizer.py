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


def test_a_large_prompt_left_by_its_client_is_counted_off_the_event_loop(monkeypatch) -> None:
    """A 499 bills the prompt read: a long one is tokenized on a worker thread, never on the loop."""
    import asyncio
    import threading

    from policies.domain import Outcome
    from telemetry.tokens import resolve_usage
    from tests.unit.telemetry.conftest import make_ctx

    threads: list[str] = []

    def count(text: str) -> int:
        threads.append(threading.current_thread().name)
        return len(text.split())

    async def run(content: str) -> int:
        ctx = make_ctx(body={"model": "m", "messages": [{"role": "user", "content": content}]}, lane_seconds=0.5)
        usage = await resolve_usage(ctx, Outcome(status=499, response=None, complete=False), count)
        return usage.input_tokens

    main = threading.current_thread().name
    assert asyncio.run(run("word " * 20_000)) > 20_000 and threads and main not in threads
    threads.clear()
    asyncio.run(run("short"))
    assert threads == [main]  # a short one is counted inline: the hop would cost more
