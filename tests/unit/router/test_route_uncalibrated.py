"""An edge model without its own calibration takes no `auto` traffic; requests naming it still reach it.

The real router, policy and shipped calibration; the cascade starts without a calibration (what
the gateway builds when the model file's sha256 matches no artifact) and takes one up later (what
the background calibration does).
"""

from __future__ import annotations

import numpy as np
import pytest

from gateway.cascade import Cascade
from gateway.context import Principal, RequestContext
from gateway.errors import UpstreamUnavailable
from gateway.pipeline.resolve import ModelCatalog, ResolveStage
from gateway.pipeline.route import RouteStage
from gateway.settings import Settings
from gateway.upstream.pool import UpstreamPool
from policies.edge_quality.model import EdgeCalibration
from policies.policy import Policy
from policies.router import RoutePolicy, Router

TIERS = {"cost": {"pool": "standard", "model": "small-8b"}, "strong": {"pool": "critical", "model": "big-70b"}}
ALWAYS_EDGE = {"cascade": {"prior": {"mode": "threshold", "value": 0.0}, "learn": {"enabled": False}}}


def stage(model: Router, judge: Cascade, *, upstream: bool = True, **extra: object) -> RouteStage:
    policy = Policy.load(extra={**ALWAYS_EDGE, **extra})
    return RouteStage(
        router=model, policy=RoutePolicy(policy, model), embedder=None, edge_available=True,
        upstream_available=upstream, pool_names=["standard", "critical"] if upstream else [], edge_model="edge",
        pool_model={"standard": "standard-model", "critical": "critical-model"}.get, cascade=judge,
    )


def uncalibrated() -> Cascade:
    return Cascade(Policy.load(extra=ALWAYS_EDGE), None)


def ctx(model: str = "auto", header: str | None = None) -> RequestContext:
    c = RequestContext(
        request_id="r", operation="chat", principal=Principal("t", "a"), model=model,
        headers={"x-tierlane-route": header} if header else {},
        body={"model": model, "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
        requested_route=header,  # type: ignore[arg-type]
    )
    c.embedding = np.full(384, 1.0 / np.sqrt(384), dtype=np.float32)
    if model == "edge":
        c.lane, c.pool, c.target_model = "edge", None, "edge"
    else:
        c.lane, c.pool, c.target_model = "upstream", "standard", "standard-model"
    return c


async def test_auto_never_goes_to_an_uncalibrated_edge_even_where_the_router_would_send_it(shipped_router: Router) -> None:
    # the cascade off by policy: the router alone would send every prompt to the edge at threshold 1.0
    routed = stage(shipped_router, uncalibrated(), cascade={"enabled": False},
                   router={"target": {"mode": "threshold", "value": 1.0}})
    c = ctx()
    await routed.run(c)
    assert (c.lane, c.route.reason, c.pool) == ("upstream", "edge_uncalibrated", "standard")
    # with upstream tiers the router's score picks the tier and the lane reason stays on the span
    tiered = stage(shipped_router, uncalibrated(), lanes={"upstream": {"tiers": TIERS}})
    t = ctx()
    await tiered.run(t)
    assert (t.lane, t.tier) == ("upstream", "strong") or (t.lane, t.tier) == ("upstream", "cost")
    assert t.attributes["tierlane.route.lane_reason"] == "edge_uncalibrated"


async def test_requests_naming_the_edge_model_or_forcing_its_lane_still_reach_it(shipped_router: Router) -> None:
    routed = stage(shipped_router, uncalibrated())
    named = ctx(model="edge")
    await routed.run(named)
    assert (named.lane, named.route.reason, named.target_model) == ("edge", "explicit_model", "edge")
    forced = ctx(header="edge")
    await routed.run(forced)
    assert (forced.lane, forced.route.reason) == ("edge", "forced")


async def test_without_an_upstream_auto_is_refused_with_what_to_do(shipped_router: Router) -> None:
    with pytest.raises(UpstreamUnavailable, match="no calibration of its own.*name the edge model \\('edge'\\)"):
        await stage(shipped_router, uncalibrated(), upstream=False).run(ctx())


async def test_a_calibration_taken_up_while_running_opens_the_edge_to_auto(shipped_router: Router) -> None:
    cascade = uncalibrated()
    routed = stage(shipped_router, cascade)
    before = ctx()
    await routed.run(before)
    assert (before.lane, before.route.reason) == ("upstream", "edge_uncalibrated")
    cascade.take_calibration(EdgeCalibration.load())
    after = ctx()
    await routed.run(after)
    assert (after.lane, after.route.reason) == ("edge", "calibration_edge")


async def test_without_a_router_or_an_upstream_auto_is_refused_while_the_edge_is_uncalibrated() -> None:
    # no route stage runs without the router: the resolve stage is where `auto` would reach the edge
    judge = uncalibrated()
    catalog = ModelCatalog(UpstreamPool(Settings.load(env={}, overrides={"upstreams": []})), "edge", ["local"],
                           edge_calibrated=lambda: judge.calibrated)
    resolve = ResolveStage(catalog)
    c = ctx()
    with pytest.raises(UpstreamUnavailable, match="no calibration of its own") as refused:
        await resolve.run(c)
    assert refused.value.status == 503 and refused.value.param == "model"
    named = ctx("edge")
    await resolve.run(named)  # naming it still reaches it
    assert named.lane == "edge"
    judge.take_calibration(EdgeCalibration.load())
    calibrated = ctx()
    await resolve.run(calibrated)
    assert (calibrated.lane, calibrated.target_model) == ("edge", "edge")
