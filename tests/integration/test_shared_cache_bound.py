"""cache.max_error_rate with the shared cache: a judged hit observed on one replica reaches every
replica's error bound through the cache's stream (real Valkey; no gateway, no embedder)."""

from __future__ import annotations

import asyncio

from policies.cache.shared import open_shared_cache
from policies.policy import Policy


async def test_judged_hits_reach_the_error_bound_of_every_replica(valkey):
    policy = Policy.load(extra={"cache": {"max_error_rate": 0.02}})
    a, b = [
        await open_shared_cache(policy, valkey.url, key_prefix="t:", connect_timeout_s=1.0, op_timeout_s=1.0,
                                stream_max_len=1000)  # fmt: skip
        for _ in range(2)
    ]
    try:
        await b.catch_up(5.0)
        config = a.config_for(tenant="acme", app="web", model="m", route=None)
        assert config.bound is not None and config.bound.start == config.verify.min_probability
        await a.observe("acme/web", config.bound, 42, 0.97, wrong=False)
        await a.observe("acme/web", config.bound, 43, 0.98, wrong=True)
        for _ in range(100):
            stats = b.bounds.stats()
            if stats and stats[0].observed == 2:
                break
            await asyncio.sleep(0.05)
        (on_a,), (on_b,) = a.bounds.stats(), b.bounds.stats()
        assert (on_b.scope, on_b.observed, on_b.observed_wrong) == ("acme/web", 2, 1)
        assert on_b.threshold == on_a.threshold > 0.98  # the same estimate, tightened past the error on both
    finally:
        await a.close()
        await b.close()
