"""Budgets stop a tenant or app at its limit and not before, on requests, tokens, spend and streams."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import BudgetExceeded, RateLimited
from policies.budgets import Budgets, SlidingWindow, SpendRow
from policies.policy import Policy
from policies.pricing import Pricing
from tests.unit.telemetry.conftest import Clock, make_ctx


def budgets(clock: Clock, tenant: dict[str, Any] | None = None, app: dict[str, Any] | None = None, **extra: Any) -> Budgets:
    section: dict[str, Any] = {"tenant": tenant or {}, "app": app or {}, **extra}
    policy = Policy.load(extra={"budgets": section})
    return Budgets(policy, Pricing.from_policy(policy), monotonic=clock.monotonic, wall=clock.wall)


def test_requests_per_minute_admits_exactly_the_limit(clock: Clock) -> None:
    b = budgets(clock, tenant={"requests_per_minute": 5})
    for i in range(5):
        b.admit(make_ctx(request_id=f"r{i}"), 10)
    with pytest.raises(RateLimited) as err:
        b.admit(make_ctx(request_id="r5"), 10)
    assert err.value.status == 429 and err.value.code == "rate_limit_exceeded"
    assert 0 < err.value.retry_after <= 60
    assert "Retry-After" in err.value.headers()
    # Another tenant has its own counter.
    b.admit(make_ctx(request_id="other", tenant="globex"), 10)


def test_window_slides_and_retry_after_is_when_room_returns(clock: Clock) -> None:
    b = budgets(clock, app={"requests_per_minute": 2})
    b.admit(make_ctx(request_id="a"), 1)
    clock.advance(30)
    b.admit(make_ctx(request_id="b"), 1)
    with pytest.raises(RateLimited) as err:
        b.admit(make_ctx(request_id="c"), 1)
    wait = err.value.retry_after
    assert 29 <= wait <= 31  # the first request leaves the window 60 s after it came
    clock.advance(wait - 1.5)
    with pytest.raises(RateLimited):
        b.admit(make_ctx(request_id="d"), 1)
    clock.advance(1.6)
    b.admit(make_ctx(request_id="e"), 1)


def test_tokens_per_minute_counts_estimate_then_actual(clock: Clock) -> None:
    b = budgets(clock, tenant={"tokens_per_minute": 1000})
    ctx = make_ctx(request_id="big")
    b.admit(ctx, 100)
    b.settle(ctx, 900, 0.0)  # the answer used 900 tokens in all
    b.admit(make_ctx(request_id="fits"), 100)  # 900 + 100 == 1000: at the limit, allowed
    with pytest.raises(RateLimited):
        b.admit(make_ctx(request_id="over"), 1)


def test_request_larger_than_the_token_limit_is_refused_with_its_own_code(clock: Clock) -> None:
    b = budgets(clock, tenant={"tokens_per_minute": 50})
    with pytest.raises(RateLimited) as err:
        b.admit(make_ctx(), 51)
    assert err.value.code == "tokens_exceed_limit"


def test_daily_spend_stops_after_the_budget_is_spent(clock: Clock) -> None:
    b = budgets(clock, app={"daily_spend_usd": 1.0})
    first = make_ctx(request_id="1")
    b.admit(first, 10)
    b.settle(first, 10, 0.6)
    second = make_ctx(request_id="2")
    b.admit(second, 10)  # 0.6 spent of 1.0: still allowed
    b.settle(second, 10, 0.5)
    with pytest.raises(BudgetExceeded) as err:
        b.admit(make_ctx(request_id="3"), 10)
    assert err.value.code == "budget_exceeded" and err.value.status == 429
    assert 0 < err.value.retry_after <= 86400
    clock.advance(86400)  # a new UTC day
    b.admit(make_ctx(request_id="4"), 10)


def test_monthly_spend_restored_from_ledger_rows(clock: Clock) -> None:
    b = budgets(clock, tenant={"monthly_spend_usd": 10.0, "daily_spend_usd": 5.0})
    today = b._today()
    earlier = f"{today[:7]}-01" if today[8:] != "01" else today
    b.restore([SpendRow("acme", "web", earlier, 6.0), SpendRow("acme", "batch", today, 4.0)])
    assert b.spend("acme") == pytest.approx((4.0 if earlier != today else 10.0, 10.0))
    with pytest.raises(BudgetExceeded):
        b.admit(make_ctx(), 1)


def test_overrides_apply_per_tenant_and_app(clock: Clock) -> None:
    b = budgets(
        clock,
        tenant={"requests_per_minute": 100},
        overrides=[
            {"match": {"tenant": "free"}, "set": {"tenant": {"requests_per_minute": 1}}},
            {"match": {"tenant": "acme", "app": "batch"}, "set": {"app": {"requests_per_minute": 1}}},
        ],
    )
    b.admit(make_ctx(request_id="f1", tenant="free"), 1)
    with pytest.raises(RateLimited):
        b.admit(make_ctx(request_id="f2", tenant="free"), 1)
    b.admit(make_ctx(request_id="b1", app="batch"), 1)
    with pytest.raises(RateLimited):
        b.admit(make_ctx(request_id="b2", app="batch"), 1)
    for i in range(5):
        b.admit(make_ctx(request_id=f"w{i}", app="web"), 1)


def test_stream_is_charged_as_it_produces_and_stopped_past_the_limit(clock: Clock) -> None:
    b = budgets(clock, tenant={"tokens_per_minute": 100})
    ctx = make_ctx(stream=True)
    b.admit(ctx, 20)
    assert b.charge_stream(ctx, 40)  # 60
    assert b.charge_stream(ctx, 40)  # 100: at the limit
    breach = b.stream_breach(ctx, 1)  # 101: past it
    assert isinstance(breach, RateLimited) and breach.retry_after is not None
    b.settle(ctx, 101, 0.0)
    with pytest.raises(RateLimited):
        b.admit(make_ctx(request_id="next"), 1)


def test_stream_spend_uses_the_answering_lane_price(clock: Clock) -> None:
    b = budgets(clock, tenant={"daily_spend_usd": 0.001})
    ctx = make_ctx(model="gpt-4o", stream=True)  # $10 per million output tokens
    b.admit(ctx, 0)
    assert b.charge_stream(ctx, 100)  # $0.001: at the budget
    assert not b.charge_stream(ctx, 1)


def test_unlimited_callers_are_not_tracked(clock: Clock) -> None:
    b = budgets(clock)
    ctx = make_ctx()
    b.admit(ctx, 10**9)
    assert b.charge_stream(ctx, 10**9)
    assert b._open == {}


def test_bad_policy_fails_at_start(clock: Clock) -> None:
    with pytest.raises(ValueError, match="requests_per_minute"):
        budgets(clock, tenant={"requests_per_minute": -1})
    with pytest.raises(ValueError, match="unknown"):
        budgets(clock, app={"request_per_minute": 1})


def test_sliding_window_expires_whole_minute_after_long_idle() -> None:
    window = SlidingWindow()
    window.add(10.0, 5)
    window.add(40.0, 5)
    assert window.total(45.0) == 10
    assert window.total(70.5) == 5
    assert window.total(500.0) == 0
