"""Upstream tiers without a price are named at start and on the dashboard, with the setting to add."""

from __future__ import annotations

import logging

import httpx

from policies.policy import Policy
from policies.router.tier_prices import unpriced_tier_warnings
from tests.support.config import PASS_THROUGH

TIERS = {"upstream": {"tiers": {"cost": {"pool": "standard", "model": "small-8b"},
                                "strong": {"pool": "critical", "model": "big-70b"}}}}


def test_each_unpriced_tier_model_is_named_with_the_setting_that_prices_it():
    unpriced = Policy.load(extra={"lanes": TIERS, "pricing": {"models": {"big-70b": {"input": 3.0, "output": 15.0}}}})
    (warning,) = unpriced_tier_warnings(unpriced)
    assert "'cost'" in warning and "small-8b" in warning and "pricing.models.small-8b" in warning
    priced = Policy.load(extra={"lanes": TIERS, "pricing": {"models": {"big-70b": {"input": 3.0, "output": 15.0},
                                                                       "small-8b": {"input": 0.2, "output": 0.6}}}})
    assert unpriced_tier_warnings(priced) == []
    by_pool = Policy.load(extra={"lanes": TIERS, "pricing": {"models": {"big-70b": {"input": 3.0, "output": 15.0}},
                                                             "pools": {"standard": {"per_second": 0.001}}}})
    assert unpriced_tier_warnings(by_pool) == []  # a pool's own price (a dedicated deployment) counts
    assert unpriced_tier_warnings(Policy.load()) == []  # no tiers, nothing to compare


def test_an_override_with_its_own_tiers_is_checked_too():
    policy = Policy.load(extra={"lanes": {**TIERS, "overrides": [{"match": {"tenant": "acme"}, "set": {"upstream": {
        "tiers": {"cost": {"pool": "standard", "model": "tiny-1b"}, "strong": {"pool": "critical", "model": "big-70b"}}}}}]},
        "pricing": {"models": {"big-70b": {"input": 3.0, "output": 15.0}, "small-8b": {"input": 0.2, "output": 0.6}}}})
    (warning,) = unpriced_tier_warnings(policy)
    assert "tiny-1b" in warning


def test_the_gateway_warns_at_start_and_the_dashboard_shows_it(make_gateway, caplog):
    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        gw = make_gateway(base={**PASS_THROUGH, "telemetry": {"tracing": False, "metrics": False, "metering": True},
                                "policy": {**PASS_THROUGH["policy"], "lanes": TIERS,
                                           "pricing": {"models": {"big-70b": {"input": 3.0, "output": 15.0}}}}})
        board = httpx.get(gw.url + "/v1/dashboard", timeout=30).json()
    assert any("small-8b" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert len(board["warnings"]) == 1 and "pricing.models.small-8b" in board["warnings"][0]
