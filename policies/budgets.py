"""Rate limits and spend budgets per tenant and per tenant+app, from the `budgets` policy section.

Requests and tokens per minute are in-process sliding windows; daily and monthly spend are
running UTC totals, restored from the ledger at start. Everything here runs on the event loop
(no locks: each call is a few dictionary and arithmetic steps and never awaits).

Spend is reserved, not hoped for: admission holds an estimate of what the request can cost
(prompt and the most completion tokens it may produce, at its lane's price) and refuses once
spent + held reaches the limit; completion replaces the hold by the actual cost. So concurrent
requests cannot all pass a check that only saw settled spend, and a limit is passed by at most
one request's reservation. What a request holds is keyed by an id the gateway generates.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.errors import BudgetExceeded, LimitExceeded
from policies.policy import Policy

WINDOW_S = 60.0
# Requests admitted but never settled (a hook that did not run) are forgotten after this long.
OPEN_TTL_S = 3600.0
OPEN_SWEEP_AT = 10_000


@dataclass(slots=True, frozen=True)
class Limits:
    """The limits of one scope; None is unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    daily_spend_usd: float | None = None
    monthly_spend_usd: float | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, where: str) -> Limits:
        data = data or {}
        unknown = set(data) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"budgets.{where}: unknown limit(s) {sorted(unknown)}")
        return cls(
            requests_per_minute=_limit(data.get("requests_per_minute"), f"{where}.requests_per_minute", int),
            tokens_per_minute=_limit(data.get("tokens_per_minute"), f"{where}.tokens_per_minute", int),
            daily_spend_usd=_limit(data.get("daily_spend_usd"), f"{where}.daily_spend_usd", float),
            monthly_spend_usd=_limit(data.get("monthly_spend_usd"), f"{where}.monthly_spend_usd", float),
        )

    @property
    def unlimited(self) -> bool:
        return (
            self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.daily_spend_usd is None
            and self.monthly_spend_usd is None
        )


def _money(amount: float) -> float:
    """A held amount after subtraction: float residue below a billionth of a cent is zero."""
    return amount if amount > 1e-12 else 0.0


def _limit(value: Any, where: str, kind: type) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"budgets.{where} must be a non-negative number or null, got {value!r}")
    return kind(value)


class SlidingWindow:
    """A count over the last minute kept in one-second buckets: fixed memory, expiry at most a bucket late."""

    __slots__ = ("_width", "_slots", "_counts", "_head", "_total")

    def __init__(self, window_s: float = WINDOW_S, slots: int = 60) -> None:
        self._width = window_s / slots
        self._slots = slots
        self._counts = [0.0] * slots
        self._head = 0  # index of the newest bucket, in bucket units since the epoch of the clock
        self._total = 0.0

    def _advance(self, now: float) -> int:
        bucket = int(now // self._width)
        if bucket > self._head:
            steps = min(bucket - self._head, self._slots)
            for i in range(1, steps + 1):
                slot = (self._head + i) % self._slots
                self._total -= self._counts[slot]
                self._counts[slot] = 0.0
            self._head = bucket
            if steps == self._slots:
                self._total = 0.0
        return bucket

    def add(self, now: float, amount: float) -> None:
        bucket = self._advance(now)
        self._counts[bucket % self._slots] += amount
        self._total += amount

    def total(self, now: float) -> float:
        self._advance(now)
        return max(0.0, self._total)

    def retry_after(self, now: float, excess: float) -> float:
        """Seconds until the oldest buckets holding at least `excess` have expired."""
        bucket = self._advance(now)
        freed = 0.0
        for age in range(self._slots - 1, -1, -1):
            index = bucket - age
            freed += self._counts[index % self._slots]
            if freed >= excess:
                return max(0.0, (index + self._slots) * self._width - now)
        return self._slots * self._width


@dataclass(slots=True)
class _Counters:
    requests: SlidingWindow = field(default_factory=SlidingWindow)
    tokens: SlidingWindow = field(default_factory=SlidingWindow)
    day: str = ""
    day_spend: float = 0.0
    month: str = ""
    month_spend: float = 0.0
    held: float = 0.0  # USD reserved by requests in flight and not yet charged

    def spend(self, day: str, amount: float) -> None:
        self.roll(day)
        self.day_spend += amount
        self.month_spend += amount

    def roll(self, day: str) -> None:
        if day != self.day:
            self.day, self.day_spend = day, 0.0
        if day[:7] != self.month:
            self.month, self.month_spend = day[:7], 0.0


@dataclass(slots=True)
class _Open:
    """What a request holds and has been charged so far, before its final usage is known."""

    scopes: tuple[tuple[_Counters, Limits, str], ...]
    admitted: float
    tokens: float = 0.0
    cost: float = 0.0  # charged so far (streams are charged as they produce tokens)
    reserved: float = 0.0  # USD held at admission

    def held(self) -> float:
        """The part of the reservation that charges have not yet used up."""
        return max(0.0, self.reserved - self.cost)


@dataclass(slots=True, frozen=True)
class SpendRow:
    """Spend already recorded in the ledger for one tenant+app on one UTC day."""

    tenant: str
    app: str
    day: str  # YYYY-MM-DD
    cost: float


class Budgets:
    """Admits requests under the limits, charges streams as they produce tokens, settles at the end."""

    def __init__(
        self,
        policy: Policy,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        section = policy.section("budgets")
        self.enabled = bool(section.get("enabled", True))
        reserve = section.get("reserve_output_tokens", 1024)
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"budgets.reserve_output_tokens must be a non-negative integer, got {reserve!r}")
        # completion tokens held for a request that sets no max_tokens
        self.reserve_output_tokens = reserve
        self._policy = policy
        self._monotonic = monotonic
        self._wall = wall
        self._limits: dict[tuple[str, str], tuple[Limits, Limits]] = {}
        self._tenants: dict[str, _Counters] = {}
        self._apps: dict[tuple[str, str], _Counters] = {}
        self._open: dict[str, _Open] = {}
        self._day, self._day_from, self._day_to = "", 0.0, 0.0
        # Validate the whole section once so a bad policy fails at start, not on a request.
        Limits.from_mapping(section.get("tenant"), "tenant")
        Limits.from_mapping(section.get("app"), "app")
        for i, rule in enumerate(section.get("overrides") or []):
            sets = rule.get("set") or {}
            Limits.from_mapping(sets.get("tenant"), f"overrides[{i}].set.tenant")
            Limits.from_mapping(sets.get("app"), f"overrides[{i}].set.app")

    def limits(self, tenant: str, app: str) -> tuple[Limits, Limits]:
        """(tenant limits, app limits) for this caller, resolved once and kept."""
        key = (tenant, app)
        found = self._limits.get(key)
        if found is None:
            tenant_section = self._policy.resolve("budgets", tenant=tenant)
            app_section = self._policy.resolve("budgets", tenant=tenant, app=app)
            found = (
                Limits.from_mapping(tenant_section.get("tenant"), "tenant"),
                Limits.from_mapping(app_section.get("app"), "app"),
            )
            self._limits[key] = found
        return found

    def restore(self, rows: Iterable[SpendRow]) -> None:
        """Seed daily and monthly spend from ledger totals (this month's rows, one per tenant/app/day)."""
        today = self._today()
        for row in rows:
            if row.day[:7] != today[:7]:
                continue
            for counters in (self._tenant(row.tenant), self._app(row.tenant, row.app)):
                counters.roll(today)
                counters.month_spend += row.cost
                if row.day == today:
                    counters.day_spend += row.cost

    def admit(self, key: str, tenant: str, app: str, tokens: int, reserve_usd: float = 0.0) -> None:
        """Count the request and hold `reserve_usd`, or raise LimitExceeded / BudgetExceeded without counting.

        `key` identifies the request until `settle`; `tokens` is its estimated input.
        """
        if not self.enabled:
            return
        tenant_limits, app_limits = self.limits(tenant, app)
        scopes: list[tuple[_Counters, Limits, str]] = []
        if not tenant_limits.unlimited:
            scopes.append((self._tenant(tenant), tenant_limits, f"tenant {tenant!r}"))
        if not app_limits.unlimited:
            scopes.append((self._app(tenant, app), app_limits, f"app {app!r} of tenant {tenant!r}"))
        if not scopes:
            return
        now, day = self._monotonic(), self._today()
        for counters, limits, who in scopes:
            self._check(counters, limits, who, now, day, tokens)
        reserve = reserve_usd if reserve_usd > 0.0 else 0.0
        for counters, _, _ in scopes:
            counters.requests.add(now, 1)
            counters.tokens.add(now, tokens)
            counters.held += reserve
        if len(self._open) >= OPEN_SWEEP_AT:
            self._sweep(now)
        stale = self._open.pop(key, None)
        if stale is not None:  # a key used twice: release the first hold rather than leak it
            self._release(stale)
        self._open[key] = _Open(scopes=tuple(scopes), admitted=now, tokens=float(tokens), reserved=reserve)

    def stream_breach(self, key: str, tokens: int, cost: float) -> LimitExceeded | None:
        """Charge `tokens` (costing `cost`) newly produced by a stream; the error to end it with when over a limit."""
        held = self._open.get(key)
        if held is None or tokens <= 0:
            return None
        now, day = self._monotonic(), self._today()
        cost = cost if cost > 0.0 else 0.0
        before = held.held()
        held.tokens += tokens
        held.cost += cost
        freed = before - held.held()
        breach: LimitExceeded | None = None
        for counters, limits, who in held.scopes:
            counters.tokens.add(now, tokens)
            counters.spend(day, cost)
            counters.held = _money(counters.held - freed)
            breach = breach or self._breach(counters, limits, who, now)
        return breach

    def settle(self, key: str, tokens: int, cost: float) -> None:
        """Replace what the request held and was charged so far by its final tokens and cost."""
        held = self._open.pop(key, None)
        if held is None:
            return
        now, day = self._monotonic(), self._today()
        cost = cost if cost > 0.0 else 0.0
        for counters, _, _ in held.scopes:
            counters.tokens.add(now, tokens - held.tokens)
            counters.spend(day, cost - held.cost)
        self._release(held)

    def held(self, tenant: str, app: str | None = None) -> float:
        """USD currently reserved by requests in flight for a tenant, or one of its apps."""
        counters = self._tenants.get(tenant) if app is None else self._apps.get((tenant, app))
        return 0.0 if counters is None else counters.held

    def in_flight(self) -> int:
        return len(self._open)

    def _release(self, held: _Open) -> None:
        left = held.held()
        for counters, _, _ in held.scopes:
            counters.held = _money(counters.held - left)

    def spend(self, tenant: str, app: str | None = None) -> tuple[float, float]:
        """(today, this month) in USD for a tenant, or one of its apps; only scopes that have limits."""
        counters = self._tenants.get(tenant) if app is None else self._apps.get((tenant, app))
        if counters is None:
            return 0.0, 0.0
        counters.roll(self._today())
        return counters.day_spend, counters.month_spend

    def _check(
        self, counters: _Counters, limits: Limits, who: str, now: float, day: str, tokens: int
    ) -> None:
        if limits.requests_per_minute is not None:
            seen = counters.requests.total(now)
            if seen + 1 > limits.requests_per_minute:
                raise LimitExceeded(
                    f"rate limit reached for {who}: {limits.requests_per_minute} requests per minute",
                    retry_after=counters.requests.retry_after(now, seen + 1 - limits.requests_per_minute),
                )
        if limits.tokens_per_minute is not None:
            used = counters.tokens.total(now)
            if used + tokens > limits.tokens_per_minute:
                if tokens > limits.tokens_per_minute:
                    raise LimitExceeded(
                        f"this request (about {tokens} tokens) is larger than the limit of {who}: "
                        f"{limits.tokens_per_minute} tokens per minute",
                        code="tokens_exceed_limit",
                        retry_after=WINDOW_S,
                    )
                raise LimitExceeded(
                    f"rate limit reached for {who}: {limits.tokens_per_minute} tokens per minute",
                    retry_after=counters.tokens.retry_after(now, used + tokens - limits.tokens_per_minute),
                )
        counters.roll(day)
        if limits.daily_spend_usd is not None and counters.day_spend + counters.held >= limits.daily_spend_usd:
            raise BudgetExceeded(
                f"daily spend budget of ${limits.daily_spend_usd:.2f} reached for {who}"
                + (" (with what requests in flight have reserved)" if counters.held else ""),
                retry_after=self._until_next_day() if counters.day_spend >= limits.daily_spend_usd else 1.0,
            )
        if limits.monthly_spend_usd is not None and counters.month_spend + counters.held >= limits.monthly_spend_usd:
            raise BudgetExceeded(
                f"monthly spend budget of ${limits.monthly_spend_usd:.2f} reached for {who}",
                retry_after=self._until_next_month(),
            )

    def _breach(self, counters: _Counters, limits: Limits, who: str, now: float) -> LimitExceeded | None:
        """Why a running stream is now over a limit (it is allowed to reach the limit, not pass it)."""
        if limits.tokens_per_minute is not None:
            used = counters.tokens.total(now)
            if used > limits.tokens_per_minute:
                return LimitExceeded(
                    f"stream stopped: {who} passed its limit of {limits.tokens_per_minute} tokens per minute",
                    retry_after=counters.tokens.retry_after(now, used - limits.tokens_per_minute),
                )
        if limits.daily_spend_usd is not None and counters.day_spend > limits.daily_spend_usd:
            return BudgetExceeded(
                f"stream stopped: {who} passed its daily spend budget of ${limits.daily_spend_usd:.2f}",
                retry_after=self._until_next_day(),
            )
        if limits.monthly_spend_usd is not None and counters.month_spend > limits.monthly_spend_usd:
            return BudgetExceeded(
                f"stream stopped: {who} passed its monthly spend budget of ${limits.monthly_spend_usd:.2f}",
                retry_after=self._until_next_month(),
            )
        return None

    def _tenant(self, tenant: str) -> _Counters:
        found = self._tenants.get(tenant)
        if found is None:
            found = self._tenants[tenant] = _Counters()
        return found

    def _app(self, tenant: str, app: str) -> _Counters:
        found = self._apps.get((tenant, app))
        if found is None:
            found = self._apps[(tenant, app)] = _Counters()
        return found

    def _sweep(self, now: float) -> None:
        stale = [rid for rid, held in self._open.items() if now - held.admitted > OPEN_TTL_S]
        for rid in stale:
            self._release(self._open.pop(rid))

    def _utc(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self._wall(), dt.UTC)

    def _today(self) -> str:
        # Formatting a date costs more than the rest of an admission; it changes once a day.
        now = self._wall()
        if not self._day_from <= now < self._day_to:
            start = dt.datetime.combine(dt.datetime.fromtimestamp(now, dt.UTC).date(), dt.time(), dt.UTC)
            self._day_from, self._day_to = start.timestamp(), start.timestamp() + 86400.0
            self._day = start.strftime("%Y-%m-%d")
        return self._day

    def _until_next_day(self) -> float:
        now = self._utc()
        tomorrow = dt.datetime.combine(now.date() + dt.timedelta(days=1), dt.time(), dt.UTC)
        return (tomorrow - now).total_seconds()

    def _until_next_month(self) -> float:
        now = self._utc()
        year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
        return (dt.datetime(year, month, 1, tzinfo=dt.UTC) - now).total_seconds()
