"""Prices as upstreams bill: per token (per million or per 1k), per request, per second of upstream
time, per model or per pool; bills state savings against the strong tier and the named model."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.context import Usage
from policies.domain import EdgeCheck
from policies.pricing import Pricing
from telemetry.billing import compute_bill
from tests.unit.telemetry.conftest import make_ctx

SECTION: dict[str, Any] = {
    "default_upstream_model": "named",
    "cached_input_discount": 0.5,
    "models": {
        "named": {"input": 5.0, "output": 15.0},
        "big": {"input_per_1k": 0.01, "output_per_1k": 0.03},  # = 10 / 30 per million
        "small": {"input": 1.0, "output": 3.0},
        "flat": {"per_request": 0.002},
        "hosted": {"per_second": 0.004, "tokens_per_second": 50},
    },
    "pools": {"gpu": {"per_second": 0.01, "per_request": 0.0001}},
    "edge": {"input": 0.01, "output": 0.04},
}
PRICING = Pricing.from_section(SECTION)
USAGE = Usage(input_tokens=1000, output_tokens=200)


def test_per_1k_prices_are_per_million_times_a_thousand() -> None:
    big = PRICING.upstream("big")
    assert (big.input, big.output) == pytest.approx((10.0, 30.0))
    assert big.charge(USAGE, 3.0) == pytest.approx((1000 * 10 + 200 * 30) / 1e6)


def test_per_request_and_per_second_prices_bill_the_request_and_its_upstream_time() -> None:
    assert PRICING.upstream("flat").charge(USAGE, 9.0) == pytest.approx(0.002)
    assert PRICING.upstream("hosted").charge(USAGE, 2.5) == pytest.approx(0.01)
    assert PRICING.upstream("hosted").estimated_seconds(USAGE) == pytest.approx(4.0)  # 200 tokens at 50/s
    # a priced pool bills whatever model it serves
    assert PRICING.upstream("big", "gpu").charge(USAGE, 2.0) == pytest.approx(0.0201)
    assert PRICING.upstream("big", "other") is PRICING.upstream("big")


def test_upstream_cost_uses_the_lane_seconds_of_the_upstream_only() -> None:
    ctx = make_ctx(model="auto", target_model="hosted", pool="p", lane_seconds=3.0, edge_seconds=1.0,
                   edge_check=EdgeCheck(confidence=0.1, threshold=0.5, passed=False, escalated=True,
                                        edge_input_tokens=1000, edge_output_tokens=12))
    bill = compute_bill(ctx, USAGE, PRICING)
    wasted = (1000 * 0.01 + 12 * 0.04) / 1e6
    assert bill.cost == pytest.approx(2.0 * 0.004 + wasted)  # 3 s on the lane, 1 of them the edge's attempt
    assert bill.saved_edge == pytest.approx(-wasted)


def test_savings_against_the_strong_tier_and_the_named_model_net_the_escalation() -> None:
    check = EdgeCheck(confidence=0.1, threshold=0.5, passed=False, escalated=True, edge_input_tokens=500, edge_output_tokens=10)
    ctx = make_ctx(model="auto", target_model="small", pool="standard", tier="cost", strong_target=("critical", "big"),
                   edge_check=check)
    bill = compute_bill(ctx, USAGE, PRICING)
    wasted = (500 * 0.01 + 10 * 0.04) / 1e6
    assert bill.cost == pytest.approx((1000 * 1 + 200 * 3) / 1e6 + wasted)
    assert bill.cost_strong == pytest.approx((1000 * 10 + 200 * 30) / 1e6)
    assert bill.cost_named == pytest.approx((1000 * 5 + 200 * 15) / 1e6)
    assert (bill.strong_model, bill.named_model) == ("big", "named")
    assert bill.saved_vs_strong == pytest.approx(bill.cost_strong - bill.cost)
    assert bill.saved_vs_named == pytest.approx(bill.cost_named - bill.cost)


def test_a_request_on_the_strong_tier_saves_nothing_against_it_but_its_trim() -> None:
    ctx = make_ctx(model="auto", target_model="big", pool="critical", tier="strong", strong_target=("critical", "big"),
                   trim_saved={"history": 100})
    bill = compute_bill(ctx, Usage(input_tokens=1000, output_tokens=200, cached_input_tokens=400), PRICING)
    assert bill.saved_vs_strong == pytest.approx(bill.saved_trim) and bill.saved_trim == pytest.approx(100 * 10 / 1e6)


def test_local_answers_are_priced_against_both_counterfactuals() -> None:
    edge = make_ctx(model="auto", lane="edge", target_model="edge", strong_target=("p", "hosted"), lane_seconds=0.5)
    bill = compute_bill(edge, USAGE, PRICING)
    assert bill.cost_strong == pytest.approx(4.0 * 0.004)  # 200 output tokens at the stated 50/s
    assert bill.cost_named == pytest.approx((1000 * 5 + 200 * 15) / 1e6)
    assert bill.saved_edge == pytest.approx(bill.saved_vs_named)
    no_tiers = compute_bill(make_ctx(model="auto", lane="edge", target_model="edge"), USAGE, PRICING)
    assert no_tiers.cost_strong == no_tiers.cost_named  # one upstream tier: the two counterfactuals agree


def test_bad_prices_are_refused_with_the_field_named() -> None:
    for entry, match in [
        ({}, "names no price"),
        ({"input": 1.0}, "models.x.output"),
        ({"input": 1.0, "input_per_1k": 0.001, "output": 1.0}, "both input and input_per_1k"),
        ({"per_second": 1.0, "tokens_per_second": 0}, "tokens_per_second must be positive"),
        ({"per_hour": 1.0}, "unknown key"),
        ({"per_request": -1.0}, "must not be negative"),
    ]:
        with pytest.raises(ValueError, match=match):
            Pricing.from_section({**SECTION, "models": {**SECTION["models"], "x": entry}})
    with pytest.raises(ValueError, match="pools.gpu"):
        Pricing.from_section({**SECTION, "pools": {"gpu": {"per_second": "fast"}}})


def test_prompt_cache_reads_and_writes_are_priced_as_themselves():
    from gateway.apis.messages import usage_block
    from gateway.apis.native import message_usage
    from policies.domain import Usage as TokenUsage
    from policies.pricing import Pricing as Prices

    prices = Prices.from_section({"default_upstream_model": "claude", "cached_input_discount": 0.9,
                                  "models": {"claude": {"input": 3.0, "output": 15.0},
                                             "priced": {"input": 3.0, "output": 15.0, "cache_write": 4.0,
                                                        "cache_write_1h": 5.0}}})
    # Anthropic's report: 100 plain, 1,000 read, 400 written (100 of them for an hour), 50 out
    usage = message_usage({"input_tokens": 100, "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 400,
                           "cache_creation": {"ephemeral_5m_input_tokens": 300, "ephemeral_1h_input_tokens": 100},
                           "output_tokens": 50})
    assert usage == TokenUsage(input_tokens=1500, output_tokens=50, cached_input_tokens=1000, cache_write_tokens=300,
                               cache_write_1h_tokens=100)
    claude = prices.upstream("claude")
    expected = (100 * 3.0 + 1000 * 0.3 + 300 * 3.75 + 100 * 6.0 + 50 * 15.0) / 1e6  # reads 0.1x, writes 1.25x / 2x
    assert abs(claude.cost(usage) - expected) < 1e-12
    assert abs(claude.cost(usage, cache_discount=False) - (1500 * 3.0 + 50 * 15.0) / 1e6) < 1e-12
    own = prices.upstream("priced")
    assert abs(own.cost(usage) - (100 * 3.0 + 1000 * 0.3 + 300 * 4.0 + 100 * 5.0 + 50 * 15.0) / 1e6) < 1e-12
    # the Messages answer says what was read and written, as Anthropic's usage does
    assert usage_block(usage) == {"input_tokens": 100, "output_tokens": 50, "cache_creation_input_tokens": 400,
                                  "cache_read_input_tokens": 1000}
