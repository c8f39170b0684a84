"""Ledger retention over a time-compressed ledger: old rows go, every total read through the usage
and dashboard readers stays the same, the newest id is never reused, and the file stops growing."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from gateway.settings import TelemetrySettings
from telemetry import dashboard as dash
from telemetry import totals
from telemetry.config import TelemetryConfig
from telemetry.dashboard import DashboardQuery
from telemetry.ledger import COLUMNS, FILENAME, ROLLUP_VERSION, Ledger, LedgerRow
from telemetry.retention import DAY, HOUR, Retention, read_horizons
from telemetry.timefmt import iso_time
from telemetry.usage import UsageQuery, read_usage, run_query
from tests.unit.telemetry.conftest import TelemetryFactory
from tests.unit.telemetry.test_dashboard import DAY0, ledger_row

NOW = DAY0 + 20 * DAY + 13.5 * HOUR
RETAIN = Retention(rows_s=3 * DAY, hours_s=8 * DAY)
ROWS_FROM = math.floor((NOW - 3 * DAY) / HOUR) * HOUR
HOURS_FROM = math.floor((NOW - 8 * DAY) / DAY) * DAY


def history(n: int, lo: float, hi: float, seed: int = 11) -> list[LedgerRow]:
    """Requests of two tenants over every lane, with errors, judging, escalations and hits."""
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        lane = rnd.choice(["upstream", "cache", "edge"])
        escalated = lane == "upstream" and rnd.random() < 0.2
        rows.append(ledger_row(
            i, 0.0, ts=rnd.uniform(lo, hi), request_id=f"q{i}", tenant=rnd.choice(["acme", "globex"]), app=rnd.choice(["web", "batch"]),
            lane=lane, model=rnd.choice(["gpt-4o", "gpt-4o-mini"]), operation="judge" if rnd.random() < 0.05 else "chat",
            status=rnd.choice([200] * 12 + [429, 502]), input_tokens=rnd.randint(1, 4000), output_tokens=rnd.randint(0, 900),
            cached_input_tokens=rnd.randint(0, 50), cost=rnd.uniform(0, 0.02) if lane == "upstream" else 0.0,
            saved_cache=rnd.uniform(0, 0.01) if lane == "cache" else 0.0, saved_edge=rnd.uniform(0, 0.01) if lane == "edge" else 0.0,
            saved_trim=rnd.uniform(0, 0.001), latency_ms=rnd.lognormvariate(5, 1), ttft_ms=rnd.choice([None, rnd.lognormvariate(3, 1)]),
            cache_status="hit" if lane == "cache" else rnd.choice(["miss", "off"]),
            cache_similarity=rnd.uniform(0.8, 1.0) if lane == "cache" else None,
            confidence=rnd.random() if lane == "edge" or escalated else None, escalated=escalated,
            escalation_reason=rnd.choice(["low_confidence", "loop"]) if escalated else None,
            route_reason=rnd.choice(["router", "forced", "pinned"]), session=rnd.choice([None, "s1", "s2"]), tier=rnd.choice([None, "cost"]),
        ))  # fmt: skip
    return rows


def seed(path: Path, rows: list[LedgerRow], clock: list[float], retention: Retention = RETAIN) -> Ledger:
    ledger = Ledger(path / FILENAME, commit_window_s=0.01, retention=retention, wall=lambda: clock[0])
    ledger.start()
    for row in rows:
        ledger.append(row)
    assert ledger.flush()
    return ledger


def same(a: Any, b: Any, where: str = "") -> None:
    """Equal, floats to 1e-9 (sums taken in another order)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-9), where
    else:
        assert a == b, where


USAGE = [
    {"from": str(DAY0 - DAY), "to": str(NOW + HOUR)},
    {"from": str(DAY0 - DAY), "to": str(NOW + HOUR), "group_by": "tenant,app,model,lane"},
    {"from": str(DAY0), "to": str(NOW), "group_by": "day,tenant"},
    {"from": str(HOURS_FROM + 5 * HOUR), "to": str(ROWS_FROM - 7 * HOUR), "group_by": "lane", "tenant": "acme"},
    {"from": str(HOURS_FROM - 3 * DAY), "to": str(NOW), "group_by": "model", "lane": "edge"},
]
DASHBOARD = [
    {"from": str(DAY0 - DAY), "to": str(NOW), "tz": "UTC", "bucket": "day"},
    {"from": str(HOURS_FROM), "to": str(NOW), "tz": "+02:00", "bucket": "day", "tenant": "globex"},  # local days: 22:00 UTC
    {"from": str(HOURS_FROM + 2 * HOUR), "to": str(HOURS_FROM + 2 * DAY + 9 * HOUR), "tz": "UTC", "bucket": "hour"},
]
# What pruning takes from the dashboard: request listings and exact figures read from rows
LISTINGS = ("errors", "retention", "query_ms", "warning")


def figures(ledger: Ledger) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, params in enumerate(USAGE):
        out[f"usage{i}"] = run_query(ledger, UsageQuery.parse(params, now=NOW))
    for i, params in enumerate(DASHBOARD):
        body = dash.read_report(ledger, DashboardQuery.parse(params, now=NOW), budgets=None, now=NOW)
        body["quality"] = {k: v for k, v in body["quality"].items() if k not in ("tiers", "priorities", "sessions")}
        out[f"dashboard{i}"] = {k: v for k, v in body.items() if k not in LISTINGS}
    return out


def test_pruning_drops_old_rows_and_keeps_every_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dash, "EXACT_PERCENTILES_MAX_ROWS", 0)  # the histograms' percentiles, which outlive the rows
    rows = history(6000, DAY0, NOW)
    clock = [NOW]
    ledger = seed(tmp_path, rows, clock)
    try:
        before = figures(ledger)
        assert ledger.prune()
        after = figures(ledger)
        same(before, after)

        kept = {r[0] for r in ledger.read("SELECT request_id FROM requests")}
        assert kept == {r.request_id for r in rows if r.ts >= ROWS_FROM} | {rows[-1].request_id}  # the newest row stays
        with ledger.snapshot() as conn:
            assert conn is not None
            h = read_horizons(conn)
            assert (h.rows_from, h.hours_from) == (ROWS_FROM, HOURS_FROM)
            assert conn.execute("SELECT COUNT(*) FROM rollup_lane WHERE level = 900 AND start < ?", (ROWS_FROM,)).fetchone()[0] == 0
            for table in ("rollup_lane", "rollup", "rollup_hist"):
                assert conn.execute(f"SELECT COUNT(*) FROM {table} WHERE level = 3600 AND start < ?", (HOURS_FROM,)).fetchone()[0] == 0
            # the rows the rollups do not hold yet would be added to theirs: with none, the same figures
            ranges = [(DAY0 + 0.5 * HOUR, NOW), (HOURS_FROM, ROWS_FROM + 3.3 * HOUR)]
            for keys in ((), ("lane",), ("tenant", "app", "model")):
                same(totals.totals(conn, ranges, keys, rollups=True), totals.totals(conn, ranges, keys, rollups=False))
    finally:
        ledger.close()


def test_a_range_ending_past_retention_is_read_to_the_hour_and_says_so(tmp_path: Path) -> None:
    rows = history(3000, DAY0, NOW, seed=5)
    clock = [NOW]
    ledger = seed(tmp_path, rows, clock)
    try:
        ragged = {"from": str(ROWS_FROM - 30 * HOUR - 1234.5), "to": str(NOW - 100.0), "group_by": "tenant"}
        snapped = {**ragged, "from": str(ROWS_FROM - 31 * HOUR)}
        want = run_query(ledger, UsageQuery.parse(snapped, now=NOW))
        assert ledger.prune()
        got, warning = read_usage(ledger, UsageQuery.parse(ragged, now=NOW))
        same(got, want)
        assert warning is not None and "retention" in warning
        assert read_usage(ledger, UsageQuery.parse({"from": str(ROWS_FROM + 1.0), "to": str(NOW)}, now=NOW))[1] is None

        body = dash.read_report(ledger, DashboardQuery.parse({"from": str(DAY0), "to": str(NOW)}, now=NOW), budgets=None, now=NOW)
        assert body["retention"]["complete"] is False and "retention" in body["warning"]
        assert body["errors"] and min(e["time"] for e in body["errors"]) >= iso_time(ROWS_FROM)
        assert body["headline"]["percentiles"] == "histogram"
        recent = dash.read_report(ledger, DashboardQuery.parse({"from": str(ROWS_FROM), "to": str(NOW)}, now=NOW), budgets=None, now=NOW)
        assert recent["retention"]["complete"] is True and "warning" not in recent
    finally:
        ledger.close()


def test_the_newest_row_stays_so_no_id_comes_back_and_nothing_is_rebuilt(tmp_path: Path) -> None:
    rows = history(500, DAY0, DAY0 + 2 * DAY)
    clock = [NOW]  # every row is past retention
    ledger = seed(tmp_path, rows, clock)
    query = UsageQuery.parse({"from": str(DAY0 - DAY), "to": str(NOW + DAY), "group_by": "tenant,lane"}, now=NOW)
    try:
        want = run_query(ledger, query)
        assert ledger.prune()
        [(left, last)] = [(r[0], r[1]) for r in ledger.read("SELECT COUNT(*), MAX(id) FROM requests")]
        assert (left, last) == (1, 500)
    finally:
        ledger.close()
    ledger = seed(tmp_path, [dataclasses.replace(rows[0], request_id="new", ts=NOW - 60.0)], clock)
    try:
        [new_id] = [r[0] for r in ledger.read("SELECT id FROM requests WHERE request_id = 'new'")]
        assert new_id == 501
        with ledger.snapshot() as conn:
            assert conn is not None and totals.rollups_current(conn)
        got = {(r["tenant"], r["lane"]): r["requests"] for r in run_query(ledger, query)}
        expected = {(r["tenant"], r["lane"]): r["requests"] for r in want}
        key = (rows[0].tenant, rows[0].lane)
        expected[key] = expected.get(key, 0) + 1
        assert got == expected
    finally:
        ledger.close()


def test_rows_the_rollups_lack_are_added_past_retention(tmp_path: Path) -> None:
    rows = history(800, DAY0, NOW, seed=3)
    clock = [NOW]
    seed(tmp_path, rows, clock).close()
    ledger = seed(tmp_path, [], clock)
    assert ledger.prune()
    ledger.close()
    query = UsageQuery.parse({"from": str(DAY0 - DAY), "to": str(NOW), "group_by": "lane"}, now=NOW)
    want = run_query(Ledger(tmp_path / FILENAME), query)
    # a row an older gateway wrote without rolling it up, in the pruned span
    late = dataclasses.replace(rows[0], request_id="late", ts=DAY0 + 3 * HOUR, lane="edge", status=200, operation="chat")
    conn = sqlite3.connect(tmp_path / FILENAME)
    conn.execute(f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                 [getattr(late, c) for c in COLUMNS])  # fmt: skip
    conn.commit()
    conn.close()
    reader = Ledger(tmp_path / FILENAME)
    with reader.snapshot() as snap:
        assert snap is not None and not totals.rollups_current(snap)
    lagging = {r["lane"]: r["requests"] for r in run_query(reader, query)}
    assert lagging == {**{r["lane"]: r["requests"] for r in want}, "edge": next(r["requests"] for r in want if r["lane"] == "edge") + 1}
    ledger = seed(tmp_path, [], clock)  # catches the row up
    try:
        assert ledger.flush()
        assert {r["lane"]: r["requests"] for r in run_query(ledger, query)} == lagging
    finally:
        ledger.close()


def test_a_pruned_file_is_never_rebuilt_from_its_rows(tmp_path: Path) -> None:
    clock = [NOW]
    ledger = seed(tmp_path, history(300, DAY0, NOW), clock)
    assert ledger.prune()
    ledger.close()
    conn = sqlite3.connect(tmp_path / FILENAME)
    conn.execute("UPDATE ledger_meta SET value = ? WHERE key = 'rollup_version'", (ROLLUP_VERSION - 1,))
    conn.commit()
    conn.close()
    with pytest.raises(RuntimeError, match="cannot be rebuilt"):
        seed(tmp_path, [], clock)


def test_the_file_stops_growing(tmp_path: Path) -> None:
    """A day of rows a cycle, a day kept: after a few cycles each one reuses the pages the one before freed."""
    clock = [DAY0 + 0.5 * HOUR]
    ledger = seed(tmp_path, [], clock, Retention(rows_s=DAY, hours_s=2 * DAY))
    sizes = []
    try:
        for cycle in range(10):
            clock[0] += DAY
            for row in history(3000, clock[0] - DAY, clock[0], seed=cycle):
                ledger.append(row)
            assert ledger.prune()
            [(pages, size)] = [(r[0], r[1]) for r in ledger.read("SELECT * FROM pragma_page_count(), pragma_page_size()")]
            sizes.append(pages * size)
    finally:
        ledger.close()
    # a cycle's rows alone took sizes[0]; past the plateau a cycle adds only its day buckets (kept for ever)
    growth = [b - a for a, b in zip(sizes[3:], sizes[4:])]
    assert max(growth) <= sizes[0] / 10, sizes
    assert sizes[-1] <= 3 * sizes[0], sizes


def test_the_settings_reach_the_ledger() -> None:
    config = TelemetryConfig.from_settings(type("S", (), {"state_dir": "/tmp/x", "edge": None, "telemetry": TelemetrySettings()})())
    assert config.ledger_retention == Retention(rows_s=168 * 3600.0, hours_s=400 * 86400.0)
    with pytest.raises(ValueError, match="ledger_hourly_retention_days"):
        TelemetrySettings(ledger_retention_hours=72, ledger_hourly_retention_days=2)
    assert TelemetrySettings(ledger_retention_hours=None).ledger_hourly_retention_days == 400


async def test_budgets_restore_this_months_spend_past_retention(make_telemetry: TelemetryFactory, clock: Any) -> None:
    now = clock.wall()
    month = math.floor(now / DAY) * DAY - (int(iso_time(now)[8:10]) - 1) * DAY
    rows = history(400, month, now - 60.0, seed=9)
    retention = Retention(rows_s=2 * HOUR, hours_s=DAY)
    h = await make_telemetry(ledger_retention=retention)
    for row in rows:
        h.telemetry.ledger.append(row)
    assert h.telemetry.ledger.flush()
    want = h.telemetry._month_spend()
    assert await asyncio.to_thread(h.telemetry.ledger.prune)
    got = h.telemetry._month_spend()
    assert sorted((r.tenant, r.app, r.day) for r in got) == sorted((r.tenant, r.app, r.day) for r in want)
    assert sum(r.cost for r in got) == pytest.approx(sum(r.cost for r in rows), abs=1e-9)
    assert sum(r.cost for r in got) == pytest.approx(sum(r.cost for r in want), abs=1e-9)


def test_a_ledger_younger_than_its_retention_reads_to_the_second(tmp_path: Path) -> None:
    clock = [NOW]
    ledger = seed(tmp_path, history(200, NOW - DAY, NOW), clock)
    try:
        assert ledger.prune()
        rows, warning = read_usage(ledger, UsageQuery.parse({"from": str(DAY0 + 123.4), "to": str(NOW)}, now=NOW))
        assert warning is None and rows[0]["requests"] + rows[0]["judge_requests"] == 200
        with ledger.snapshot() as conn:
            assert conn is not None and read_horizons(conn).rows_from == 0
    finally:
        ledger.close()


def test_the_writer_prunes_on_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from telemetry import ledger as ledger_module

    monkeypatch.setattr(ledger_module, "PRUNE_INTERVAL_S", 0.05)
    rows = history(3000, DAY0, NOW, seed=21)
    clock = [NOW]
    ledger = seed(tmp_path, rows, clock)
    try:
        want = {r.request_id for r in rows if r.ts >= ROWS_FROM} | {"x"}
        deadline = time.monotonic() + 60
        while True:
            ledger.append(dataclasses.replace(rows[0], request_id="x", ts=NOW))  # appends go on meanwhile
            assert ledger.flush()
            if {r[0] for r in ledger.read("SELECT request_id FROM requests")} == want:
                break
            assert time.monotonic() < deadline, "the writer never pruned"
            time.sleep(0.05)
    finally:
        ledger.close()
