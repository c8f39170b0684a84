"""The route stage with the real router, policy and embedder: auto decides, overrides and lane availability."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.context import Principal, RequestContext
from gateway.errors import PermissionDenied, UpstreamUnavailable
from gateway.pipeline.route import RouteStage
from policies.embedding.embedder import Embedder
from policies.policy import Policy
from policies.router import RoutePolicy, Router


def stage(model: Router, embedder: Embedder | None, *, edge: bool = True, upstream: bool = True,
          **extra: object) -> RouteStage:
    return RouteStage(
        router=model, policy=RoutePolicy(Policy.load(extra=extra), model), embedder=embedder,
        edge_available=edge, upstream_available=upstream, pool_names=["standard", "critical"] if upstream else [],
        edge_model="edge", pool_model={"standard": "standard-model", "critical": "critical-model"}.get,
    )


def ctx(model: str = "auto", header: str | None = None, text: str = "What is 2+2?", tenant: str = "t") -> RequestContext:
    """A request as the resolve stage leaves it: the route header validated, `auto` on the default pool."""
    c = RequestContext(
        request_id="r", operation="chat", body={"model": model, "messages": [{"role": "user", "content": text}]},
        headers={"x-tierlane-route": header} if header else {}, principal=Principal(tenant, "a"), model=model,
        requested_route=header,  # type: ignore[arg-type]
    )
    if c.auto:
        c.lane, c.pool, c.target_model = "upstream", "standard", "standard-model"
    return c


async def test_auto_is_decided_by_the_router(shipped_router: Router, embedder: Embedder) -> None:
    c = ctx(text="Prove that every bounded monotone sequence of reals converges.")
    assert await stage(shipped_router, embedder).run(c) is None
    assert c.route is not None and 0.0 <= c.route.score <= 1.0
    assert c.embedding is not None and c.embedding.shape == (384,)  # shared with later stages
    expected = "upstream" if c.route.score >= c.route.threshold else "edge"
    assert c.lane == c.route.lane == expected
    assert c.attributes["tierlane.route.reason"] in ("router_strong", "router_weak")
    assert c.attributes["tierlane.route.score"] == pytest.approx(c.route.score, abs=1e-6)
    assert (c.pool, c.target_model) == (("standard", "standard-model") if expected == "upstream" else (None, "edge"))


async def test_threshold_policy_splits_both_ways(shipped_router: Router, embedder: Embedder) -> None:
    low = stage(shipped_router, embedder, router={"target": {"mode": "threshold", "value": 0.0}})
    high = stage(shipped_router, embedder, router={"target": {"mode": "threshold", "value": 1.0}})
    a, b = ctx(), ctx()
    await low.run(a)
    await high.run(b)
    assert (a.lane, b.lane) == ("upstream", "edge")
    assert a.route.score == pytest.approx(b.route.score, abs=1e-6)


async def test_existing_embedding_is_used(shipped_router: Router) -> None:
    c = ctx()
    c.embedding = np.zeros(384, dtype=np.float32)
    await stage(shipped_router, None).run(c)
    assert c.route.score == pytest.approx(shipped_router.score(c.body["messages"], c.embedding))


async def test_engine_off_sends_everything_upstream(shipped_router: Router) -> None:
    c = ctx()
    await stage(shipped_router, None, edge=False).run(c)
    assert (c.lane, c.route.reason, c.pool) == ("upstream", "edge_unavailable", "standard")
    forced = ctx(header="edge")
    await stage(shipped_router, None, edge=False).run(forced)
    assert (forced.lane, forced.route.reason) == ("upstream", "edge_unavailable")


async def test_no_upstream_sends_everything_to_edge(shipped_router: Router) -> None:
    c = ctx()
    await stage(shipped_router, None, upstream=False).run(c)
    assert (c.lane, c.route.reason, c.pool, c.target_model) == ("edge", "no_upstream", None, "edge")


async def test_header_forces_a_lane(shipped_router: Router) -> None:
    c = ctx(header="edge")
    await stage(shipped_router, None).run(c)
    assert (c.lane, c.route.reason, c.target_model) == ("edge", "forced", "edge")


async def test_policy_may_forbid_forcing_and_lanes(shipped_router: Router) -> None:
    strict = stage(shipped_router, None, router={"overrides": [
        {"match": {"tenant": "bank"}, "set": {"allow_force": False, "lanes": ["upstream"]}}]})
    with pytest.raises(PermissionDenied, match="may not choose a lane"):
        await strict.run(ctx(header="edge", tenant="bank"))
    explicit = ctx(model="edge", tenant="bank")
    explicit.lane, explicit.target_model = "edge", "edge"
    with pytest.raises(PermissionDenied, match="may not use the edge lane"):
        await strict.run(explicit)
    auto = ctx(tenant="bank")
    await strict.run(auto)
    assert (auto.lane, auto.route.reason) == ("upstream", "policy_lane")
    with pytest.raises(UpstreamUnavailable):
        await stage(shipped_router, None, upstream=False, router={"lanes": ["upstream"]}).run(ctx())


async def test_explicit_model_keeps_its_lane(shipped_router: Router) -> None:
    c = ctx(model="gpt-4o")
    c.lane, c.pool, c.target_model = "upstream", "critical", "gpt-4o"
    await stage(shipped_router, None).run(c)
    assert (c.lane, c.pool, c.target_model, c.route.reason, c.route.score) == (
        "upstream", "critical", "gpt-4o", "explicit_model", None)


async def test_the_header_is_read_from_the_context_not_the_request(shipped_router: Router) -> None:
    c = ctx(model="gpt-4o")
    c.headers = {"x-tierlane-route": "edge"}  # validated and recorded by the resolve stage, not here
    c.lane, c.pool, c.target_model = "upstream", "critical", "gpt-4o"
    await stage(shipped_router, None).run(c)
    assert (c.lane, c.route.reason) == ("upstream", "explicit_model")


async def test_a_policy_pool_gets_its_own_model(shipped_router: Router) -> None:
    routed = stage(shipped_router, None, edge=False, lanes={"upstream": {
        "pool": "critical", "pools": {"critical": {}, "standard": {}}}})
    c = ctx()
    await routed.run(c)
    assert (c.lane, c.pool, c.target_model) == ("upstream", "critical", "critical-model")


def test_build_from_services(shipped_router: Router) -> None:
    from gateway.pipeline.route import build
    from gateway.services import Services
    from gateway.settings import Settings
    from gateway.upstream.pool import UpstreamPool

    settings = Settings()
    services = Services(settings=settings, policy=Policy.load(), pool=UpstreamPool(settings), router=shipped_router)
    built = build(services)
    assert isinstance(built, RouteStage) and built.name == "route"
    assert (built.edge_available, built.upstream_available) == (False, False)
    assert built.edge_model == settings.edge.model_name
    # without a shared embedder the stage embeds itself, at the configured precision: the cache may store that vector
    assert built.fallback_precision == settings.embedder.precision == "int8"
    fp32 = Settings.model_validate({"embedder": {"precision": "fp32"}})
    built = build(Services(settings=fp32, policy=Policy.load(), pool=UpstreamPool(fp32), router=shipped_router))
    assert isinstance(built, RouteStage) and built.fallback_precision == "fp32"
    services.policy = Policy.load(extra={"router": {"enabled": False}})
    assert build(services) is None
