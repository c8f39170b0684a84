"""Totals over the ledger's rollups and rows: what the dashboard, GET /v1/usage and the budgets read.

Every span of time a figure covers is split into the largest whole UTC-aligned rollup buckets
that fit inside it (telemetry/ledger.py) and the ragged ends, which are totalled from the raw
rows (the `ts` index). When the rollups do not hold every row (a ledger being caught up), the
rows are totalled instead.

Past the retention (telemetry/retention.py) there are no rows to total: a range's ends there are
read to their UTC hour (or day, past the hour buckets) and the span from the rollups alone, plus
any row they do not include yet (id past `rollup_through`). So totals never change when rows are
pruned, and adjacent ranges still add up to the range that holds them.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterable, Mapping
from typing import Any

from telemetry.ledger import HIST_LEVELS, REAL_MEASURES, ROLLUP_MEASURES, ROLLUP_TABLES, hist_source_sql
from telemetry.retention import Horizons, read_horizons

Span = tuple[int, float, float]  # (level: bucket seconds, RAW for raw rows, UNROLLED; lo; hi)
RAW = 0
UNROLLED = -1  # raw rows the rollups do not include yet (id > rollup_through), beside rollup buckets


def cover(lo: float, hi: float, levels: tuple[int, ...] = (86400, 3600, 900)) -> list[Span]:
    """[lo, hi) as the largest whole UTC-aligned buckets inside it plus raw ends; levels longest first."""
    if hi <= lo:
        return []
    for i, level in enumerate(levels):
        first, last = math.ceil(lo / level) * level, math.floor(hi / level) * level
        if first < last:
            rest = levels[i + 1 :]
            return [*cover(lo, first, rest), (level, float(first), float(last)), *cover(last, hi, rest)]
    return [(RAW, lo, hi)]


def _spans_cte(labelled: Iterable[tuple[int, Span]]) -> str:
    # NOTE: numbers the code computed, written as literals: no parameter limit, nothing from a client.
    values = ", ".join(f"({label}, {level}, {lo!r}, {hi!r})" for label, (level, lo, hi) in labelled)
    return f"spans(label, level, lo, hi) AS (VALUES {values})"


def _labelled(
    ranges: list[tuple[float, float]], levels: tuple[int, ...], *, rollups: bool, horizons: Horizons
) -> list[tuple[int, Span]]:
    out: list[tuple[int, Span]] = []
    for label, (lo, hi) in enumerate(ranges):
        lo, hi = horizons.snap(lo), horizons.snap(hi)
        if hi <= lo:
            continue
        if rollups:
            spans = cover(lo, hi, levels)
        else:
            # NOTE: past rows_from the ends are whole buckets (snapped), so cover() asks for no raw rows there
            cut = min(max(lo, horizons.rows_from), hi)
            spans = [*cover(lo, cut, levels), *([(UNROLLED, lo, cut)] if cut > lo else []), *([(RAW, cut, hi)] if hi > cut else [])]
        out.extend((label, span) for span in spans)
    return out


def rollup_table(keys: Iterable[str]) -> tuple[str, tuple[int, ...]]:
    """The narrowest rollup table with every key in `keys` (and tenant), and its bucket lengths."""
    wanted = {*keys, "tenant"}
    for name, (table_keys, levels) in ROLLUP_TABLES.items():
        if wanted <= set(table_keys):
            return name, levels
    raise ValueError(f"no rollup has the keys {sorted(wanted)}")


def _raw_rows(alias: str = "requests") -> str:
    """Which raw rows a span of level RAW or UNROLLED counts (over `spans s`)."""
    return f"s.level <= 0 AND {alias}.ts >= s.lo AND {alias}.ts < s.hi AND (s.level = {RAW} OR {alias}.id > :through)"


def totals(
    conn: sqlite3.Connection,
    ranges: list[tuple[float, float]],
    keys: tuple[str, ...] = (),
    *,
    measures: tuple[str, ...] = tuple(ROLLUP_MEASURES),
    tenant: str | None = None,
    filters: Mapping[str, str] | None = None,
    rollups: bool = True,
) -> list[dict[str, Any]]:
    """`measures` (of ROLLUP_MEASURES) summed per range (its index is `label`) and `keys`, over
    rollup buckets and raw ends (raw rows alone where the rows are kept and `rollups` is false);
    `filters`: key -> value, each a rollup key."""
    wanted = {**(filters or {}), **({"tenant": tenant} if tenant is not None else {})}
    table, levels = rollup_table((*keys, *wanted))
    horizons = read_horizons(conn)
    labelled = _labelled(ranges, levels, rollups=rollups, horizons=horizons)
    if not labelled:
        return []
    key_list = "".join(f", {k}" for k in keys)
    rolled = ", ".join(f"SUM(r.{m}) AS {m}" for m in measures)
    raw = ", ".join(f"SUM({ROLLUP_MEASURES[m]}) AS {m}" for m in measures)
    outer = ", ".join(f"SUM({m}) AS {m}" for m in measures)
    # NOTE: `+` keeps the raw rows on the ts index, never the tenant one
    r_where = "".join(f" AND r.{k} = :f_{k}" for k in wanted)
    q_where = "".join(f" AND +requests.{k} = :f_{k}" for k in wanted)
    sql = f"""
    WITH {_spans_cte(labelled)}
    SELECT label{key_list}, {outer} FROM (
        SELECT s.label AS label{"".join(f", r.{k} AS {k}" for k in keys)}, {rolled}
        FROM spans s CROSS JOIN {table} r
        WHERE s.level > 0 AND r.level = s.level AND r.start >= s.lo AND r.start < s.hi{r_where}
        GROUP BY s.label{"".join(f", r.{k}" for k in keys)}
        UNION ALL
        SELECT s.label AS label{"".join(f", requests.{k} AS {k}" for k in keys)}, {raw}
        FROM spans s CROSS JOIN requests
        WHERE {_raw_rows()}{q_where}
        GROUP BY s.label{"".join(f", requests.{k}" for k in keys)}
    ) GROUP BY label{key_list} ORDER BY label{key_list}
    """
    params: dict[str, Any] = {"through": horizons.through, **{f"f_{k}": v for k, v in wanted.items()}}
    out = []
    for row in conn.execute(sql, params).fetchall():
        item: dict[str, Any] = {"label": row["label"], **{k: row[k] for k in keys}}
        for m in measures:
            value = row[m] or 0
            item[m] = float(value) if m in REAL_MEASURES else int(value)
        out.append(item)
    return out


def histograms(conn: sqlite3.Connection, lo: float, hi: float, *, tenant: str | None = None, rollups: bool = True) -> dict[str, dict[int, int]]:
    """kind -> bin -> count over [lo, hi) (see ROLLUP_HISTOGRAMS and REASON_KINDS in the ledger)."""
    horizons = read_horizons(conn)
    labelled = _labelled([(lo, hi)], HIST_LEVELS, rollups=rollups, horizons=horizons)
    if not labelled:
        return {}
    h_tenant, q_tenant = (" AND h.tenant = :tenant", " AND +requests.tenant = :tenant") if tenant is not None else ("", "")
    raw = hist_source_sql(f"{_raw_rows()}{q_tenant}", join="spans s CROSS JOIN ")
    sql = f"""
    WITH {_spans_cte(labelled)}, raw AS ({raw})
    SELECT kind, bin, SUM(n) AS n FROM (
        SELECT h.kind AS kind, h.bin AS bin, SUM(h.n) AS n FROM spans s CROSS JOIN rollup_hist h
        WHERE s.level > 0 AND h.level = s.level AND h.start >= s.lo AND h.start < s.hi{h_tenant}
        GROUP BY h.kind, h.bin
        UNION ALL
        SELECT kind, bin, COUNT(*) AS n FROM raw GROUP BY kind, bin
    ) GROUP BY kind, bin
    """
    out: dict[str, dict[int, int]] = {}
    params: dict[str, Any] = {"through": horizons.through, **({"tenant": tenant} if tenant is not None else {})}
    for row in conn.execute(sql, params):
        out.setdefault(row["kind"], {})[int(row["bin"])] = int(row["n"])
    return out


def rollups_current(conn: sqlite3.Connection) -> bool:
    """Whether the rollups hold every ledger row (their watermark is the last row id)."""
    try:
        through = conn.execute("SELECT value FROM ledger_meta WHERE key = 'rollup_through'").fetchone()
    except sqlite3.OperationalError:  # a ledger file from before the rollups, not opened by a writer since
        return False
    last = conn.execute("SELECT COALESCE(MAX(id), 0) FROM requests").fetchone()[0]
    return through is not None and int(through[0]) == int(last)
