"""Policy: per-tenant/app thresholds and lanes, target modes calibrated on the shipped curve."""

from __future__ import annotations

from typing import Any

import pytest

from policies.policy import Policy
from policies.router import RoutePolicy, Router


def make(model: Router, **extra: object) -> RoutePolicy:
    return RoutePolicy(Policy.load(extra=extra), model)


def test_defaults_use_the_calibrated_target(shipped_router: Router) -> None:
    rules = make(shipped_router).rules("t", "a")
    # the policy ships the target the trainer chose on its selection folds
    shipped = shipped_router.manifest["default_target"]
    assert rules.target == f"{shipped['mode']}={shipped['value']:g}" == "max_strong_share=0.45"
    assert rules.threshold == pytest.approx(shipped_router.threshold_for("max_strong_share", 0.45))
    assert rules.threshold == pytest.approx(shipped_router.default_threshold)
    assert rules.upstream.pool == "standard" and rules.edge.precision == "int4"


def test_per_tenant_override_and_target_modes(shipped_router: Router) -> None:
    policy = make(shipped_router, router={"overrides": [
        {"match": {"tenant": "cheap"}, "set": {"target": {"mode": "max_strong_share", "value": 0.2}}},
        {"match": {"tenant": "fixed", "app": "x"}, "set": {"target": {"mode": "threshold", "value": 0.33}}},
    ]})
    cheap = policy.rules("cheap", "any").threshold
    generous = shipped_router.threshold_for("max_strong_share", 0.8)
    assert cheap >= generous  # a smaller share needs a higher bar
    assert policy.rules("fixed", "x").threshold == 0.33
    assert policy.rules("fixed", "y").threshold != 0.33


def test_decide_compares_score_with_threshold(shipped_router: Router) -> None:
    policy = make(shipped_router, router={"target": {"mode": "threshold", "value": 0.4}})
    high, target = policy.decide(0.4, "t", "a")
    assert (high.lane, high.reason, high.threshold, target.pool) == ("upstream", "router_strong", 0.4, "standard")
    low, target = policy.decide(0.39, "t", "a")
    assert (low.lane, low.reason, target.pool) == ("edge", "router_weak", None)


def test_forbidden_lane_is_never_chosen(shipped_router: Router) -> None:
    policy = make(shipped_router, router={"overrides": [{"match": {"tenant": "bank"}, "set": {"lanes": ["upstream"]}}]})
    decision, _ = policy.decide(0.0, "bank", "a")
    assert decision.lane == "upstream" and decision.reason == "router_weak_lane_forbidden"
    assert policy.decide(0.0, "other", "a")[0].lane == "edge"


def test_lane_override_picks_precision_tier(shipped_router: Router) -> None:
    policy = make(shipped_router, lanes={"overrides": [{"match": {"tenant": "hospital"}, "set": {"upstream": {"pool": "critical"}}}]})
    assert policy.rules("hospital", "a").upstream.precision == "full"
    assert policy.rules("other", "a").upstream.pool == "standard"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"router": {"target": {"mode": "cheapest", "value": 0.5}}}, "router.target.mode"),
        ({"router": {"target": {"mode": "threshold", "value": 2}}}, r"in \[0, 1\]"),
        ({"router": {"lanes": ["gpu"]}}, "unknown lane"),
        ({"lanes": {"upstream": {"pool": "nope"}}}, "not listed under lanes.upstream.pools"),
        ({"router": {"overrides": [{"match": {"tenant": "x"}, "set": {"lanes": []}}]}}, "at least one lane"),
    ],
)
def test_bad_policy_fails_at_start(shipped_router: Router, extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RoutePolicy(Policy.load(extra=extra), shipped_router)


def test_rules_are_resolved_once_per_tenant_and_app(shipped_router: Router) -> None:
    resolved: list[str] = []

    class Counting(Policy):
        def resolve(self, name: str, **attrs: str | None) -> dict[str, Any]:
            resolved.append(name)
            return Policy.resolve(self, name, **attrs)

    loaded = Policy.load(extra={"router": {"overrides": [
        {"match": {"tenant": "fixed"}, "set": {"target": {"mode": "threshold", "value": 0.33}}},
    ]}})
    policy = RoutePolicy(Counting(sections=loaded.sections), shipped_router)
    first = [policy.rules("fixed", "x"), policy.rules("other", "x")]
    again = [policy.rules("fixed", "x"), policy.rules("other", "x")]
    assert first[0].threshold == 0.33 and first[1].threshold != 0.33
    assert all(a is b for a, b in zip(first, again))  # the same rules object, not a second resolution
    assert sorted(resolved) == ["lanes", "lanes", "router", "router"]  # once for each pair
