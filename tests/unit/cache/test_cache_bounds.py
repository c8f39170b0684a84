"""The cache's bounds in bytes (cache.max_memory_bytes, cache.max_disk_bytes) beside max_entries, and
what a put costs as the cache grows: kept counts, not counting; expiry in chunks."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policies.cache.config import CacheConfig, CachePolicyError
from policies.cache.scope import CacheKey
from policies.cache.service import SemanticCache
from policies.cache.store import EntryStore
from policies.embedding.embedder import DIMENSION

MIB = 1 << 20
OpenCache = Callable[..., Awaitable[SemanticCache]]
OFF = {"verifier": "off"}  # no model to load: these tests are about storage


def _unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIMENSION).astype(np.float32)
    return v / np.linalg.norm(v)


def _key(i: int, tenant: str = "acme") -> CacheKey:
    return CacheKey(exact=f"{i:064x}", scope=f"{i:063x}s", tenant=tenant, model="m", text=f"question {i}")


def _answer(size: int = 10) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * size}, "finish_reason": "stop"}]}


def _put(store: EntryStore, i: int, *, size: int = 10, now: float = 0.0, ttl_s: float = 60.0) -> int:
    entry_id, _ = store.put(exact=f"k{i}", scope="s", tenant="t", model="m", text=f"q{i}", vector=_unit(i),
                            response=_answer(size), usage=None, now=now, ttl_s=ttl_s)  # fmt: skip
    return entry_id


def test_the_bounds_are_policy_settings_with_defaults_that_fit_the_sidecar() -> None:
    base = CacheConfig.from_section({})
    assert base.max_memory_bytes == 256 * MIB and base.max_disk_bytes == 1024 * MIB
    unbounded = CacheConfig.from_section({"max_memory_bytes": None, "max_disk_bytes": None})
    assert unbounded.max_memory_bytes is None and unbounded.max_disk_bytes is None
    with pytest.raises(CachePolicyError, match="max_memory_bytes"):
        CacheConfig.from_section({"max_memory_bytes": 1000})


def test_a_put_reads_no_whole_index(tmp_path: Path) -> None:
    """COUNT(*) reads a whole index: at 100,000 entries every put paid for it."""
    store = EntryStore(tmp_path / "entries.sqlite3")
    try:
        for i in range(20):
            _put(store, i)
        statements: list[str] = []
        store._db.set_trace_callback(statements.append)
        _put(store, 99)
        assert len(store.evict(10)) == 11

        def counting() -> list[str]:
            return [s for s in statements if "COUNT(" in s.upper() or "SUM(" in s.upper()]

        assert statements and not counting()
        store.evict(10, 1 << 30)
        store.expire(1.0, 256)
        assert not counting() and store.count == 10
    finally:
        store.close()


def test_the_kept_count_and_bytes_follow_every_write_and_another_connection_s(tmp_path: Path) -> None:
    path = tmp_path / "entries.sqlite3"
    store = EntryStore(path)

    def counted() -> tuple[int, int]:
        return store.count, store.nbytes

    def recounted() -> tuple[int, int]:
        store._recount()
        return store.count, store.nbytes

    try:
        for i in range(30):
            _put(store, i, size=100 * i)
        _put(store, 3, size=5000)  # replaces k3
        store.touch_many({1: (1, 5.0)})
        store.purge_key("k4")
        store.evict_oldest(2)
        store.expire(0.0)
        kept = counted()
        assert kept[0] == 27 and kept == recounted()
        assert store.adopt_vector_space("another/space") == 27 and counted() == recounted()
        assert store.changed_elsewhere() is False
        other = sqlite3.connect(path)  # the CLI's purge, from another process
        other.execute("DELETE FROM entries WHERE text IN ('q10', 'q11')")
        other.commit()
        other.close()
        assert store.changed_elsewhere() is True
        assert store.count == 25 and counted() == recounted()
    finally:
        store.close()


def test_the_stored_bytes_are_what_the_file_holds(tmp_path: Path) -> None:
    path = tmp_path / "entries.sqlite3"
    store = EntryStore(path)
    try:
        for i in range(400):
            _put(store, i, size=2000)
        store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert 0.9 < os.path.getsize(path) / store.nbytes < 1.2
    finally:
        store.close()


def test_expired_entries_are_deleted_a_chunk_at_a_time(tmp_path: Path) -> None:
    store = EntryStore(tmp_path / "entries.sqlite3")
    try:
        for i in range(30):
            _put(store, i, ttl_s=1.0)
        assert len(store.expire(5.0, 10)) == 10 and store.count == 20
        assert len(store.expire(5.0)) == 20 and store.count == 0
    finally:
        store.close()


async def _fill(cache: SemanticCache, ids: range, *, size: int = 10) -> None:
    for i in ids:
        await cache.store(_key(i), _unit(i), _answer(size), None, cache.base)


async def _hits(cache: SemanticCache, ids: range) -> list[int]:
    return [i for i in ids if await cache.lookup(_key(i), None, cache.base) is not None]


async def test_past_max_memory_bytes_the_least_recently_used_go(open_cache: OpenCache) -> None:
    cache = await open_cache(max_memory_bytes=MIB, verify=OFF)
    await _fill(cache, range(500))  # under the bound (~1.8 KB an entry)
    assert (await cache.stats())["entries"] == 500
    assert await _hits(cache, range(1)) == [0]  # the oldest, now used
    await _fill(cache, range(500, 1000))
    stats = await cache.stats()
    assert stats["memory_bytes"] <= MIB and stats["vectors"] == stats["entries"] < 1000
    assert MIB - stats["memory_bytes"] < 2 * (4 * DIMENSION + 300)  # evicted down to the bound, not far below
    kept = await _hits(cache, range(1000))
    assert 0 in kept and 1 not in kept and kept[-1] == 999 and len(kept) == stats["entries"]
    assert kept[1:] == list(range(1000 - len(kept) + 1, 1000))
    # Each kept entry still answers its own vector, within its own scope only.
    found = await cache.lookup(CacheKey(exact="f" * 64, scope=_key(999).scope, tenant="acme", model="m",
                                        text="question 999"), _unit(999), cache.base)  # fmt: skip
    assert found is not None and found.entry_id > 0 and not found.exact


async def test_past_max_disk_bytes_the_least_recently_used_go(open_cache: OpenCache, tmp_path: Path) -> None:
    cache = await open_cache(max_disk_bytes=MIB, verify=OFF)
    await _fill(cache, range(200), size=20_000)
    stats = await cache.stats()
    assert MIB - 25_000 < stats["stored_bytes"] <= MIB and stats["entries"] < 60
    assert await _hits(cache, range(200)) == list(range(200 - stats["entries"], 200))
    assert stats["vectors"] == stats["entries"]


async def test_a_purge_by_another_process_drops_the_vectors_too(open_cache: OpenCache, tmp_path: Path) -> None:
    cache = await open_cache(verify=OFF)
    await _fill(cache, range(10))
    other = EntryStore(tmp_path / "cache" / "entries.sqlite3")  # `tierlane cache purge`, while the gateway runs
    assert len(other.purge_tenant("acme")) == 10
    other.close()
    await _fill(cache, range(10, 11))
    stats = await cache.stats()
    assert stats["entries"] == stats["vectors"] == 1 and stats["memory_bytes"] < 4 * DIMENSION + 300


async def test_a_lowered_bound_applies_at_start(open_cache: OpenCache, tmp_path: Path) -> None:
    cache = await open_cache(tmp_path / "s", verify=OFF)
    await _fill(cache, range(800))
    await cache.close()
    cache = await open_cache(tmp_path / "s", max_memory_bytes=MIB, verify=OFF)
    stats = await cache.stats()
    assert stats["memory_bytes"] <= MIB and 0 < stats["entries"] < 800
    assert await _hits(cache, range(799, 800)) == [799]
