"""Hits on repeats and paraphrases, misses on near-duplicates that ask something else (real model)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from helpers import Flow, chat

from policies.cache.service import SemanticCache
from policies.embedding.embedder import Embedder

pytestmark = pytest.mark.slow

QUESTION = "How do I convert a temperature from Celsius to Fahrenheit?"


async def test_exact_repeat_hits_with_similarity_one(flow: Flow) -> None:
    await flow.answer(chat(QUESTION), "Multiply by 9/5 and add 32.")
    ctx, answer = await flow.ask(chat("  How do I convert a temperature from   Celsius to Fahrenheit? "))
    assert answer is not None and answer.body is not None
    assert ctx.cache_status == "hit" and ctx.lane == "cache"
    assert ctx.cache_similarity == 1.0
    assert answer.headers["x-tierlane-cache"] == "hit"
    assert answer.body["choices"][0]["message"]["content"] == "Multiply by 9/5 and add 32."
    assert answer.body["id"] != "chatcmpl-upstream"
    assert ctx.usage is not None and ctx.usage.output_tokens == 7


# The shipped min_probability is chosen for precision on noisy QQP labels and misses many plain
# paraphrases (policies/cache/MODEL_CARD.md); the hit path is checked with a permissive verifier.
PERMISSIVE = {"verify": {"min_probability": 0.5}}


async def test_paraphrase_hits_with_reported_similarity(open_cache: Callable[..., Awaitable[SemanticCache]], embedder: Embedder) -> None:
    flow = Flow(await open_cache(**PERMISSIVE), embedder)
    await flow.answer(chat(QUESTION), "Multiply by 9/5 and add 32.")
    ctx, answer = await flow.ask(chat("How can I convert a temperature from Celsius into Fahrenheit?"))
    assert answer is not None, ctx.cache_status
    similarity = float(answer.headers["x-tierlane-cache-similarity"])
    assert 0.82 <= similarity < 1.0
    assert ctx.cache_similarity == pytest.approx(similarity, abs=1e-4)


async def test_the_shipped_verifier_refuses_a_paraphrase_it_is_unsure_of(flow: Flow) -> None:
    await flow.answer(chat("How do I learn Python quickly?"), "Write code every day.")
    ctx, answer = await flow.ask(chat("What is the fastest way to learn Python?"))
    assert answer is None and ctx.cache_status == "miss"  # cosine 0.92, verifier 0.86 < 0.96


@pytest.mark.parametrize(
    "near_duplicate",
    [
        "How do I convert a temperature from Fahrenheit to Celsius?",  # direction swapped
        "How do I not convert a temperature from Celsius to Fahrenheit?",  # negation
    ],
)
async def test_near_duplicates_that_mean_otherwise_miss(flow: Flow, near_duplicate: str) -> None:
    await flow.answer(chat(QUESTION), "Multiply by 9/5 and add 32.")
    ctx, answer = await flow.ask(chat(near_duplicate))
    assert answer is None and ctx.cache_status == "miss"


async def test_another_number_misses(flow: Flow) -> None:
    await flow.answer(chat("What is 15 percent of 200?"), "30")
    ctx, answer = await flow.ask(chat("What is 15 percent of 300?"))
    assert answer is None and ctx.cache_status == "miss"
    ctx, answer = await flow.ask(chat("What's 15 percent of 200?"))
    assert answer is not None


async def test_candidate_longer_than_max_tokens_is_not_served(flow: Flow) -> None:
    await flow.answer(chat(QUESTION), "Multiply by 9/5 and add 32.")
    _, answer = await flow.ask(chat(QUESTION, max_tokens=3))
    assert answer is None
    _, answer = await flow.ask(chat(QUESTION, max_tokens=100))
    assert answer is not None
