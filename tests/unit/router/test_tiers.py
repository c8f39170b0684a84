"""Upstream tiers for `auto`: the router's score picks cost or strong after the edge decision.

The route stage runs with the real router, policy and edge calibration; the embedding is a fixed
vector set on the request (what the cache stage leaves there), so no embedder loads.
"""

from __future__ import annotations

import numpy as np
import pytest

from gateway.cascade import Cascade
from gateway.context import Principal, RequestContext
from gateway.pipeline.route import RouteStage
from gateway.respond import lane_header
from policies.edge_quality.model import EdgeCalibration
from policies.policy import Policy
from policies.router import RoutePolicy, Router

TIERS = {"cost": {"pool": "standard", "model": "small-8b"}, "strong": {"pool": "critical", "model": "big-70b"}}
POOL_MODEL = {"standard": "standard-model", "critical": "critical-model"}.get


@pytest.fixture(scope="module")
def calibration() -> EdgeCalibration:
    return EdgeCalibration.load()


def stage(model: Router, *, edge: bool = False, cascade: Cascade | None = None, tiers: object = TIERS,
          **extra: object) -> RouteStage:
    lanes = extra.pop("lanes", {"upstream": {"tiers": tiers}})
    policy = Policy.load(extra={"lanes": lanes, **extra})
    return RouteStage(
        router=model, policy=RoutePolicy(policy, model), embedder=None, edge_available=edge,
        upstream_available=True, pool_names=["standard", "critical"], edge_model="edge",
        pool_model=POOL_MODEL, cascade=cascade,
    )


def ctx(tenant: str = "t", header: str | None = None, model: str = "auto") -> RequestContext:
    c = RequestContext(
        request_id="r", operation="chat", principal=Principal(tenant, "a"), model=model, headers={},
        body={"model": model, "messages": [{"role": "user", "content": "Explain the proof of Fermat's last theorem."}]},
        requested_route=header,  # type: ignore[arg-type]
    )
    c.embedding = np.full(384, 1.0 / np.sqrt(384), dtype=np.float32)
    c.lane, c.pool, c.target_model = "upstream", "standard", "standard-model"
    return c


def threshold(value: float) -> dict[str, object]:
    return {"target": {"mode": "threshold", "value": value}}


async def test_score_at_or_above_the_threshold_goes_to_the_strong_tier(shipped_router: Router) -> None:
    strong, cost = ctx(), ctx()
    await stage(shipped_router, router=threshold(0.0)).run(strong)
    await stage(shipped_router, router=threshold(1.0)).run(cost)
    assert (strong.lane, strong.pool, strong.target_model, strong.tier) == ("upstream", "critical", "big-70b", "strong")
    assert (cost.lane, cost.pool, cost.target_model, cost.tier) == ("upstream", "standard", "small-8b", "cost")
    assert (strong.route.reason, cost.route.reason) == ("router_strong", "router_cost")
    assert strong.route.score == pytest.approx(cost.route.score) and strong.route.score is not None
    assert strong.attributes["tierlane.route.tier"] == "strong"
    assert strong.attributes["tierlane.route.lane_reason"] == "edge_unavailable"
    assert lane_header(strong) == f"upstream:critical; tier=strong; score={strong.route.score:.3f}; reason=router_strong"


async def test_the_tier_threshold_follows_the_tenants_target(shipped_router: Router) -> None:
    routed = stage(shipped_router, router={"target": {"mode": "threshold", "value": 1.0},
                                           "overrides": [{"match": {"tenant": "rich"}, "set": threshold(0.0)}]})
    poor, rich = ctx("poor"), ctx("rich")
    await routed.run(poor)
    await routed.run(rich)
    assert (poor.tier, rich.tier) == ("cost", "strong")


async def test_tiers_are_set_per_tenant_and_one_tier_behaves_as_before(shipped_router: Router) -> None:
    lanes = {"upstream": {"tiers": None},
             "overrides": [{"match": {"tenant": "tiered"}, "set": {"upstream": {"tiers": TIERS}}}]}
    routed = stage(shipped_router, lanes=lanes, router=threshold(0.0))
    plain, tiered = ctx("plain"), ctx("tiered")
    await routed.run(plain)
    await routed.run(tiered)
    assert (plain.pool, plain.target_model, plain.tier, plain.route.reason) == (
        "standard", "standard-model", None, "edge_unavailable")
    assert lane_header(plain) == f"upstream:standard; score={plain.route.score:.3f}; reason=edge_unavailable"
    assert (tiered.pool, tiered.tier) == ("critical", "strong")


async def test_a_tier_without_a_model_asks_its_pool_for_one(shipped_router: Router) -> None:
    tiers = {"cost": {"pool": "standard"}, "strong": {"pool": "critical", "model": None}}
    c = ctx()
    await stage(shipped_router, tiers=tiers, router=threshold(0.0)).run(c)
    assert (c.pool, c.target_model) == ("critical", "critical-model")


async def test_forced_upstream_still_gets_the_routers_tier(shipped_router: Router) -> None:
    c = ctx(header="upstream")
    await stage(shipped_router, edge=True, router=threshold(1.0)).run(c)
    assert (c.lane, c.tier, c.route.reason) == ("upstream", "cost", "forced")
    assert "tier=cost" in lane_header(c)


async def test_explicit_models_take_no_tier(shipped_router: Router) -> None:
    c = ctx(model="gpt-4o")
    c.pool, c.target_model = "critical", "gpt-4o"
    await stage(shipped_router, router=threshold(0.0)).run(c)
    assert (c.pool, c.target_model, c.tier, c.route.reason) == ("critical", "gpt-4o", None, "explicit_model")


async def test_the_edge_cascade_comes_first_and_escalates_to_the_routers_tier(
        shipped_router: Router, calibration: EdgeCalibration) -> None:
    def cascade(prior: float) -> Cascade:
        return Cascade(Policy.load(extra={"cascade": {"prior": {"mode": "threshold", "value": prior}}}), calibration)

    edge = ctx()
    await stage(shipped_router, edge=True, cascade=cascade(0.0), router=threshold(0.0)).run(edge)
    assert (edge.lane, edge.tier, edge.route.reason) == ("edge", None, "calibration_edge")
    assert (edge.fallback, edge.fallback_tier) == (("critical", "big-70b"), "strong")
    assert lane_header(edge).startswith("edge; score=")
    cheap = ctx()
    await stage(shipped_router, edge=True, cascade=cascade(0.0), router=threshold(1.0)).run(cheap)
    assert (cheap.fallback, cheap.fallback_tier) == (("standard", "small-8b"), "cost")
    up = ctx()
    await stage(shipped_router, edge=True, cascade=cascade(1.0), router=threshold(1.0)).run(up)
    assert (up.lane, up.tier, up.route.reason) == ("upstream", "cost", "router_cost")
    assert up.attributes["tierlane.route.lane_reason"] == "calibration_upstream"


def test_tiers_must_name_both_tiers_and_known_pools(shipped_router: Router) -> None:
    with pytest.raises(ValueError, match="exactly the tiers cost, strong"):
        stage(shipped_router, tiers={"strong": {"pool": "critical"}})
    with pytest.raises(ValueError, match="not listed under lanes.upstream.pools"):
        stage(shipped_router, tiers={"cost": {"pool": "standard"}, "strong": {"pool": "gpu"}})
    with pytest.raises(ValueError, match="unknown key"):
        stage(shipped_router, tiers={"cost": {"pool": "standard", "price": 1}, "strong": {"pool": "critical"}})
    bad_override = {"upstream": {"tiers": None}, "overrides": [{"match": {"tenant": "x"}, "set": {"upstream": {"tiers": {"cost": {}}}}}]}
    with pytest.raises(ValueError):
        stage(shipped_router, lanes=bad_override)


def test_tier_for_compares_with_the_threshold(shipped_router: Router) -> None:
    rules = RoutePolicy(Policy.load(extra={"lanes": {"upstream": {"tiers": TIERS}}, "router": threshold(0.4)}),
                        shipped_router).rules("t", "a")
    assert rules.tiers is not None
    assert rules.tier_for(0.4).tier == "strong" and rules.tier_for(0.39).tier == "cost"
    assert rules.tier_for(0.4).precision == "full" and rules.tier_for(0.0).precision == "int8-fp8"
    plain = RoutePolicy(Policy.load(), shipped_router).rules("t", "a")
    assert plain.tiers is None and plain.tier_for(1.0) is plain.upstream


async def test_prompts_like_escalated_ones_skip_the_edge_and_go_to_the_routers_tier(
        shipped_router: Router, calibration: EdgeCalibration) -> None:
    from policies.domain import EdgeCheck

    # step 0: the net-saving margin stays off, so only the neighbours' vote is at work
    cascade = Cascade(Policy.load(extra={"cascade": {"prior": {"mode": "threshold", "value": 0.0},
                                                     "learn": {"enabled": True, "step": 0.0}}}), calibration)
    routed = stage(shipped_router, edge=True, cascade=cascade, router=threshold(1.0))
    for _ in range(3):
        tried = ctx()
        await routed.run(tried)
        assert (tried.lane, tried.route.reason) == ("edge", "calibration_edge")
        tried.edge_check = EdgeCheck(confidence=0.1, threshold=0.5, passed=False, escalated=True)
        tried.lane = "upstream"  # as the runner leaves an escalated request
        cascade.observe(tried, -0.001)
    again = ctx()
    await routed.run(again)
    assert (again.lane, again.tier, again.route.reason) == ("upstream", "cost", "router_cost")
    assert again.attributes["tierlane.route.lane_reason"] == "calibration_history"
    other = ctx(tenant="other")
    await routed.run(other)
    assert other.lane == "edge"  # learnt per tenant/app
