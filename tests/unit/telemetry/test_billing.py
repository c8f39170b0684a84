"""Cost and counterfactual savings: prices from pricing.yaml, savings split by cache, edge and trim."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.context import Usage
from policies.policy import Policy
from policies.pricing import Pricing
from telemetry.billing import compute_bill
from tests.unit.telemetry.conftest import make_ctx

PRICING = Pricing.from_policy(Policy.load())


def price_of(model: str, input_tokens: int, output_tokens: int) -> float:
    section = Policy.load().section("pricing")["models"][model]
    return (input_tokens * section["input"] + output_tokens * section["output"]) / 1e6


def test_upstream_cost_discounts_cached_input_and_counts_trim() -> None:
    ctx = make_ctx(model="gpt-4o", trim_saved={"whitespace": 30, "history": 70})
    bill = compute_bill(ctx, Usage(input_tokens=1000, output_tokens=200, cached_input_tokens=400), PRICING)
    section = Policy.load().section("pricing")["models"]["gpt-4o"]
    expected = (600 * section["input"] + 400 * section["cached_input"] + 200 * section["output"]) / 1e6
    assert bill.cost == pytest.approx(expected)
    assert bill.saved_trim == pytest.approx(100 * section["input"] / 1e6)
    assert bill.saved_cache == bill.saved_edge == 0.0
    assert bill.trimmed_tokens == 100


def test_cache_hit_saves_the_whole_answer_at_the_requested_model_price() -> None:
    ctx = make_ctx(model="gpt-4.1", lane="cache", cache_status="hit")
    bill = compute_bill(ctx, Usage(input_tokens=500, output_tokens=300), PRICING)
    assert bill.cost == PRICING.cache_per_request
    assert bill.saved_cache == pytest.approx(price_of("gpt-4.1", 500, 300) - PRICING.cache_per_request)
    assert bill.counterfactual_model == "gpt-4.1"


def test_edge_answer_for_auto_model_is_compared_with_the_default_upstream() -> None:
    ctx = make_ctx(model="auto", lane="edge", target_model="edge")
    bill = compute_bill(ctx, Usage(input_tokens=800, output_tokens=100), PRICING)
    edge = (800 * PRICING.edge.input + 100 * PRICING.edge.output) / 1e6
    assert bill.cost == pytest.approx(edge)
    assert bill.counterfactual_model == PRICING.default_upstream_model
    assert bill.saved_edge == pytest.approx(price_of(PRICING.default_upstream_model, 800, 100) - edge)


def test_unknown_upstream_model_gets_the_fallback_price() -> None:
    ctx = make_ctx(model="some-local-model")
    bill = compute_bill(ctx, Usage(input_tokens=1000, output_tokens=1000), PRICING)
    assert bill.cost == pytest.approx(price_of(PRICING.default_upstream_model, 1000, 1000))


@given(
    lane=st.sampled_from(["cache", "edge"]),
    model=st.sampled_from(["auto", "gpt-4o", "gpt-4o-mini", "unknown"]),
    tokens=st.tuples(st.integers(0, 100_000), st.integers(0, 10_000), st.integers(0, 5_000)),
)
def test_savings_sum_to_untrimmed_counterfactual_minus_cost(lane: str, model: str, tokens: tuple[int, int, int]) -> None:
    input_tokens, output_tokens, trimmed = tokens
    ctx = make_ctx(model=model, lane=lane, trim_saved={"pass": trimmed})
    bill = compute_bill(ctx, Usage(input_tokens=input_tokens, output_tokens=output_tokens), PRICING)
    reference = PRICING.upstream(PRICING.counterfactual_model(model))
    baseline = reference.cost(Usage(input_tokens=input_tokens + trimmed, output_tokens=output_tokens))
    assert bill.saved == pytest.approx(baseline - bill.cost, abs=1e-12)


def test_bad_pricing_is_refused_with_the_field_named() -> None:
    good = Policy.load().section("pricing")
    with pytest.raises(ValueError, match="default_upstream_model"):
        Pricing.from_section({**good, "default_upstream_model": "nope"})
    with pytest.raises(ValueError, match="models.x.output"):
        Pricing.from_section({**good, "models": {**good["models"], "x": {"input": 1}}})
    with pytest.raises(ValueError, match="cached_input_discount"):
        Pricing.from_section({**good, "cached_input_discount": 2})


def test_batch_priority_pays_the_upstream_prices_less_the_batch_discount() -> None:
    discount = PRICING.batch_discount
    assert 0 < discount < 1  # shipped: batch lines at a discount
    usage = Usage(input_tokens=1000, output_tokens=200, cached_input_tokens=400)
    full = compute_bill(make_ctx(model="gpt-4o"), usage, PRICING)
    batch = compute_bill(make_ctx(model="gpt-4o", priority="batch"), usage, PRICING)
    assert batch.cost == pytest.approx(full.cost * (1 - discount))
    assert batch.saved_vs_named == pytest.approx(full.saved_vs_named * (1 - discount))  # like with like
    # the edge's own price stays; what it saved is counted against the discounted upstream
    edge_full = compute_bill(make_ctx(model="gpt-4o", lane="edge"), usage, PRICING)
    edge_batch = compute_bill(make_ctx(model="gpt-4o", lane="edge", priority="batch"), usage, PRICING)
    assert edge_batch.cost == edge_full.cost
    assert edge_batch.saved_edge < edge_full.saved_edge


def test_a_batch_discount_outside_0_to_1_is_refused() -> None:
    section = Policy.load().section("pricing")
    with pytest.raises(ValueError, match="batch_discount"):
        Pricing.from_section({**section, "batch_discount": 1.5})
    undiscounted = Pricing.from_section({**section, "batch_discount": 0})
    assert undiscounted.for_priority("batch") is undiscounted
