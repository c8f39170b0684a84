"""Admission rules, restart, TTL, LRU eviction and purge over the real SQLite store and faiss index."""

from __future__ import annotations

import pytest
from helpers import Flow, chat, completion

from gateway.context import Outcome
from policies.cache.service import SemanticCache

pytestmark = pytest.mark.slow

Q = "How many bytes are in a kilobyte?"


@pytest.mark.parametrize(
    "finish, complete, status",
    [("length", True, 200), ("stop", False, 200), ("stop", True, 500), ("tool_calls", True, 200)],
)
async def test_only_complete_successful_stop_answers_are_admitted(flow: Flow, finish: str, complete: bool, status: int) -> None:
    await flow.answer(chat(Q), "1000 or 1024.", finish=finish, complete=complete, status=status)
    _, answer = await flow.ask(chat(Q))
    assert answer is None


async def test_cache_control_headers(flow: Flow) -> None:
    await flow.answer(chat(Q), "1000 or 1024.", headers={"Cache-Control": "no-store"})
    _, answer = await flow.ask(chat(Q))
    assert answer is None
    await flow.answer(chat(Q), "1000 or 1024.")
    ctx, answer = await flow.ask(chat(Q), headers={"cache-control": "max-age=0, no-cache"})
    assert answer is None and ctx.cache_status == "bypass"


async def test_store_hook_never_raises(flow: Flow) -> None:
    ctx, _ = await flow.ask(chat(Q))
    broken = Outcome(status=200, response={"choices": "nonsense"}, complete=True, finish_reasons=["stop"])
    await flow.store.on_complete(ctx, broken)
    ctx.cache_key = "not a key"
    await flow.store.on_complete(ctx, Outcome(status=200, response=completion("x"), complete=True, finish_reasons=["stop"]))


@pytest.mark.parametrize("drop_index_file", [False, True])
async def test_survives_a_restart(open_cache, embedder, tmp_path, drop_index_file: bool) -> None:
    permissive = {"verify": {"min_probability": 0.5}}  # the paraphrase below is not one the shipped verifier serves
    cache: SemanticCache = await open_cache(tmp_path / "s", **permissive)
    await Flow(cache, embedder).answer(chat(Q), "1000 or 1024.")
    await cache.close()
    assert (tmp_path / "s" / "cache" / "vectors.faiss").exists()
    if drop_index_file:
        (tmp_path / "s" / "cache" / "vectors.faiss").unlink()
    reopened = Flow(await open_cache(tmp_path / "s", **permissive), embedder)
    ctx, answer = await reopened.ask(chat("How many bytes does a kilobyte have?"))
    assert answer is not None and ctx.cache_similarity is not None and ctx.cache_similarity < 1.0


async def test_vectors_of_another_embedding_are_dropped_on_start(embedder, tmp_path) -> None:
    from policies.policy import Policy

    policy = Policy.load(extra={"cache": {"verify": {"min_probability": 0.5}}})
    paraphrase = chat("How many bytes does a kilobyte have?")

    async def reopen(space: str | None) -> tuple[SemanticCache, Flow]:
        cache = SemanticCache(tmp_path / "s", policy, vector_space=space)
        await cache.start()
        return cache, Flow(cache, embedder)

    cache, flow = await reopen(None)  # a store written before vector spaces were recorded: float32
    await flow.answer(chat(Q), "1000 or 1024.")
    await cache.close()
    cache, flow = await reopen("all-MiniLM-L6-v2/fp32")  # the same embedding: nothing dropped
    assert (await flow.ask(paraphrase))[1] is not None
    await cache.close()
    cache, flow = await reopen("all-MiniLM-L6-v2/int8")
    try:
        assert (await flow.ask(paraphrase))[1] is None, "a float32 vector answered an int8 query"
        ctx, answer = await flow.ask(chat(Q))
        assert answer is not None and ctx.cache_similarity == 1.0, "the entry still answers its exact repeat"
        await flow.answer(paraphrase, "1024 bytes.")  # new entries carry vectors of the new embedding
    finally:
        await cache.close()
    cache, flow = await reopen("all-MiniLM-L6-v2/int8")
    try:
        assert (await flow.ask(chat("How many bytes are there in one kilobyte?")))[1] is not None
    finally:
        await cache.close()


async def test_expired_entries_are_not_served(open_cache, embedder) -> None:
    flow = Flow(await open_cache(ttl_s=0), embedder)
    await flow.answer(chat(Q), "1000 or 1024.")
    _, answer = await flow.ask(chat(Q))
    assert answer is None


async def test_least_recently_used_entry_is_evicted(open_cache, embedder) -> None:
    cache = await open_cache(max_entries=2)
    flow = Flow(cache, embedder)
    first, second, third = "What is the boiling point of water?", "Who wrote Hamlet?", "What is the speed of light?"
    await flow.answer(chat(first), "100 C")
    await flow.answer(chat(second), "Shakespeare")
    assert (await flow.ask(chat(first)))[1] is not None  # first is now the most recently used
    await flow.answer(chat(third), "299,792 km/s")
    assert (await flow.ask(chat(second)))[1] is None
    assert (await flow.ask(chat(first)))[1] is not None
    assert (await flow.ask(chat(third)))[1] is not None
    stats = await cache.stats()
    assert stats["entries"] == 2 and stats["vectors"] == 2


async def test_purge_by_tenant_and_by_key(flow: Flow) -> None:
    await flow.answer(chat(Q), "1000", tenant="acme")
    await flow.answer(chat(Q), "1000", tenant="globex")
    _, hit = await flow.ask(chat(Q), tenant="globex")
    assert hit is not None
    assert await flow.lookup.cache.purge_tenant("acme") == 1
    assert (await flow.ask(chat(Q), tenant="acme"))[1] is None
    assert await flow.lookup.cache.purge_key(hit.headers["x-tierlane-cache-key"]) == 1
    assert (await flow.ask(chat(Q), tenant="globex"))[1] is None
