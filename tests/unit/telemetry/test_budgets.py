"""Budgets stop a tenant or app at its limit and not before, on requests, tokens, spend and streams."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import from_policy
from policies.budgets import Budgets, SlidingWindow, SpendRow
from policies.errors import BudgetExceeded
from policies.errors import LimitExceeded as RateLimited
from policies.policy import Policy
from tests.unit.telemetry.conftest import Clock


def budgets(clock: Clock, tenant: dict[str, Any] | None = None, app: dict[str, Any] | None = None, **extra: Any) -> Budgets:
    section: dict[str, Any] = {"tenant": tenant or {}, "app": app or {}, **extra}
    policy = Policy.load(extra={"budgets": section})
    return Budgets(policy, monotonic=clock.monotonic, wall=clock.wall)


def admit(b: Budgets, key: str = "r", tokens: int = 10, *, tenant: str = "acme", app: str = "web", reserve: float = 0.0) -> None:
    b.admit(key, tenant, app, tokens, reserve)


def test_requests_per_minute_admits_exactly_the_limit(clock: Clock) -> None:
    b = budgets(clock, tenant={"requests_per_minute": 5})
    for i in range(5):
        admit(b, f"r{i}", 10)
    with pytest.raises(RateLimited) as err:
        admit(b, "r5", 10)
    assert err.value.code == "rate_limit_exceeded"
    assert from_policy(err.value).status == 429
    assert 0 < err.value.retry_after <= 60
    assert "Retry-After" in from_policy(err.value).headers()
    # Another tenant has its own counter.
    admit(b, "other", 10, tenant="globex")


def test_window_slides_and_retry_after_is_when_room_returns(clock: Clock) -> None:
    b = budgets(clock, app={"requests_per_minute": 2})
    admit(b, "a", 1)
    clock.advance(30)
    admit(b, "b", 1)
    with pytest.raises(RateLimited) as err:
        admit(b, "c", 1)
    wait = err.value.retry_after
    assert 29 <= wait <= 31  # the first request leaves the window 60 s after it came
    clock.advance(wait - 1.5)
    with pytest.raises(RateLimited):
        admit(b, "d", 1)
    clock.advance(1.6)
    admit(b, "e", 1)


def test_tokens_per_minute_counts_estimate_then_actual(clock: Clock) -> None:
    b = budgets(clock, tenant={"tokens_per_minute": 1000})
    admit(b, "big", 100)
    b.settle("big", 900, 0.0)  # the answer used 900 tokens in all
    admit(b, "fits", 100)  # 900 + 100 == 1000: at the limit, allowed
    with pytest.raises(RateLimited):
        admit(b, "over", 1)


def test_request_larger_than_the_token_limit_is_refused_with_its_own_code(clock: Clock) -> None:
    b = budgets(clock, tenant={"tokens_per_minute": 50})
    with pytest.raises(RateLimited) as err:
        admit(b, "r", 51)
    assert err.value.code == "tokens_exceed_limit"


def test_daily_spend_stops_after_the_budget_is_spent(clock: Clock) -> None:
    b = budgets(clock, app={"daily_spend_usd": 1.0})
    admit(b, "1", 10)
    b.settle("1", 10, 0.6)
    admit(b, "2", 10)  # 0.6 spent of 1.0: still allowed
    b.settle("2", 10, 0.5)
    with pytest.raises(BudgetExceeded) as err:
        admit(b, "3", 10)
    assert err.value.code == "budget_exceeded" and from_policy(err.value).status == 429
    assert 0 < err.value.retry_after <= 86400
    clock.advance(86400)  # a new UTC day
    admit(b, "4", 10)


def test_monthly_spend_restored_from_ledger_rows(clock: Clock) -> None:
    b = budgets(clock, tenant={"monthly_spend_usd": 10.0, "daily_spend_usd": 5.0})
    today = b._today()
    earlier = f"{today[:7]}-01" if today[8:] != "01" else today
    b.restore([SpendRow("acme", "web", earlier, 6.0), SpendRow("acme", "batch", today, 4.0)])
    assert b.spend("acme") == pytest.approx((4.0 if earlier != today else 10.0, 10.0))
    with pytest.raises(BudgetExceeded):
        admit(b, "r", 1)


def test_overrides_apply_per_tenant_and_app(clock: Clock) -> None:
    b = budgets(
        clock,
        tenant={"requests_per_minute": 100},
        overrides=[
            {"match": {"tenant": "free"}, "set": {"tenant": {"requests_per_minute": 1}}},
            {"match": {"tenant": "acme", "app": "batch"}, "set": {"app": {"requests_per_minute": 1}}},
        ],
    )
    admit(b, "f1", 1, tenant="free")
    with pytest.raises(RateLimited):
        admit(b, "f2", 1, tenant="free")
    admit(b, "b1", 1, app="batch")
    with pytest.raises(RateLimited):
        admit(b, "b2", 1, app="batch")
    for i in range(5):
        admit(b, f"w{i}", 1, app="web")


def test_stream_is_charged_as_it_produces_and_stopped_past_the_limit(clock: Clock) -> None:
    b = budgets(clock, tenant={"tokens_per_minute": 100})
    admit(b, "s", 20)
    assert b.stream_breach("s", 40, 0.0) is None  # 60
    assert b.stream_breach("s", 40, 0.0) is None  # 100: at the limit
    breach = b.stream_breach("s", 1, 0.0)  # 101: past it
    assert isinstance(breach, RateLimited) and breach.retry_after is not None
    b.settle("s", 101, 0.0)
    with pytest.raises(RateLimited):
        admit(b, "next", 1)


def test_stream_spend_is_charged_as_it_goes(clock: Clock) -> None:
    b = budgets(clock, tenant={"daily_spend_usd": 0.001})
    admit(b, "s", 0)
    assert b.stream_breach("s", 100, 0.001) is None  # $0.001: at the budget
    assert isinstance(b.stream_breach("s", 1, 0.00001), BudgetExceeded)


def test_unlimited_callers_are_not_tracked(clock: Clock) -> None:
    b = budgets(clock)
    admit(b, "r", 10**9, reserve=10.0)
    assert b.stream_breach("r", 10**9, 5.0) is None
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


def test_concurrent_admissions_hold_their_reservations(clock: Clock) -> None:
    """40 requests admitted before any settles cannot all pass a check of settled spend."""
    b = budgets(clock, tenant={"daily_spend_usd": 0.01})
    admitted = 0
    for i in range(40):
        try:
            admit(b, f"c{i}", 10, reserve=0.003)
            admitted += 1
        except BudgetExceeded:
            pass
    assert admitted == 4  # 0, 0.003, 0.006, 0.009 held < 0.01; the fifth sees 0.012
    assert b.held("acme") == pytest.approx(0.012)
    for i in range(admitted):
        b.settle(f"c{i}", 10, 0.003)  # each cost its whole reservation
    assert b.held("acme") == 0.0
    spent, _ = b.spend("acme")
    assert spent == pytest.approx(0.012) and spent - 0.01 <= 0.003  # over by less than one reservation


def test_settling_below_the_reservation_frees_room_and_failures_release_it(clock: Clock) -> None:
    b = budgets(clock, tenant={"daily_spend_usd": 0.01})
    admit(b, "a", 10, reserve=0.006)
    admit(b, "b", 10, reserve=0.006)
    with pytest.raises(BudgetExceeded) as err:
        admit(b, "c", 10, reserve=0.006)
    assert err.value.retry_after == 1.0  # only held money is in the way: it comes back soon
    b.settle("a", 0, 0.0)  # failed: nothing spent, the hold is released
    b.settle("b", 10, 0.001)
    assert b.held("acme") == 0.0 and b.spend("acme")[0] == pytest.approx(0.001)
    admit(b, "c", 10, reserve=0.006)


def test_stream_charges_use_up_the_reservation_before_adding_spend(clock: Clock) -> None:
    b = budgets(clock, tenant={"daily_spend_usd": 0.01})
    admit(b, "s", 10, reserve=0.004)
    assert b.stream_breach("s", 10, 0.003) is None
    assert b.held("acme") == pytest.approx(0.001) and b.spend("acme")[0] == pytest.approx(0.003)
    assert b.stream_breach("s", 10, 0.003) is None  # past its reservation: spend grows, hold is 0
    assert b.held("acme") == 0.0 and b.spend("acme")[0] == pytest.approx(0.006)
    b.settle("s", 20, 0.0065)
    assert b.spend("acme")[0] == pytest.approx(0.0065)


def test_a_reused_key_releases_the_first_hold(clock: Clock) -> None:
    b = budgets(clock, tenant={"daily_spend_usd": 1.0})
    admit(b, "same", 10, reserve=0.4)
    admit(b, "same", 10, reserve=0.4)
    assert b.held("acme") == pytest.approx(0.4)
    assert b.in_flight() == 1
