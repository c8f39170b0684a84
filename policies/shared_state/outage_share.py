"""What one replica may admit while the shared budget store is unreachable (`state.on_outage: local_share`).

While the store answers, every admission tells this replica what is left of each limit after it
(requests and tokens in the minute's window, today's and this month's spend). When the store
stops answering, the replica admits against that last known remainder divided by the number of
replicas it knows of (from their heartbeats), refilled at its share of the limit's rate as the
window moves on, and never above its share of one window (a token bucket per limit):

    allowance = min(limit, left + limit * elapsed / 60) / replicas, less what it admitted since

and refuses past it: however long a tenant was idle before or during the outage, a replica never
admits more in one minute than its share of the per-minute limit. So a fleet of N replicas admits about the limit in all during an outage,
each its 1/N, instead of N fresh allowances. A scope this replica has no remainder for counts
its rate limits as untouched (their refill is bounded) and its spend as used up: a spend limit is
never granted blind. A new UTC day or month starts its spend from the limit again.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from policies.budgets import WINDOW_S, Limits
from policies.errors import BudgetExceeded, LimitExceeded

OUTAGE_RETRY_S = 2.0  # Retry-After of a refusal while the store is unreachable: it may be back soon

Left = tuple[float | None, float | None, float | None, float | None]  # requests, tokens, day USD, month USD


def _day(now: float) -> str:
    return dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%d")


@dataclass(slots=True)
class _Known:
    left: Left
    at: float
    day: str


@dataclass(slots=True)
class _Used:
    """What this replica admitted alone since the last known remainder."""

    since: float
    day: str
    requests: int = 0
    tokens: int = 0
    day_usd: float = 0.0
    month_usd: float = 0.0
    # per rate limit ("requests", "tokens"): the bucket's level (this replica's share) and when it was set
    levels: dict[str, tuple[float, float]] = field(default_factory=dict)


class OutageShare:
    """Per scope (`tenant` or `tenant/app`): the last known remainder and what was admitted alone since.

    NOTE: used from the event loop only (no lock).
    """

    def __init__(self) -> None:
        self._known: dict[str, _Known] = {}
        self._used: dict[str, _Used] = {}

    def learn(self, scope: str, left: Left, now: float) -> None:
        """The store's remainder after an admission: the outage accounting starts over from it."""
        self._known[scope] = _Known(left, now, _day(now))
        self._used.pop(scope, None)

    def spent(self, scopes: list[str], extra_usd: float) -> None:
        """A request the store admitted cost `extra_usd` more than it reserved: less is left than last said."""
        for key in scopes:
            known = self._known.get(key)
            if known is not None and extra_usd:
                req, tok, day, month = known.left
                known.left = (req, tok, None if day is None else day - extra_usd, None if month is None else month - extra_usd)

    def check(self, scopes: list[tuple[str, str, Limits]], tokens: int, reserve_usd: float, replicas: int, now: float) -> None:
        """Raises LimitExceeded / BudgetExceeded when this replica's share of any scope is used up.

        `scopes`: (key, name for messages, limits). Nothing is counted when it raises.
        """
        n = max(1, replicas)
        today = _day(now)
        for key, name, limits in scopes:
            known = self._known.get(key)
            used = self._used_of(key, known, now, today)
            left: Left = known.left if known is not None else (None, None, 0.0, 0.0)
            new_day = known is not None and known.day != today
            new_month = known is not None and known.day[:7] != today[:7]
            for unit, per_minute, known_left, cost in self._rates(limits, left, tokens):
                if per_minute is None:
                    continue
                if cost > self._level(used, unit, per_minute, known_left, n, now):
                    raise LimitExceeded(
                        f"rate limit reached for {name}: this replica's share of {per_minute} {unit} per minute while "
                        "the shared budget store is unreachable",
                        retry_after=OUTAGE_RETRY_S,
                    )
            spends = (("daily", limits.daily_spend_usd, left[2], new_day, used.day_usd),
                      ("monthly", limits.monthly_spend_usd, left[3], new_month, used.month_usd))
            for period, limit, known_left, fresh, spent in spends:
                if limit is None:
                    continue
                start = limit if fresh or known_left is None else known_left
                if spent + reserve_usd > max(0.0, start) / n or (start <= 0 and not fresh):
                    raise BudgetExceeded(
                        f"{period} spend budget of ${limit:.2f} reached for {name}: this replica's share of what was "
                        "left is spent while the shared budget store is unreachable",
                        retry_after=OUTAGE_RETRY_S,
                    )

    def admit(self, scopes: list[tuple[str, str, Limits]], tokens: int, reserve_usd: float, replicas: int, now: float) -> None:
        """`check`, then count the request against this replica's share."""
        self.check(scopes, tokens, reserve_usd, replicas, now)
        today = _day(now)
        n = max(1, replicas)
        for key, _, limits in scopes:
            known = self._known.get(key)
            used = self._used_of(key, known, now, today)
            left: Left = known.left if known is not None else (None, None, 0.0, 0.0)
            for unit, per_minute, known_left, cost in self._rates(limits, left, tokens):
                if per_minute is not None:
                    used.levels[unit] = (self._level(used, unit, per_minute, known_left, n, now) - cost, now)
            used.requests += 1
            used.tokens += tokens
            used.day_usd += reserve_usd
            used.month_usd += reserve_usd

    @staticmethod
    def _rates(limits: Limits, left: Left, tokens: int) -> tuple[tuple[str, int | None, float | None, int], ...]:
        """(unit, per-minute limit, last known remainder, what this request takes) of each rate limit."""
        return (("requests", limits.requests_per_minute, left[0], 1), ("tokens", limits.tokens_per_minute, left[1], tokens))

    @staticmethod
    def _level(used: _Used, unit: str, per_minute: int, known_left: float | None, n: int, now: float) -> float:
        """This replica's allowance for one rate limit now: its bucket, refilled at its share of the
        limit's rate and capped at its share of one window."""
        cap = per_minute / n
        previous = used.levels.get(unit)
        if previous is None:
            start = per_minute if known_left is None else known_left
            level, since = max(0.0, start) / n, used.since
        else:
            level, since = previous
        return min(cap, level + cap * max(0.0, now - since) / WINDOW_S)

    def settle(self, scopes: list[str], reserved_usd: float, cost_usd: float, now: float) -> None:
        """Replace a request's reservation by what it cost (its tokens were counted at admission)."""
        today = _day(now)
        for key in scopes:
            used = self._used.get(key)
            if used is not None and used.day == today:
                used.day_usd = max(0.0, used.day_usd + cost_usd - reserved_usd)
                used.month_usd = max(0.0, used.month_usd + cost_usd - reserved_usd)

    def _used_of(self, key: str, known: _Known | None, now: float, today: str) -> _Used:
        used = self._used.get(key)
        if used is None:
            used = self._used[key] = _Used(since=known.at if known is not None else now, day=today)
        elif used.day != today:
            # a new UTC day: spend counts from zero again (the month's too on a new month)
            used.day_usd = 0.0
            if used.day[:7] != today[:7]:
                used.month_usd = 0.0
            used.day = today
        return used
