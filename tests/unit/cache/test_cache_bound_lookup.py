"""The cache's lookup under cache.max_error_rate (real model, cache and verifier): the bound's threshold
decides, a hit carries the score it was served at, and a candidate the bound alone refused is left
on the request for the shadow stage to judge."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from helpers import Flow, chat

from policies.cache.service import SemanticCache
from policies.embedding.embedder import Embedder

pytestmark = pytest.mark.slow

QUESTION = "How do I convert a temperature from Celsius to Fahrenheit?"
PARAPHRASE = "How can I convert a temperature from Celsius into Fahrenheit?"


async def test_the_bound_serves_then_refuses_once_tightened(open_cache: Callable[..., Awaitable[SemanticCache]], embedder: Embedder) -> None:
    cache = await open_cache(verify={"min_probability": 0.5}, max_error_rate=0.02)
    flow = Flow(cache, embedder)
    await flow.answer(chat(QUESTION), "Multiply by 9/5 and add 32.")
    ctx, answer = await flow.ask(chat(PARAPHRASE))
    assert answer is not None and ctx.cache_candidate is None
    score = ctx.attributes["tierlane.cache.score"]
    assert 0.5 <= score <= 1.0 and isinstance(ctx.attributes["tierlane.cache.entry_id"], int)
    params = cache.config_for(tenant="acme", app="web", model="auto", route=None).bound
    assert params is not None and params.start == 0.5
    await cache.observe("acme/web", params, 12345, min(1.0, score + 0.001), wrong=True)  # tightens past the paraphrase
    ctx, answer = await flow.ask(chat(PARAPHRASE))
    assert answer is None and ctx.cache_status == "miss"
    assert ctx.cache_candidate is not None and ctx.cache_candidate.score == pytest.approx(score)
    assert ctx.cache_candidate.response["choices"][0]["message"]["content"] == "Multiply by 9/5 and add 32."
    ctx, answer = await flow.ask(chat(PARAPHRASE), tenant="globex")  # another tenant: its own scope, nothing stored
    assert answer is None and ctx.cache_candidate is None
    (stats,) = [s for s in cache.bounds.stats() if s.scope == "acme/web"]
    assert (stats.lookups, stats.hits, stats.semantic_hits) == (3, 1, 1)


async def test_with_the_verifier_off_the_bound_moves_the_cosine_gate(open_cache: Callable[..., Awaitable[SemanticCache]], embedder: Embedder) -> None:
    cache = await open_cache(verify={"verifier": "off"}, max_error_rate=0.02)
    params = cache.config_for(tenant="acme", app="web", model="auto", route=None).bound
    assert params is not None and params.kind == "cosine" and params.start == 0.80 and params.floor < 0.80
    flow = Flow(cache, embedder)
    await flow.answer(chat(QUESTION), "Multiply by 9/5 and add 32.")
    ctx, answer = await flow.ask(chat(PARAPHRASE))
    assert answer is not None and ctx.attributes["tierlane.cache.score"] == pytest.approx(ctx.cache_similarity, abs=1e-4)
    await cache.observe("acme/web", params, 12345, min(1.0, ctx.cache_similarity + 0.001), wrong=True)
    ctx, answer = await flow.ask(chat(PARAPHRASE))
    assert answer is None and ctx.cache_candidate is not None and ctx.cache_candidate.score > 0.80
