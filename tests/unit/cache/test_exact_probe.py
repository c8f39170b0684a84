"""The exact-key probe reads on the event loop's own thread: an exact hit never waits for the cache's
worker (which may be busy with a search or a write), its hits still reach the store (in batches),
deletions are seen at once, and a read connection that fails hands the probe to the worker."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from policies.cache.config import CacheConfig
from policies.cache.scope import CacheKey
from policies.cache.service import SemanticCache

ANSWER = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}}]}
USAGE = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def _key(text: str = "what is two plus two?", tenant: str = "acme") -> CacheKey:
    return CacheKey(scope="s" * 64, exact=(text.encode().hex() + "0" * 64)[:64], text=text, tenant=tenant, model="m")


async def _cache(open_cache: Callable[..., Awaitable[SemanticCache]]) -> tuple[SemanticCache, CacheConfig]:
    cache = await open_cache(semantic=False)
    config = cache.config_for(tenant="acme", app="web", model="m", route=None)
    await cache.store(_key(), None, ANSWER, USAGE, config)
    return cache, config


async def test_an_exact_hit_does_not_wait_for_a_busy_worker(open_cache: Callable[..., Awaitable[SemanticCache]]) -> None:
    """The worker is held busy until the lookups are done (not for a while a slow machine may outlast):
    a lookup that waited for it would never end, and the timeout, far above what a probe takes, says so."""
    cache, config = await _cache(open_cache)
    working, release = threading.Event(), threading.Event()

    def long_job() -> None:  # a long search or write on the worker
        working.set()
        release.wait(120)

    busy = asyncio.ensure_future(cache._call(long_job))
    try:
        assert await asyncio.to_thread(working.wait, 60)
        async with asyncio.timeout(30):
            hit = await cache.lookup(_key(), None, config)
            assert hit is not None and hit.exact and hit.response == ANSWER
            # exact only: no trip to the worker either
            miss = await cache.lookup(_key("something never stored"), None, config)
            assert miss is None
    finally:
        release.set()
        await busy


async def test_hits_reach_the_store_in_batches(open_cache: Callable[..., Awaitable[SemanticCache]]) -> None:
    cache, config = await _cache(open_cache)
    for _ in range(5):
        assert await cache.lookup(_key(), None, config) is not None
    if cache._touching is not None:
        await cache._touching
    assert (await cache.stats())["hits"] == 5


async def test_a_purge_is_seen_by_the_next_probe(open_cache: Callable[..., Awaitable[SemanticCache]]) -> None:
    cache, config = await _cache(open_cache)
    assert await cache.lookup(_key(), None, config) is not None
    assert await cache.purge_tenant("acme") == 1
    assert await cache.lookup(_key(), None, config) is None


async def test_a_failing_read_connection_hands_the_probe_to_the_worker(open_cache: Callable[..., Awaitable[SemanticCache]]) -> None:
    cache, config = await _cache(open_cache)
    assert cache._reader is not None
    cache._reader.close()  # every read on it now raises sqlite3.ProgrammingError
    hit = await cache.lookup(_key(), None, config)
    assert hit is not None and hit.exact
