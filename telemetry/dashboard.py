"""The figures of the dashboard (GET /v1/dashboard, the page at GET /dashboard), totalled in SQL.

A query is a range [from, to), a time zone and optionally one tenant. The zone says how dates in
`from`/`to` are read (a date is local midnight; a `to` date includes that whole local day) and
how the series is bucketed (local hours, days or months); totals over the range do not depend on it.

Fast and exact at once: the ledger keeps rollups, buckets aligned to UTC (telemetry/ledger.py):
quarters, hours and days per tenant and lane, hours and days per tenant, app, model and lane.
Every span of time a figure covers is split into the largest whole buckets that fit inside it
and the ragged ends, which are totalled from the raw rows (the `ts` index). So a 30-day range
reads about thirty day rows per group, a few hour rows, and at most two hours of raw rows; and a
local day of a zone that is a half or three quarters of an hour off UTC (Asia/Kolkata,
Asia/Kathmandu) is quarters and hours and never a UTC day. A zone offset that is no whole number of quarters (historical local mean
time) only means more raw rows at the ends: the split is exact for any boundaries, so the sum of
the single days is the multi-day total in any zone. When the rollups do not hold every row (a
ledger being caught up), everything is totalled from raw rows (telemetry/totals.py).

Past the ledger's retention (telemetry/retention.py) the totals, the series and the histograms
come from the rollups alone, a range's ends there read to their UTC hour; recent errors, the
per-tier totals and the sessions list the rows still kept, and the percentiles come from the
histograms. The report's `retention` says where that starts and whether the range reaches it
(`complete`: false, with a `warning`).

Latency and TTFT percentiles are exact (numpy, linear) when the range holds at most
EXACT_PERCENTILES_MAX_ROWS successful requests; above that they come from the rollups'
histograms (bins 1/16 of a doubling wide: within 4.4% of the exact value).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import io
import math
import sqlite3
import time
import zoneinfo
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from policies.budgets import Budgets, Limits
from policies.errors import InvalidInput
from telemetry.csv_safe import SafeWriter
from telemetry.ledger import LOG_BINS_PER_DOUBLING, ROLLUP_MEASURES, UNIT_BINS, Ledger
from telemetry.priorities import by_priority
from telemetry.retention import Horizons, read_horizons
from telemetry.timefmt import MAX_TS, MIN_TS, TIME_BOUNDS, iso_time
from telemetry.totals import histograms, rollups_current, totals
from telemetry.usage import MEASURES, USAGE_FROM_ROLLUP, UsageQuery

if TYPE_CHECKING:
    from telemetry.core import Telemetry

DEFAULT_DAYS = 7  # without `from`: the last seven local days, today included
BUCKETS = ("auto", "hour", "day", "month")
MAX_BUCKETS = 1000
EXACT_PERCENTILES_MAX_ROWS = 5_000
RECENT_ERRORS = 50
QUANTILES = (0.5, 0.95, 0.99)
USAGE_KEYS = ("tenant", "app", "model")
SERIES_MEASURES = ("requests", "cost", "saved_cache", "saved_edge", "saved_trim")

assert tuple(USAGE_FROM_ROLLUP) == tuple(MEASURES), "the dashboard must carry every /v1/usage measure"


@functools.lru_cache(maxsize=64)
def zone_of(name: str) -> dt.tzinfo:
    """An IANA zone (`Europe/Berlin`), `UTC`, or a fixed offset `+05:30` / `-0800`; InvalidInput otherwise."""
    text = name.strip()
    if text.upper() in ("UTC", "Z", "GMT"):
        return dt.UTC
    if text[:1] in "+-" and len(text) > 1:
        digits = text[1:].replace(":", "")
        if digits.isdigit() and len(digits) in (2, 4):
            hours, minutes = int(digits[:2]), int(digits[2:] or 0)
            if hours < 24 and minutes < 60:
                sign = -1 if text[0] == "-" else 1
                return dt.timezone(sign * dt.timedelta(hours=hours, minutes=minutes))
    try:
        return zoneinfo.ZoneInfo(text)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise InvalidInput(f"unknown time zone {name!r}: use an IANA name (Europe/Berlin), UTC or +HH:MM", param="tz") from None


def parse_local_time(raw: Any, param: str, zone: dt.tzinfo, *, end_of_day: bool) -> float:
    """Unix seconds, a date (local midnight in `zone`; with end_of_day the next local midnight) or an
    ISO datetime (in `zone` when it names no offset).

    Raises InvalidInput naming `param` for garbage and for times outside MIN_TS .. MAX_TS
    (1970-01-01T00:00:00Z .. 9999-12-31T23:59:59Z); the end of the day 9999-12-31 is MAX_TS.
    """
    text = str(raw).strip()
    try:
        number: float | None = float(text)
    except ValueError:
        number = None
    try:
        if number is not None:
            ts = number
        elif len(text) == 10:
            day = dt.date.fromisoformat(text)
            ts = dt.datetime.combine(day, dt.time(), zone).timestamp()
            if end_of_day:
                # NOTE: the last day of the calendar has no next day to take midnight of
                nxt = dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), zone).timestamp() if day < dt.date.max else ts + 86400.0
                ts = min(nxt, MAX_TS) if MIN_TS <= ts <= MAX_TS else nxt
        else:
            moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=zone)
            ts = moment.timestamp()
    except (ValueError, OverflowError):
        raise InvalidInput(
            f"`{param}` must be unix seconds, YYYY-MM-DD or an ISO 8601 datetime, got {text!r}", param=param
        ) from None
    if not math.isfinite(ts) or not MIN_TS <= ts <= MAX_TS:
        raise InvalidInput(f"`{param}` must lie between {TIME_BOUNDS}, got {text!r}", param=param)
    return ts


def last_local_ts(zone: dt.tzinfo) -> float:
    """The last second that is a date of the calendar both in UTC and in `zone` (at most MAX_TS)."""
    return min(MAX_TS, dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=zone).timestamp())


@dataclass(slots=True, frozen=True)
class DashboardQuery:
    """The range [start, end), the zone it is read and bucketed in, the series' bucket, one tenant or all."""

    start: float
    end: float
    tz: str = "UTC"
    bucket: str = "day"  # hour | day | month
    tenant: str | None = None
    open_end: bool = False  # `to` was not given: the range ends now (the page moves it on each refresh)

    @property
    def zone(self) -> dt.tzinfo:
        return zone_of(self.tz)

    @classmethod
    def parse(cls, params: Mapping[str, Any], *, now: float | None = None) -> DashboardQuery:
        """From query parameters `from`, `to`, `tz`, `bucket`, `tenant`; raises InvalidInput naming the bad one."""
        now = time.time() if now is None else now
        tz = str(params.get("tz") or "UTC").strip()
        zone = zone_of(tz)
        end = parse_local_time(params["to"], "to", zone, end_of_day=True) if params.get("to") else now
        # NOTE: buckets and labels are local dates: a range running past the calendar's last local
        # second (9999-12-31 in a zone east of UTC) is cut there, before any date arithmetic.
        end = min(end, last_local_ts(zone))
        if params.get("from"):
            start = parse_local_time(params["from"], "from", zone, end_of_day=False)
        else:
            today = dt.datetime.fromtimestamp(end, zone).date()
            start = dt.datetime.combine(today - dt.timedelta(days=DEFAULT_DAYS - 1), dt.time(), zone).timestamp()
        if start >= end:
            raise InvalidInput("`from` must be earlier than `to`", param="from")
        bucket = str(params.get("bucket") or "auto").strip()
        if bucket not in BUCKETS:
            raise InvalidInput(f"`bucket` must be one of {', '.join(BUCKETS)}, got {bucket!r}", param="bucket")
        if bucket == "auto":
            span = end - start
            bucket = "hour" if span <= 2 * 86400 else "day" if span <= 92 * 86400 else "month"
        query = cls(start=start, end=end, tz=tz, bucket=bucket, tenant=str(params["tenant"]) if params.get("tenant") else None,
                    open_end=not params.get("to"))  # fmt: skip
        if len(query.buckets()) > MAX_BUCKETS:
            raise InvalidInput(f"the range holds more than {MAX_BUCKETS} {bucket}s: choose a longer bucket or a shorter range", param="bucket")
        return query

    def for_tenant(self, tenant: str) -> DashboardQuery:
        """The same query over one tenant's rows only (what a tenant admin may read)."""
        return replace(self, tenant=tenant)

    def usage_query(self, group_by: tuple[str, ...] = ()) -> UsageQuery:
        """The GET /v1/usage query over the same range and tenant."""
        return UsageQuery(start=self.start, end=self.end, group_by=group_by, filters={"tenant": self.tenant} if self.tenant else {})

    def buckets(self) -> list[tuple[str, float, float]]:
        """(label, start, end) of each local hour, day or month in the range (the first and last clipped to it)."""
        zone, points = self.zone, [self.start]
        local = dt.datetime.fromtimestamp(self.start, zone)
        if self.bucket == "hour":
            edge = self.start - (local.minute * 60 + local.second + local.microsecond / 1e6)
            while len(points) <= MAX_BUCKETS + 1:
                after = edge + 3600.0
                try:
                    moment = dt.datetime.fromtimestamp(after, zone)
                except (OverflowError, ValueError):
                    break  # past the calendar's last local hour: the range ends inside it
                edge = after - (moment.minute * 60 + moment.second + moment.microsecond / 1e6)
                if edge <= points[-1]:  # an offset change that is no whole hour
                    edge = after
                if edge >= self.end:
                    break
                points.append(edge)
        else:
            naive = local.replace(tzinfo=None, hour=0, minute=0, second=0, microsecond=0)
            if self.bucket == "month":
                naive = naive.replace(day=1)
            while len(points) <= MAX_BUCKETS + 1:
                try:
                    if self.bucket == "day":
                        naive = naive + dt.timedelta(days=1)
                    else:
                        naive = naive.replace(year=naive.year + 1, month=1) if naive.month == 12 else naive.replace(month=naive.month + 1)
                except (OverflowError, ValueError):
                    break  # the calendar's last day or month: the range ends inside it
                edge = naive.replace(tzinfo=zone).timestamp()
                if edge >= self.end:
                    break
                if edge > points[-1]:
                    points.append(edge)
        points.append(self.end)
        return [(self.label(lo), lo, hi) for lo, hi in zip(points, points[1:])]

    def label(self, ts: float) -> str:
        """The local hour, day or month holding ts."""
        local = dt.datetime.fromtimestamp(ts, self.zone)
        if self.bucket == "hour":
            return local.replace(minute=0, second=0, microsecond=0).isoformat(timespec="minutes")
        return local.strftime("%Y-%m-%d" if self.bucket == "day" else "%Y-%m")


# Percentiles ------------------------------------------------------------------------------------


def log_bin_edges(b: int) -> tuple[float, float]:
    return 2.0 ** (b / LOG_BINS_PER_DOUBLING), 2.0 ** ((b + 1) / LOG_BINS_PER_DOUBLING)


def histogram_quantiles(counts: Mapping[int, int], quantiles: Iterable[float] = QUANTILES) -> list[float | None]:
    """Quantiles of log-binned times: linear inside the bin that holds the rank (within one bin's width)."""
    total = sum(counts.values())
    if not total:
        return [None for _ in quantiles]
    ordered = sorted(counts.items())
    out: list[float | None] = []
    for q in quantiles:
        rank, seen = q * total, 0
        value = log_bin_edges(ordered[-1][0])[1]
        for b, n in ordered:
            if seen + n >= rank and n:
                lo, hi = log_bin_edges(b)
                value = lo + (hi - lo) * max(0.0, min(1.0, (rank - seen) / n))
                break
            seen += n
        out.append(value)
    return out


def _stats(values: list[float], quantiles: Iterable[float] = QUANTILES) -> list[float | None]:
    if not values:
        return [None for _ in quantiles]
    array = np.asarray(values, dtype=np.float64)
    return [float(v) for v in np.percentile(array, [q * 100 for q in quantiles])]


def _percentiles(
    conn: sqlite3.Connection, query: DashboardQuery, ok: int, hist: Mapping[str, Mapping[int, int]], *, rows_kept: bool
) -> tuple[dict[str, float | None], dict[str, float | None], str]:
    names = [f"p{round(q * 100)}" for q in QUANTILES]
    if ok <= EXACT_PERCENTILES_MAX_ROWS and rows_kept:
        sql = "SELECT latency_ms, ttft_ms FROM requests WHERE ts >= ? AND ts < ? AND status < 400 AND operation != 'judge'"
        params: list[Any] = [query.start, query.end]
        if query.tenant is not None:
            sql += " AND +tenant = ?"  # the ts index, never the tenant one
            params.append(query.tenant)
        rows = conn.execute(sql, params).fetchall()
        latency = _stats([float(r[0]) for r in rows])
        ttft = _stats([float(r[1]) for r in rows if r[1] is not None])
        method = "exact"
    else:
        latency = histogram_quantiles(hist.get("latency_ms", {}))
        ttft = histogram_quantiles(hist.get("ttft_ms", {}))
        method = "histogram"
    return dict(zip(names, _round_all(latency))), dict(zip(names, _round_all(ttft))), method


def _round_all(values: list[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 3) for v in values]


# The report ----------------------------------------------------------------------------------------


def _usage(row: Mapping[str, Any]) -> dict[str, Any]:
    """/v1/usage's measures from one totals row (rounded the way /v1/usage rounds them)."""
    out: dict[str, Any] = {}
    for name, columns in USAGE_FROM_ROLLUP.items():
        value = sum(row.get(c, 0) for c in columns)
        out[name] = round(float(value), 9) if name.endswith("_usd") else int(value)
    return out


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 6) if whole else None


def _headline(row: Mapping[str, Any]) -> dict[str, Any]:
    usage = _usage(row)
    upstream = usage["cost_usd"] + usage["saved_usd"]  # what everything sent upstream would have cost
    requests = usage["requests"]
    return {
        **usage,
        "rejected": int(row.get("rejected", 0)),
        "upstream_equivalent_usd": round(upstream, 9),
        "saved_share": _ratio(usage["saved_usd"], upstream),
        "local_share": _ratio(row.get("local", 0), requests),
        "cache_hit_rate": _ratio(row.get("cache_hits", 0), row.get("cache_lookups", 0)),
        "cache_lookups": int(row.get("cache_lookups", 0)),
        "error_rate": _ratio(usage["errors"], requests),
        "latency_ms_mean": _ratio(row.get("latency_ms", 0.0), row.get("ok", 0)),
        "ttft_ms_mean": _ratio(row.get("ttft_ms", 0.0), row.get("ttft_n", 0)),
    }


def _limits(limits: Limits) -> dict[str, Any]:
    return {
        "daily_spend_usd": limits.daily_spend_usd,
        "monthly_spend_usd": limits.monthly_spend_usd,
        "requests_per_minute": limits.requests_per_minute,
        "tokens_per_minute": limits.tokens_per_minute,
    }


def _budgets(
    conn: sqlite3.Connection, query: DashboardQuery, budgets: Budgets | None, pairs: list[tuple[str, str, int]], now: float, rollups: bool
) -> list[dict[str, Any]]:
    """Spend today and this month (UTC, as budgets count them) against each limit; 429s in the range."""
    if budgets is None or not budgets.enabled or not pairs:
        return []
    today = dt.datetime.combine(dt.datetime.fromtimestamp(now, dt.UTC).date(), dt.time(), dt.UTC)
    month = today.replace(day=1)
    spend: dict[tuple[str, str], list[float]] = {}
    ranges = [(today.timestamp(), now), (month.timestamp(), now)]
    for row in totals(conn, ranges, ("tenant", "app"), measures=("cost",), tenant=query.tenant, rollups=rollups):
        spend.setdefault((row["tenant"], row["app"]), [0.0, 0.0])[row["label"]] = row["cost"]
    out: list[dict[str, Any]] = []
    tenants: dict[str, dict[str, Any]] = {}
    for tenant, app, rejected in pairs:
        tenant_limits, app_limits = budgets.limits(tenant, app)
        day, mon = spend.get((tenant, app), [0.0, 0.0])
        if not app_limits.unlimited:
            out.append({"scope": "app", "tenant": tenant, "app": app, **_limits(app_limits),
                        "spent_today_usd": round(day, 9), "spent_month_usd": round(mon, 9), "rejected": rejected})  # fmt: skip
        if not tenant_limits.unlimited:
            entry = tenants.setdefault(tenant, {"scope": "tenant", "tenant": tenant, "app": None, **_limits(tenant_limits),
                                                "spent_today_usd": 0.0, "spent_month_usd": 0.0, "rejected": 0})  # fmt: skip
            entry["spent_today_usd"] = round(entry["spent_today_usd"] + day, 9)
            entry["spent_month_usd"] = round(entry["spent_month_usd"] + mon, 9)
            entry["rejected"] += rejected
    return [*tenants.values(), *out]


def _errors(conn: sqlite3.Connection, query: DashboardQuery) -> list[dict[str, Any]]:
    sql = ("SELECT ts, request_id, trace_id, tenant, app, lane, model, status, error_code FROM requests "
           "WHERE status >= 400 AND ts >= ? AND ts < ?")  # fmt: skip
    params: list[Any] = [query.start, query.end]
    if query.tenant is not None:
        sql += " AND +tenant = ?"  # the ts (errors) index, never the tenant one
        params.append(query.tenant)
    sql += f" ORDER BY ts DESC LIMIT {RECENT_ERRORS}"
    zone = query.zone
    return [
        {"time": iso_time(r["ts"]), "local_time": dt.datetime.fromtimestamp(r["ts"], zone).isoformat(timespec="seconds"),
         "request_id": r["request_id"], "trace_id": r["trace_id"], "tenant": r["tenant"], "app": r["app"],
         "lane": r["lane"], "model": r["model"], "status": r["status"], "error_code": r["error_code"]}  # fmt: skip
        for r in conn.execute(sql, params)
    ]


def _tiers(conn: sqlite3.Connection, query: DashboardQuery) -> list[dict[str, Any]]:
    """Upstream requests by tier (cost | strong; "none": no tiers in the policy), from the raw rows."""
    sql = ("SELECT COALESCE(tier, 'none') AS tier, COUNT(*) AS requests, SUM(cost) AS cost, "
           "SUM(input_tokens) AS input_tokens, SUM(output_tokens) AS output_tokens, SUM(escalated) AS escalated "
           "FROM requests WHERE ts >= ? AND ts < ? AND lane = 'upstream'")  # fmt: skip
    params: list[Any] = [query.start, query.end]
    if query.tenant is not None:
        sql += " AND tenant = ?"
        params.append(query.tenant)
    sql += " GROUP BY 1 ORDER BY 1"
    return [
        {"tier": r["tier"], "requests": int(r["requests"]), "cost_usd": round(float(r["cost"] or 0.0), 9),
         "input_tokens": int(r["input_tokens"] or 0), "output_tokens": int(r["output_tokens"] or 0),
         "escalated": int(r["escalated"] or 0)}  # fmt: skip
        for r in conn.execute(sql, params)
    ]


# The sessions the dashboard lists: the costliest in the range.
TOP_SESSIONS = 20


# A session is flagged when, after its first turns, less than this share of its input was read
# from the provider's prompt cache: agent sessions read most of every turn from it, so a low share
# later on is a prefix something broke (a translation, a trim, a switch of model), and a bill.
WARM_AFTER = 2
BROKEN_SHARE = 0.5


def _sessions(conn: sqlite3.Connection, query: DashboardQuery) -> list[dict[str, Any]]:
    """The costliest conversations (agent sessions, Responses chains) in the range, from the raw rows,
    with the cached-read share of their input after the first turns and observation masking's
    saving (or, in shadow mode, what it would have saved)."""
    where = "ts >= ? AND ts < ? AND session IS NOT NULL"
    params: list[Any] = [query.start, query.end]
    if query.tenant is not None:
        where += " AND tenant = ?"
        params.append(query.tenant)
    sql = ("WITH s AS (SELECT *, ROW_NUMBER() OVER (PARTITION BY tenant, app, session ORDER BY ts, id) AS turn "
           f"FROM requests WHERE {where}) "
           "SELECT tenant, app, session, COUNT(*) AS requests, SUM(status >= 400) AS errors, SUM(cost) AS cost, "
           "SUM(input_tokens) AS input_tokens, SUM(output_tokens) AS output_tokens, "
           "SUM(cached_input_tokens) AS cached_input_tokens, SUM(cache_write_tokens) AS cache_write_tokens, "
           f"SUM(CASE WHEN turn > {WARM_AFTER} THEN input_tokens ELSE 0 END) AS late_input, "
           f"SUM(CASE WHEN turn > {WARM_AFTER} THEN cached_input_tokens ELSE 0 END) AS late_cached, "
           f"SUM(CASE WHEN turn > {WARM_AFTER} AND input_tokens > 0 AND cached_input_tokens < {BROKEN_SHARE} * input_tokens "
           "THEN 1 ELSE 0 END) AS cold_turns, "
           "SUM(masked_tokens) AS masked_tokens, SUM(saved_mask) AS saved_mask, MAX(mask_mode) AS mask_mode, "
           "MIN(ts) AS first, MAX(ts) AS last "
           f"FROM s GROUP BY tenant, app, session ORDER BY SUM(cost) DESC, COUNT(*) DESC LIMIT {TOP_SESSIONS}")  # fmt: skip
    rows = []
    for r in conn.execute(sql, params):
        input_tokens, late_input = int(r["input_tokens"] or 0), int(r["late_input"] or 0)
        late_share = (int(r["late_cached"] or 0) / late_input) if late_input else None
        rows.append({
            "tenant": r["tenant"], "app": r["app"], "session": r["session"], "requests": int(r["requests"]),
            "errors": int(r["errors"] or 0), "cost_usd": round(float(r["cost"] or 0.0), 9),
            "input_tokens": input_tokens, "output_tokens": int(r["output_tokens"] or 0),
            "cached_input_tokens": int(r["cached_input_tokens"] or 0),
            "cache_write_tokens": int(r["cache_write_tokens"] or 0),
            "cached_share": round(int(r["cached_input_tokens"] or 0) / input_tokens, 4) if input_tokens else None,
            "cached_share_late": None if late_share is None else round(late_share, 4),
            "cold_turns": int(r["cold_turns"] or 0),
            "prefix_broken": late_share is not None and late_share < BROKEN_SHARE,
            "mask_mode": r["mask_mode"], "masked_tokens": int(r["masked_tokens"] or 0),
            "saved_mask_usd": round(float(r["saved_mask"] or 0.0), 9),
            "first": iso_time(r["first"]), "last": iso_time(r["last"]),
        })  # fmt: skip
    return rows


def _reasons(hist: Mapping[str, Mapping[int, int]], prefix: str) -> list[dict[str, Any]]:
    counts = [(kind.removeprefix(prefix), sum(bins.values())) for kind, bins in hist.items() if kind.startswith(prefix)]
    return [{"reason": reason, "count": n} for reason, n in sorted(counts, key=lambda c: (-c[1], c[0]))]


def _unit_histogram(counts: Mapping[int, int]) -> list[int]:
    return [int(counts.get(b, 0)) for b in range(UNIT_BINS)]


def empty_report(query: DashboardQuery) -> dict[str, Any]:
    return ledger_report(None, query, budgets=None, now=query.end)


def ledger_report(conn: sqlite3.Connection | None, query: DashboardQuery, *, budgets: Budgets | None, now: float) -> dict[str, Any]:
    """Every ledger figure of the dashboard over one read snapshot (None: there is no ledger yet). Blocking."""
    began = time.perf_counter()
    rollups = conn is not None and rollups_current(conn)
    horizons = read_horizons(conn) if conn is not None else Horizons()
    kept = query.start >= horizons.rows_from
    listed = query if kept else replace(query, start=min(horizons.rows_from, query.end))  # the rows still there
    buckets = query.buckets()
    whole = [(query.start, query.end)]
    if conn is None:
        head_rows, breakdown_rows, series_rows, hist, errors = [], [], [], {}, []
        tiers: list[dict[str, Any]] = []
        sessions: list[dict[str, Any]] = []
        priorities: list[dict[str, Any]] = []
    else:
        head_rows = totals(conn, whole, tenant=query.tenant, rollups=rollups)
        breakdown_rows = totals(conn, whole, USAGE_KEYS, tenant=query.tenant, rollups=rollups)
        series_rows = totals(conn, [(lo, hi) for _, lo, hi in buckets], ("lane",), measures=SERIES_MEASURES, tenant=query.tenant,
                             rollups=rollups)  # fmt: skip
        hist = histograms(conn, query.start, query.end, tenant=query.tenant, rollups=rollups)
        errors = _errors(conn, listed)
        tiers = _tiers(conn, listed)
        sessions = _sessions(conn, listed)
        priorities = by_priority(conn, listed.start, listed.end, listed.tenant)
    head = head_rows[0] if head_rows else {m: 0 for m in ROLLUP_MEASURES}
    headline = _headline(head)
    if conn is not None:
        latency, ttft, method = _percentiles(conn, query, int(head.get("ok", 0)), hist, rows_kept=kept)
    else:
        latency = ttft = {f"p{round(q * 100)}": None for q in QUANTILES}
        method = "exact"
    headline["latency_ms"], headline["ttft_ms"], headline["percentiles"] = latency, ttft, method

    lanes: dict[str, dict[str, list[float]]] = {}
    for row in series_rows:
        lane = lanes.setdefault(row["lane"], {"requests": [0] * len(buckets), "cost_usd": [0.0] * len(buckets),
                                             "saved_usd": [0.0] * len(buckets)})  # fmt: skip
        i = row["label"]
        lane["requests"][i] = row["requests"]
        lane["cost_usd"][i] = round(row["cost"], 9)
        lane["saved_usd"][i] = round(row["saved_cache"] + row["saved_edge"] + row["saved_trim"], 9)

    breakdown = [
        {**{k: row[k] for k in USAGE_KEYS}, **_usage(row), "rejected": row["rejected"]}
        for row in sorted(breakdown_rows, key=lambda r: (-r["cost"], -r["requests"], r["tenant"], r["app"], r["model"]))
    ]
    pairs: dict[tuple[str, str], int] = {}
    for row in breakdown_rows:
        pairs[(row["tenant"], row["app"])] = pairs.get((row["tenant"], row["app"]), 0) + row["rejected"]
    budget_rows = (
        _budgets(conn, query, budgets, [(t, a, n) for (t, a), n in sorted(pairs.items())], now, rollups) if conn is not None else []
    )

    escalation, routes = _reasons(hist, "escalation:"), _reasons(hist, "route:")
    edge_requests, escalated = int(head.get("edge_requests", 0)), int(head.get("escalated", 0))
    zone_now = dt.datetime.fromtimestamp(query.end, query.zone)
    body: dict[str, Any] = {
        "object": "dashboard",
        "from": iso_time(query.start),
        "to": iso_time(query.end),
        "from_local": dt.datetime.fromtimestamp(query.start, query.zone).isoformat(timespec="seconds"),
        "to_local": zone_now.isoformat(timespec="seconds"),
        "tz": query.tz,
        "bucket": query.bucket,
        "tenant": query.tenant,
        "open_end": query.open_end,
        "source": "local",
        "rollups": rollups,
        "retention": {
            "rows_from": iso_time(horizons.rows_from) if horizons.rows_from else None,
            "hours_from": iso_time(horizons.hours_from) if horizons.hours_from else None,
            "complete": kept,
        },
        "headline": headline,
        "series": {
            "bucket": query.bucket,
            "labels": [label for label, _, _ in buckets],
            "starts": [iso_time(lo) for _, lo, _ in buckets],
            "lanes": dict(sorted(lanes.items())),
        },
        "breakdown": breakdown,
        "budgets": budget_rows,
        "quality": {
            "edge": {
                "requests": edge_requests,
                "escalated": escalated,
                "escalation_rate": _ratio(escalated, edge_requests + escalated),
                "edge_tokens": int(head.get("edge_tokens", 0)),
                "mean_confidence": _ratio(head.get("confidence", 0.0), head.get("confidence_n", 0)),
                "reasons": escalation,
            },
            "routes": routes,
            "tiers": tiers,
            "priorities": priorities,
            "sessions": sessions,
            "unit_bins": UNIT_BINS,
            "confidence_histogram": {
                "served": _unit_histogram(hist.get("confidence_served", {})),
                "escalated": _unit_histogram(hist.get("confidence_escalated", {})),
            },
            "cache_similarity_histogram": _unit_histogram(hist.get("cache_similarity", {})),
            "shadow": [],
        },
        "edge_engine": None,
        "errors": errors,
        "query_ms": round((time.perf_counter() - began) * 1000.0, 3),
    }
    if not kept:
        body["warning"] = retention_warning(horizons, query)
    return body


def retention_warning(horizons: Horizons, query: DashboardQuery) -> str:
    """What the report says when its range starts where the ledger keeps only rollups."""
    start, end = horizons.snap(query.start), horizons.snap(query.end)
    read = "" if (start, end) == (query.start, query.end) else f", from {iso_time(start)} to {iso_time(end)}"
    return (f"rows before {iso_time(horizons.rows_from)} are past the ledger's retention: totals there come from its "
            f"hourly and daily totals{read}; recent errors, tiers, priority classes and sessions list later requests only, "
            "and percentiles come from histograms")  # fmt: skip


def read_report(ledger: Ledger, query: DashboardQuery, *, budgets: Budgets | None, now: float) -> dict[str, Any]:
    """`ledger_report` over one snapshot of the ledger file. Blocking: run it on a worker thread."""
    with ledger.snapshot() as conn:
        return ledger_report(conn, query, budgets=budgets, now=now)


async def report(telemetry: Telemetry, query: DashboardQuery, *, now: float | None = None) -> dict[str, Any]:
    """The dashboard's ledger figures, including rows appended a moment ago; with `state.backend: redis`
    the usage totals (headline and breakdown) are the whole fleet's, as on GET /v1/usage."""
    now = time.time() if now is None else now
    await asyncio.to_thread(telemetry.ledger.flush)
    body = await asyncio.to_thread(read_report, telemetry.ledger, query, budgets=telemetry.budgets, now=now)
    if telemetry.fleet is not None:
        rows, source, warning = await telemetry.fleet_usage(query.usage_query(USAGE_KEYS))
        merge_fleet(body, rows, source, warning)
    return body


def merge_fleet(body: dict[str, Any], rows: list[dict[str, Any]], source: str, warning: str | None) -> None:
    """Replace the usage totals of the headline and breakdown with GET /v1/usage's rows (grouped by USAGE_KEYS)."""
    body["source"] = source
    if warning is not None:
        body["warning"] = f"{warning}; {body['warning']}" if body.get("warning") else warning
    local = {tuple(r[k] for k in USAGE_KEYS): r for r in body["breakdown"]}
    breakdown = []
    for row in rows:
        key = tuple(row[k] for k in USAGE_KEYS)
        rejected = local[key]["rejected"] if key in local else 0
        breakdown.append({**{k: row[k] for k in USAGE_KEYS}, **{m: row[m] for m in MEASURES}, "rejected": rejected})
    breakdown.sort(key=lambda r: (-r["cost_usd"], -r["requests"], r["tenant"], r["app"], r["model"]))
    body["breakdown"] = breakdown
    headline = body["headline"]
    for m in MEASURES:
        total = sum(r[m] for r in rows)
        headline[m] = round(total, 9) if m.endswith("_usd") else int(total)
    upstream = headline["cost_usd"] + headline["saved_usd"]
    headline["upstream_equivalent_usd"] = round(upstream, 9)
    headline["saved_share"] = _ratio(headline["saved_usd"], upstream)
    headline["error_rate"] = _ratio(headline["errors"], headline["requests"])


# CSV --------------------------------------------------------------------------------------------------


def to_csv(body: Mapping[str, Any]) -> str:
    """Every figure of a report, one per line: section, group, metric, value (long format, for pivots)."""
    out = io.StringIO()
    writer = SafeWriter(out)
    writer.writerow(["section", "group", "metric", "value"])
    for key in ("from", "to", "from_local", "to_local", "tz", "bucket", "tenant", "source"):
        writer.writerow(["query", "", key, _cell(body.get(key))])
    for name, value in body["headline"].items():
        if isinstance(value, dict):
            for q, v in value.items():
                writer.writerow(["headline", "", f"{name}_{q}", _cell(v)])
        else:
            writer.writerow(["headline", "", name, _cell(value)])
    series = body["series"]
    for lane, measures in series["lanes"].items():
        for metric, values in measures.items():
            for label, value in zip(series["labels"], values):
                writer.writerow(["series", f"{label}|{lane}", metric, _cell(value)])
    for row in body["breakdown"]:
        group = f"{row['tenant']}|{row['app']}|{row['model']}"
        for metric, value in row.items():
            if metric not in USAGE_KEYS:
                writer.writerow(["breakdown", group, metric, _cell(value)])
    for row in body["budgets"]:
        group = f"{row['scope']}|{row['tenant']}|{row['app'] or ''}"
        for metric, value in row.items():
            if metric not in ("scope", "tenant", "app"):
                writer.writerow(["budgets", group, metric, _cell(value)])
    quality = body["quality"]
    for metric, value in quality["edge"].items():
        if metric == "reasons":
            for r in value:
                writer.writerow(["escalations", r["reason"], "count", r["count"]])
        else:
            writer.writerow(["edge_quality", "", metric, _cell(value)])
    for r in quality["routes"]:
        writer.writerow(["routes", r["reason"], "count", r["count"]])
    width = 1.0 / quality["unit_bins"]
    for name, values in (("confidence_served", quality["confidence_histogram"]["served"]),
                         ("confidence_escalated", quality["confidence_histogram"]["escalated"]),
                         ("cache_similarity", quality["cache_similarity_histogram"])):  # fmt: skip
        for b, n in enumerate(values):
            writer.writerow([name, f"{b * width:.2f}-{(b + 1) * width:.2f}", "count", n])
    for r in quality.get("shadow") or []:
        for metric, value in r.items():
            if metric != "lane":
                writer.writerow(["shadow", r["lane"], metric, _cell(value)])
    for r in quality.get("priorities") or []:
        for metric, value in r.items():
            if metric != "priority":
                writer.writerow(["priorities", r["priority"], metric, _cell(value)])
    for r in quality.get("sessions") or []:
        for metric, value in r.items():
            if metric != "session":
                writer.writerow(["sessions", r["session"], metric, _cell(value)])
    for metric, value in (body.get("edge_engine") or {}).items():
        if not isinstance(value, dict | list):
            writer.writerow(["edge_engine", "", metric, _cell(value)])
    for r in body["errors"]:
        for metric in ("time", "trace_id", "tenant", "app", "lane", "model", "status", "error_code"):
            writer.writerow(["errors", r["request_id"], metric, _cell(r[metric])])
    return out.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(round(value, 9))
    return str(value)
