"""The cache lookup embeds a request only where a semantic match can run.

Real embedder (all-MiniLM-L6-v2 on the suite's ONNX backend) behind a wrapper that
counts what is asked of it, real cache: a request with tools, a last turn past
cache.max_text_chars, `Cache-Control: no-cache`, a tenant with the cache off, a hot temperature
and a tool result as the last turn are answered without an embedding, and still served by an
exact repeat where the policy allows one; a plain request is embedded once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from helpers import Flow, Gated, chat, completion

from gateway.context import Outcome
from policies.cache.scope import build_key
from policies.cache.service import SemanticCache
from policies.embedding.embedder import Embedder

pytestmark = pytest.mark.slow

Q = "What is the capital of Australia?"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


class Counting:
    """The real embedder, with every text asked of it kept (embed and embed_if_room alike)."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.asked: list[str] = []

    async def embed(self, text: str) -> np.ndarray:
        self.asked.append(text)
        return await self.inner.embed(text)

    async def embed_if_room(self, text: str) -> np.ndarray | None:
        self.asked.append(text)
        return await self.inner.embed_if_room(text)


@pytest.fixture
def counting(embedder: Embedder) -> Counting:
    return Counting(embedder)


@pytest.fixture
async def counted(open_cache: Callable[..., Awaitable[SemanticCache]], counting: Counting) -> Flow:
    return Flow(await open_cache(max_text_chars=200), counting)  # type: ignore[arg-type]


async def test_a_plain_miss_is_embedded_once(counted: Flow, counting: Counting, embedder: Embedder) -> None:
    encoded = embedder.texts
    ctx, answer = await counted.ask(chat(Q))
    assert answer is None and ctx.cache_status == "miss"
    assert counting.asked == [Q] and embedder.texts == encoded + 1
    assert ctx.embedding is not None and "tierlane.cache.exact_only" not in ctx.attributes


@pytest.mark.parametrize("body, headers, why", [
    (chat(Q, tools=TOOLS), None, "tools"),
    (chat(Q, functions=[{"name": "lookup", "parameters": {}}]), None, "tools"),
    (chat("Explain this: " + "the quick brown fox jumps over the lazy dog " * 6), None, "max_text_chars"),
])  # fmt: skip
async def test_exact_only_requests_are_not_embedded_and_repeats_still_hit(
    counted: Flow, counting: Counting, embedder: Embedder, body: dict[str, Any], headers: dict[str, str] | None, why: str
) -> None:
    encoded = embedder.texts
    ctx = await counted.answer(body, "Canberra.", headers=headers)
    assert ctx.cache_status == "miss" and ctx.attributes["tierlane.cache.exact_only"] == why
    assert ctx.embedding is None
    repeat, answer = await counted.ask(body, headers=headers)
    assert answer is not None and repeat.cache_status == "hit" and repeat.attributes["tierlane.cache.exact"] is True
    assert counting.asked == [] and embedder.texts == encoded


CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
TOOL_RESULT_TURN = {"model": "auto", "tools": TOOLS, "messages": [
    {"role": "user", "content": "Find the capital."}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "Canberra"}]}


@pytest.mark.parametrize("body, headers", [
    (chat(Q), {"Cache-Control": "no-cache"}),
    (chat(Q, temperature=1.5), None),
    (TOOL_RESULT_TURN, None),
])  # fmt: skip
async def test_requests_the_cache_cannot_look_up_are_not_embedded(
    counted: Flow, counting: Counting, embedder: Embedder, body: dict[str, Any], headers: dict[str, str] | None
) -> None:
    encoded = embedder.texts
    ctx, answer = await counted.ask(body, headers=headers)
    assert answer is None and ctx.cache_status == "bypass"
    assert counting.asked == [] and embedder.texts == encoded and ctx.embedding is None


async def test_a_tenant_with_the_cache_off_is_not_embedded(
    open_cache: Callable[..., Awaitable[SemanticCache]], counting: Counting, embedder: Embedder
) -> None:
    cache = await open_cache(overrides=[{"match": {"tenant": "quiet"}, "set": {"enabled": False}}])
    flow = Flow(cache, counting)  # type: ignore[arg-type]
    encoded = embedder.texts
    ctx, answer = await flow.ask(chat(Q), tenant="quiet")
    assert answer is None and ctx.cache_status == "off" and counting.asked == [] and embedder.texts == encoded
    ctx, _ = await flow.ask(chat(Q), tenant="acme")  # the same request of a tenant with the cache on
    assert ctx.cache_status == "miss" and counting.asked == [Q] and embedder.texts == encoded + 1


async def test_no_store_still_looks_up_semantically(counted: Flow, counting: Counting) -> None:
    """no-store forbids storing, not serving: a semantic hit can still answer it, so it is embedded."""
    ctx, answer = await counted.ask(chat(Q), headers={"Cache-Control": "no-store"})
    assert answer is None and ctx.cache_status == "miss" and counting.asked == [Q]


async def test_a_request_with_tools_is_stored_without_its_vector(counted: Flow, embedder: Embedder) -> None:
    """A vector the router computed for a request with tools is not kept: it could never be matched."""
    body = chat(Q, tools=TOOLS)
    ctx, answer = await counted.ask(body)
    assert answer is None
    ctx.embedding = await embedder.embed(Q)  # as the route stage would leave it
    await counted.store.on_complete(ctx, Outcome(status=200, response=completion("Canberra."), complete=True,
                                                 finish_reasons=["stop"]))  # fmt: skip
    cache = counted.lookup.cache
    config = cache.config_for(tenant="acme", app="web", model="auto", route=None)
    key, _ = build_key(body, tenant="acme", model="auto", route=None, rules=config.rules)
    assert key is not None and key.exact_only == "tools"
    assert await cache.lookup(key, None, config) is not None  # stored, and served by its exact key
    as_if_plain = dataclasses.replace(key, exact_only="")  # the same scope, searched by the same vector
    assert await cache.lookup(as_if_plain, ctx.embedding, config, exact=False) is None


async def test_a_full_embedder_leaves_the_lookup_exact(open_cache: Callable[..., Awaitable[SemanticCache]],
                                                      sentence_encoder: Any) -> None:
    """With max_queue texts waiting the lookup goes without its embedding instead of queueing."""
    gated = Gated(sentence_encoder)
    emb = Embedder(model=sentence_encoder, max_queue=1)
    await emb.start()  # warmed up on the real encoder; the gate holds the next encode
    emb._encoder = gated  # type: ignore[assignment]
    loop = asyncio.get_running_loop()
    try:
        flow = Flow(await open_cache(), emb)
        busy = asyncio.ensure_future(emb.embed("held by the worker"))
        await loop.run_in_executor(None, gated.entered.wait, 60)
        waiting = asyncio.ensure_future(emb.embed("waiting for the worker"))
        for _ in range(3):
            await asyncio.sleep(0)  # the call puts its text in the queue
        assert emb._queue is not None and emb._queue.full()
        ctx = flow.context(chat(Q))
        answer = await flow.lookup.run(ctx)
        assert answer is None and ctx.cache_status == "miss" and ctx.embedding is None
        assert ctx.attributes["tierlane.cache.exact_only"] == "embedder_full" and emb.shed == 1
        gated.release.set()
        await asyncio.gather(busy, waiting)
        assert gated.calls == [["held by the worker"], ["waiting for the worker"]]  # the lookup's text never went
    finally:
        gated.release.set()
        await emb.close()
