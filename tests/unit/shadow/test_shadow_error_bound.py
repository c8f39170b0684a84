"""The shadow hook judges sampled semantic cache hits for cache.max_error_rate: real cache, embedder and upstream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.context import Outcome, Principal, RequestContext
from gateway.pipeline import shadow
from gateway.services import Services
from gateway.settings import Settings
from gateway.upstream.pool import UpstreamPool
from policies.cache.service import CacheHit, SemanticCache
from policies.policy import Policy
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.unit.shadow.conftest import UPSTREAM_ANSWER, chat_answer

pytestmark = pytest.mark.slow


def cache_hit(app: str, *, exact: bool, entry_id: int = 7, score: float = 0.97) -> RequestContext:
    ctx = RequestContext(
        request_id="req-cache", operation="chat", headers={}, principal=Principal("acme", app), model="auto",
        body={"model": "auto", "messages": [{"role": "user", "content": "Which city is France's capital?"}], "max_tokens": 16},
        lane="cache",
    )
    ctx.attributes.update({"tierlane.cache.exact": exact, "tierlane.cache.entry_id": entry_id, "tierlane.cache.score": score})
    return ctx


async def test_semantic_hits_are_judged_for_the_bound_of_their_app(tmp_path: Path, embedder: Any, upstream: Any) -> None:
    app, rec = upstream
    settings = Settings.load(env={}, overrides={**PASS_THROUGH, "state_dir": str(tmp_path), "upstreams": [upstream_cfg("up", app.url + "/v1", retries=0)]})
    # shadow.sample_rate stays 0: the bound samples on its own (every semantic hit here), for the app that sets it
    policy = Policy.load(extra={"shadow": {"seed": 0}, "cache": {
        "error_sample_rate": 1.0, "overrides": [{"match": {"app": "web"}, "set": {"max_error_rate": 0.02}}]}})
    pool = UpstreamPool(settings)
    await pool.start()
    cache = SemanticCache(tmp_path, policy)
    await cache.start()
    hook = shadow.build(Services(settings=settings, policy=policy, pool=pool, embedder=embedder, cache=cache))
    assert hook is not None
    try:
        done = lambda text: Outcome(status=200, response=chat_answer(text), complete=True, finish_reasons=["stop"])  # noqa: E731
        await hook.on_complete(cache_hit("web", exact=False), done("Bananas are rich in potassium."))
        await hook.on_complete(cache_hit("web", exact=False, entry_id=8), done(UPSTREAM_ANSWER))
        await hook.on_complete(cache_hit("web", exact=True), done("Bananas are rich in potassium."))  # a repeat: not judged
        await hook.on_complete(cache_hit("batch", exact=False), done("Bananas are rich in potassium."))  # no bound there
        # A miss whose candidate the bound alone refused: judged against the upstream's own answer, no call
        miss = cache_hit("web", exact=False)
        miss.lane, miss.attributes = "upstream", {}
        miss.cache_candidate = CacheHit(9, "k", chat_answer("Paris, France's capital."), None, 0.9, False, score=0.91)
        await hook.on_complete(miss, done(UPSTREAM_ANSWER))
        await hook.drain()
        assert rec.hits == 2 and hook.judged == 2 and hook.judged_refused == 1
        (stats,) = cache.bounds.stats()
        assert (stats.scope, stats.observed, stats.observed_wrong) == ("acme/web", 3, 1)
        assert stats.threshold >= 0.96  # a new scope with an error: never looser than the shipped threshold
    finally:
        await hook.close()
        await cache.close()
        await pool.close()
