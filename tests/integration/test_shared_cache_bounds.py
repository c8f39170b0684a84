"""The shared cache's bound in bytes on each replica (`cache.max_memory_bytes`), against a real Valkey server:
past it a replica drops the least recently added vectors from its own index, and keeps knowing every entry."""

from __future__ import annotations

import numpy as np

from policies.cache.scope import CacheKey
from policies.cache.shared import open_shared_cache
from policies.embedding.embedder import DIMENSION
from policies.policy import Policy

MIB = 1 << 20


def _unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIMENSION).astype(np.float32)
    unit: np.ndarray = v / np.linalg.norm(v)
    return unit


def _key(i: int, exact: str | None = None) -> CacheKey:
    return CacheKey(exact=exact or f"{i:064x}", scope=f"{i:063x}s", tenant="acme", model="m", text=f"question {i}")


async def test_past_max_memory_bytes_a_replica_drops_the_oldest_vectors_and_keeps_every_entry(valkey) -> None:
    policy = Policy.load(extra={"cache": {"enabled": True, "max_memory_bytes": MIB, "verify": {"verifier": "off"}}})
    cache = await open_shared_cache(policy, valkey.url, key_prefix="t:", connect_timeout_s=1.0, op_timeout_s=1.0,
                                    stream_max_len=10_000)  # fmt: skip
    try:
        config = cache.config_for(tenant="acme", app="web", model="m", route=None)
        answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "yes"}, "finish_reason": "stop"}]}
        for i in range(600):
            assert await cache.store(_key(i), _unit(i), answer, None, config) > 0
        stats = await cache.stats()
        assert stats["entries_known"] == 600 and stats["memory_bytes"] <= MIB, stats
        assert 300 < stats["vectors"] < 600 and stats["vectors_dropped"] == 600 - stats["vectors"], stats
        # The newest are found by their vectors; the oldest only by their exact key, still served from the store.
        newest = await cache.lookup(_key(599, exact="e" * 64), _unit(599), config)
        assert newest is not None and not newest.exact
        assert await cache.lookup(_key(0, exact="e" * 64), _unit(0), config) is None
        oldest = await cache.lookup(_key(0), None, config)
        assert oldest is not None and oldest.exact
        assert await cache.purge_tenant("acme") == 600  # every entry is still known, so every one is purged
    finally:
        await cache.close()
