"""Usage reports over the ledger: parse a query, total it in SQL, render JSON, CSV or a text table.

A range whose rows are all kept is totalled from them, to the second. One that reaches past the
ledger's retention (telemetry/retention.py) is totalled from the rollups there, its ends read to
their UTC hour (or day, past the hourly rollups), and the report says so in a `warning`. The
priority class is on the rows alone (no rollup keeps it): a report grouped or filtered by it covers
the rows kept, and says so where the range reaches further.
"""

from __future__ import annotations

import io
import math
import sqlite3
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.errors import InvalidInput
from telemetry.csv_safe import SafeWriter
from telemetry.ledger import Ledger
from telemetry.retention import DAY, Horizons, read_horizons
from telemetry.timefmt import iso_time, parse_time
from telemetry.totals import rollups_current, totals

GROUP_KEYS = ("tenant", "app", "model", "lane", "priority", "day")
FILTER_KEYS = ("tenant", "app", "model", "lane", "priority")
ROW_ONLY_KEYS = frozenset({"priority"})  # kept on the raw rows, in no rollup
DEFAULT_DAYS = 30

JUDGE = "judge"  # the operation of a shadow re-ask's row (gateway/pipeline/shadow.py): judging spend
_REQUEST = f"operation != '{JUDGE}'"


def _requests_only(column: str) -> str:
    return f"SUM(CASE WHEN {_REQUEST} THEN {column} ELSE 0 END)"


def _judging_only(column: str) -> str:
    return f"SUM(CASE WHEN operation = '{JUDGE}' THEN {column} ELSE 0 END)"


# Output column -> SQL aggregate; group keys come first in every row. The request measures count
# requests alone; judging (the shadow stage's re-asks, operation `judge`) has measures of its own.
MEASURES: dict[str, str] = {
    "requests": f"SUM({_REQUEST})",
    "errors": f"SUM(status >= 400 AND {_REQUEST})",
    "input_tokens": _requests_only("input_tokens"),
    "output_tokens": _requests_only("output_tokens"),
    "cached_input_tokens": "SUM(cached_input_tokens)",  # prompt-cache reads
    "cache_write_tokens": "SUM(cache_write_tokens)",  # prompt-cache writes (5-minute and 1-hour)
    "trimmed_tokens": "SUM(trimmed_tokens)",
    "estimated_requests": "SUM(estimated)",
    "cost_usd": _requests_only("cost"),
    "saved_usd": "SUM(saved_cache + saved_edge + saved_trim)",
    "saved_cache_usd": "SUM(saved_cache)",
    "saved_edge_usd": "SUM(saved_edge)",
    "saved_trim_usd": "SUM(saved_trim)",
    # against stated counterfactuals (telemetry/billing.py), escalated edge attempts netted
    "saved_vs_strong_usd": "SUM(COALESCE(saved_vs_strong, saved_cache + saved_edge + saved_trim))",
    "saved_vs_named_usd": "SUM(COALESCE(saved_vs_named, saved_cache + saved_edge + saved_trim))",
    "judge_requests": f"SUM(operation = '{JUDGE}')",
    "judge_input_tokens": _judging_only("input_tokens"),
    "judge_output_tokens": _judging_only("output_tokens"),
    "judge_cost_usd": _judging_only("cost"),
}

# The same measures from rollup columns (telemetry/ledger.py ROLLUP_MEASURES), for spans past the
# retention and for the dashboard, which carries GET /v1/usage's names and figures.
USAGE_FROM_ROLLUP: dict[str, tuple[str, ...]] = {
    "requests": ("requests",),
    "errors": ("errors",),
    "input_tokens": ("input_tokens",),
    "output_tokens": ("output_tokens",),
    "cached_input_tokens": ("cached_input_tokens",),
    "cache_write_tokens": ("cache_write_tokens",),
    "trimmed_tokens": ("trimmed_tokens",),
    "estimated_requests": ("estimated_requests",),
    "cost_usd": ("cost",),
    "saved_usd": ("saved_cache", "saved_edge", "saved_trim"),
    "saved_cache_usd": ("saved_cache",),
    "saved_edge_usd": ("saved_edge",),
    "saved_trim_usd": ("saved_trim",),
    "saved_vs_strong_usd": ("saved_vs_strong",),
    "saved_vs_named_usd": ("saved_vs_named",),
    "judge_requests": ("judge_requests",),
    "judge_input_tokens": ("judge_input_tokens",),
    "judge_output_tokens": ("judge_output_tokens",),
    "judge_cost_usd": ("judge_cost",),
}


@dataclass(slots=True, frozen=True)
class UsageQuery:
    """Totals over [start, end) grouped by some of GROUP_KEYS, optionally filtered."""

    start: float
    end: float
    group_by: tuple[str, ...] = ()
    filters: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, params: Mapping[str, Any], *, now: float | None = None) -> UsageQuery:
        """From HTTP query or CLI parameters; raises InvalidInput naming the bad parameter."""
        now = time.time() if now is None else now
        group_by: list[str] = []
        for raw in _all(params, "group_by"):
            for key in (k.strip() for k in raw.split(",")):
                if not key:
                    continue
                if key not in GROUP_KEYS:
                    raise InvalidInput(
                        f"cannot group by {key!r}; choose from {', '.join(GROUP_KEYS)}", param="group_by"
                    )
                if key not in group_by:
                    group_by.append(key)
        end = parse_time(params.get("to"), "to", end_of_day=True) if params.get("to") else now
        start = (
            parse_time(params.get("from"), "from", end_of_day=False)
            if params.get("from")
            else end - DEFAULT_DAYS * 86400.0
        )
        if start >= end:
            raise InvalidInput("`from` must be earlier than `to`", param="from")
        filters = {k: str(params[k]) for k in FILTER_KEYS if params.get(k)}
        return cls(start=start, end=end, group_by=tuple(group_by), filters=filters)

    @property
    def rows_only(self) -> bool:
        """Whether it groups or filters by a key only the raw rows keep (the priority class)."""
        return bool(ROW_ONLY_KEYS & {*self.group_by, *self.filters})

    def for_tenant(self, tenant: str) -> UsageQuery:
        """The same query over one tenant's rows only (what a tenant admin may read)."""
        return replace(self, filters={**self.filters, "tenant": tenant})

    def sql(self) -> tuple[str, list[Any]]:
        keys = ", ".join(self.group_by)
        measures = ", ".join(f"{expr} AS {name}" for name, expr in MEASURES.items())
        where = ["ts >= ?", "ts < ?"]
        params: list[Any] = [self.start, self.end]
        for key, value in self.filters.items():
            where.append(f"{key} = ?")
            params.append(value)
        sql = f"SELECT {keys + ', ' if keys else ''}{measures} FROM requests WHERE {' AND '.join(where)}"
        if keys:
            sql += f" GROUP BY {keys} ORDER BY {keys}"
        return sql, params


def _all(params: Mapping[str, Any], key: str) -> list[str]:
    getall = getattr(params, "getall", None)
    if getall is not None:
        return [str(v) for v in getall(key, [])]
    value = params.get(key)
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]


def run_query(ledger: Ledger, query: UsageQuery) -> list[dict[str, Any]]:
    """Blocking: run it on a worker thread."""
    return read_usage(ledger, query)[0]


def read_usage(ledger: Ledger, query: UsageQuery) -> tuple[list[dict[str, Any]], str | None]:
    """The report's rows, and a warning when part of the range was read at the rollups' resolution. Blocking."""
    with ledger.snapshot() as conn:
        if conn is None:
            return [], None
        horizons = read_horizons(conn)
        if query.rows_only and query.start < horizons.rows_from:
            kept = replace(query, start=min(horizons.rows_from, query.end))
            sql, params = kept.sql()
            found = [dict(zip(row.keys(), row)) for row in conn.execute(sql, params)]
            return _rows(query, found), (f"the priority class is kept on each request's row only: this report counts "
                                         f"from {iso_time(kept.start)}, where the ledger's rows begin")  # fmt: skip
        if query.start >= horizons.rows_from:
            sql, params = query.sql()
            found = [dict(zip(row.keys(), row)) for row in conn.execute(sql, params)]
        else:
            found = _from_rollups(conn, query)
    return _rows(query, found), retention_warning(horizons, query.start, query.end)


def _rows(query: UsageQuery, found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for row in found:
        item = {key: row[key] for key in query.group_by}
        for name in MEASURES:
            value = row[name]
            item[name] = round(value or 0.0, 9) if name.endswith("_usd") else int(value or 0)
        if item["requests"] or item["judge_requests"]:
            rows.append(item)
    return rows


def retention_warning(horizons: Horizons, start: float, end: float) -> str | None:
    """What a report over [start, end) must say when an end lies where only rollups are left."""
    if not (horizons.moved(start) or horizons.moved(end)):
        return None
    unit = "hour" if horizons.snap(start) >= horizons.hours_from else "day"
    return (f"rows before {iso_time(horizons.rows_from)} are past the ledger's retention and kept as totals: this range "
            f"is counted from {iso_time(horizons.snap(start))} to {iso_time(horizons.snap(end))} (whole UTC {unit}s there)")  # fmt: skip


def _from_rollups(conn: sqlite3.Connection, query: UsageQuery) -> list[dict[str, Any]]:
    """The query's rows from the rollups (and the raw rows where they are kept), grouped like query.sql()."""
    keys = tuple(k for k in query.group_by if k != "day")
    ranges = [(query.start, query.end)]
    if "day" in query.group_by:
        edges = [query.start, *range(math.floor(query.start / DAY) * DAY + DAY, math.ceil(query.end / DAY) * DAY, DAY), query.end]
        ranges = list(zip(edges, edges[1:]))
    columns = tuple(dict.fromkeys(c for cs in USAGE_FROM_ROLLUP.values() for c in cs))
    found = []
    for row in totals(conn, ranges, keys, measures=columns, filters=query.filters, rollups=rollups_current(conn)):
        item: dict[str, Any] = {k: row[k] for k in keys}
        if "day" in query.group_by:
            item["day"] = time.strftime("%Y-%m-%d", time.gmtime(ranges[row["label"]][0]))
        for name, cs in USAGE_FROM_ROLLUP.items():
            item[name] = sum(row[c] for c in cs)
        found.append(item)
    return sorted(found, key=lambda r: tuple(r[k] for k in query.group_by))


def report(
    query: UsageQuery, rows: Sequence[dict[str, Any]], source: str | None = None, warning: str | None = None
) -> dict[str, Any]:
    """The JSON body of GET /v1/usage; `source` (when given): "fleet" (every replica, from the shared
    store, whole hours) or "local" (this replica's ledger)."""
    total = {name: 0 for name in MEASURES}
    for row in rows:
        for name in MEASURES:
            total[name] += row[name]
    total = {k: round(v, 9) if k.endswith("_usd") else v for k, v in total.items()}
    body: dict[str, Any] = {
        "object": "usage.report",
        "from": iso_time(query.start),
        "to": iso_time(query.end),
        "group_by": list(query.group_by),
        "filters": query.filters,
        "data": list(rows),
        "total": total,
    }
    if source is not None:
        body["source"] = source
    if warning is not None:
        body["warning"] = warning
    return body


def to_csv(query: UsageQuery, rows: Sequence[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = SafeWriter(out)
    header = [*query.group_by, *MEASURES]
    writer.writerow(header)
    for row in rows:
        writer.writerow([_cell(row[name]) for name in header])
    return out.getvalue()


def to_table(query: UsageQuery, rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width text table with a total line, for the terminal."""
    header = [*query.group_by, *MEASURES]
    total = report(query, rows)["total"]
    lines = [[_cell(row[name]) for name in header] for row in rows]
    footer = ["total" if i == 0 else "" for i in range(len(query.group_by))]
    footer += [_cell(total[name]) for name in MEASURES]
    widths = [max(len(h), *(len(line[i]) for line in [*lines, footer])) for i, h in enumerate(header)]
    numeric = [name in MEASURES for name in header]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    title = f"usage {iso_time(query.start)} .. {iso_time(query.end)}"
    return "\n".join([title, fmt(header), rule, *(fmt(line) for line in lines), rule, fmt(footer)]) + "\n"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6f}"
    return "" if value is None else str(value)
