"""Requests per priority class over a range, from the ledger's raw rows (no rollup keeps the class).

The dashboard's per-class table: how many requests each class had, how many failed and how many
flow control refused (429 upstream_busy), and the latency and time to first token of those answered.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from policies.domain import PRIORITIES
from telemetry.ledger import REQUEST

BUSY = "upstream_busy"  # gateway.errors.UpstreamBusy's code: flow control's refusals
# A class's p95 latency is read exactly (a sort of its rows) up to this many answered requests; above, only the mean.
EXACT_MAX_ROWS = 5_000


def by_priority(conn: sqlite3.Connection, start: float, end: float, tenant: str | None = None) -> list[dict[str, Any]]:
    """One row per class with requests in [start, end), most urgent first."""
    where = f"ts >= ? AND ts < ? AND {REQUEST}"
    params: list[Any] = [start, end]
    if tenant is not None:
        where += " AND tenant = ?"
        params.append(tenant)
    sql = ("SELECT priority, COUNT(*) AS requests, SUM(status >= 400) AS errors, "
           f"SUM(COALESCE(error_code, '') = '{BUSY}') AS refused, SUM(status < 400) AS ok, "
           "SUM(CASE WHEN status < 400 THEN latency_ms ELSE 0.0 END) AS latency_sum, "
           "SUM(status < 400 AND ttft_ms IS NOT NULL) AS ttft_n, "
           "SUM(CASE WHEN status < 400 AND ttft_ms IS NOT NULL THEN ttft_ms ELSE 0.0 END) AS ttft_sum "
           f"FROM requests WHERE {where} GROUP BY priority")  # fmt: skip
    found = {r["priority"]: r for r in conn.execute(sql, params)}
    order = [p for p in PRIORITIES if p in found] + sorted(p for p in found if p not in PRIORITIES)
    rows = []
    for name in order:
        r = found[name]
        ok, ttft_n = int(r["ok"] or 0), int(r["ttft_n"] or 0)
        p95 = None
        if 0 < ok <= EXACT_MAX_ROWS:
            at = conn.execute(f"SELECT latency_ms FROM requests WHERE {where} AND priority = ? AND status < 400 "
                              "ORDER BY latency_ms LIMIT 1 OFFSET ?", [*params, name, min(ok - 1, int(0.95 * ok))]).fetchone()
            p95 = None if at is None else round(float(at[0]), 3)
        rows.append({
            "priority": name, "requests": int(r["requests"]), "errors": int(r["errors"] or 0),
            "refused": int(r["refused"] or 0),
            "mean_latency_ms": round(float(r["latency_sum"] or 0.0) / ok, 3) if ok else None,
            "p95_latency_ms": p95,
            "mean_ttft_ms": round(float(r["ttft_sum"] or 0.0) / ttft_n, 3) if ttft_n else None,
        })  # fmt: skip
    return rows
