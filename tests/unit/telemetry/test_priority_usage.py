"""The priority class on the ledger: usage by class from the rows kept, the dashboard's per-class table."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest

from telemetry.ledger import FILENAME, Ledger, LedgerRow
from telemetry.priorities import by_priority
from telemetry.retention import DAY
from telemetry.usage import UsageQuery, read_usage
from tests.unit.telemetry.test_dashboard import DAY0, OLD_SCHEMA
from tests.unit.telemetry.test_ledger_retention import NOW, ROWS_FROM, history, seed

CLASSES = ("interactive", "standard", "batch")


def classed(n: int, lo: float, hi: float) -> list[LedgerRow]:
    return [dataclasses.replace(row, priority=CLASSES[i % 3]) for i, row in enumerate(history(n, lo, hi))]


def test_usage_by_priority_counts_the_rows_kept_and_says_so_past_retention(tmp_path: Path) -> None:
    clock = [NOW]
    ledger = seed(tmp_path, classed(900, DAY0, NOW), clock)
    try:
        whole = UsageQuery.parse({"from": str(DAY0), "to": str(NOW), "group_by": "priority"}, now=NOW)
        rows, warning = read_usage(ledger, whole)
        assert warning is None and {r["priority"] for r in rows} == set(CLASSES)
        assert ledger.prune()
        rows, warning = read_usage(ledger, whole)
        assert warning is not None and "priority" in warning
        kept = ledger.read("SELECT priority, COUNT(*) FROM requests WHERE operation != 'judge' AND ts >= ? GROUP BY priority",
                           (ROWS_FROM,))  # pruning keeps the newest row, whatever its time: not counted
        assert {r["priority"]: r["requests"] for r in rows} == {p: n for p, n in kept}
        recent = UsageQuery.parse({"from": str(ROWS_FROM + DAY), "to": str(NOW), "priority": "batch"}, now=NOW)
        rows, warning = read_usage(ledger, recent)
        assert warning is None and rows[0]["requests"] > 0
        by_lane = UsageQuery.parse({"from": str(DAY0), "to": str(NOW), "group_by": "lane"}, now=NOW)
        assert "priority" not in (read_usage(ledger, by_lane)[1] or "")  # the rollups answer what they keep
    finally:
        ledger.close()


def test_the_dashboard_table_has_a_row_per_class_most_urgent_first(tmp_path: Path) -> None:
    clock = [NOW]
    rows = classed(300, NOW - DAY, NOW)
    ledger: Ledger = seed(tmp_path, rows, clock)
    try:
        with ledger.snapshot() as conn:
            assert conn is not None
            table = by_priority(conn, NOW - DAY, NOW)
            one = by_priority(conn, NOW - DAY, NOW, tenant="acme")
    finally:
        ledger.close()
    assert [r["priority"] for r in table] == list(CLASSES)
    for row in table:
        mine = [r for r in rows if r.priority == row["priority"] and r.operation != "judge"]
        answered = sorted(r.latency_ms for r in mine if r.status < 400)
        assert row["requests"] == len(mine) and row["errors"] == sum(r.status >= 400 for r in mine)
        assert row["p95_latency_ms"] == round(answered[min(len(answered) - 1, int(0.95 * len(answered)))], 3)
        assert row["mean_latency_ms"] == pytest.approx(sum(answered) / len(answered), abs=1e-3)
    assert {r["priority"]: r["requests"] for r in one} == {
        p: sum(1 for r in rows if r.priority == p and r.operation != "judge" and r.tenant == "acme") for p in CLASSES}


def test_rows_of_an_older_ledger_file_read_as_interactive(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / FILENAME)
    conn.executescript(OLD_SCHEMA)
    conn.execute("INSERT INTO requests (request_id, ts, day, tenant, app, lane, model, requested_model, operation, stream, "
                 "input_tokens, output_tokens, cached_input_tokens, estimated, trimmed_tokens, cost, saved_cache, saved_edge, "
                 "saved_trim, status, complete, error_code, latency_ms, ttft_ms, cache_status, route_score) VALUES "
                 "('old', ?, '2026-03-10', 'acme', 'web', 'upstream', 'm', 'm', 'chat', 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 200, 1, "
                 "NULL, 5.0, NULL, 'off', NULL)", (NOW - DAY,))  # fmt: skip
    conn.commit()
    conn.close()
    ledger = seed(tmp_path, [dataclasses.replace(classed(1, NOW - DAY, NOW)[0], priority="batch")], [NOW])
    try:
        assert sorted(tuple(r) for r in ledger.read("SELECT request_id, priority FROM requests")) == [
            ("old", "interactive"), ("q0", "batch")]
    finally:
        ledger.close()
