"""GET /v1/dashboard and /dashboard over a seeded ledger: figures against sums computed by hand from the rows."""

from __future__ import annotations

import dataclasses
import datetime as dt
import sqlite3
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pytest
from aiohttp import web

from gateway.auth import KeyTable, hash_key
from gateway.middleware import build_middleware
from gateway.routes import dashboard as dashboard_route
from gateway.services import Services
from gateway.settings import AuthSettings, Settings
from policies.errors import InvalidInput
from telemetry import dashboard as dash
from telemetry import totals
from telemetry.dashboard import DashboardQuery
from telemetry.ledger import FILENAME, Ledger, LedgerRow
from tests.unit.telemetry.conftest import Harness, TelemetryFactory

ADMIN, USER, ACME_ADMIN = "tl-admin-key", "tl-user-key", "tl-acme-admin"
DAY0 = dt.datetime(2026, 3, 10, tzinfo=dt.UTC).timestamp()  # a Tuesday, 00:00 UTC
H = 3600.0


def ledger_row(i: int, hours: float, **fields: Any) -> LedgerRow:
    base = LedgerRow(
        request_id=f"r{i}", ts=DAY0 + hours * H, tenant="acme", app="web", lane="upstream", model="gpt-4o",
        requested_model="gpt-4o", operation="chat", stream=False, input_tokens=100, output_tokens=10,
        cached_input_tokens=0, estimated=False, trimmed_tokens=0, cost=0.01, saved_cache=0.0, saved_edge=0.0,
        saved_trim=0.0, status=200, complete=True, error_code=None, latency_ms=100.0, ttft_ms=None,
        cache_status="miss", route_score=0.3, route_reason="router",
    )  # fmt: skip
    return dataclasses.replace(base, **fields)


# Spread over four days; 18:00 and 19:00 UTC fall on different days in Asia/Kolkata (+05:30).
ROWS: list[LedgerRow] = [
    ledger_row(0, 1.0, cost=0.02, trimmed_tokens=40, saved_trim=0.004, latency_ms=120.0, ttft_ms=30.0, stream=True,
               session="agent-1"),
    ledger_row(1, 5.5, lane="cache", cost=0.0, saved_cache=0.015, cache_status="hit", cache_similarity=0.97, latency_ms=4.0),
    ledger_row(2, 18.0, lane="edge", model="smollm2", cost=0.0001, saved_edge=0.012, confidence=0.91, edge_tokens=60, latency_ms=250.0),
    ledger_row(3, 19.0, lane="upstream", confidence=0.31, escalated=True, escalation_reason="low_confidence", edge_tokens=40,
               route_reason="router", cost=0.03, latency_ms=900.0, ttft_ms=200.0, stream=True, session="agent-1"),  # fmt: skip
    ledger_row(4, 26.0, tenant="globex", app="batch", model="gpt-4o-mini", cost=0.005, latency_ms=80.0),
    ledger_row(5, 30.25, status=429, cost=0.0, error_code="rate_limit_exceeded", latency_ms=1.0, trace_id="ab" * 16),
    ledger_row(6, 42.0, status=502, cost=0.0, error_code="upstream_error", latency_ms=3000.0, request_id="r6"),
    ledger_row(7, 47.5, lane="cache", cost=0.0, saved_cache=0.02, cache_status="hit", cache_similarity=0.88, latency_ms=5.0),
    ledger_row(8, 50.0, lane="edge", model="smollm2", cost=0.0002, saved_edge=0.01, confidence=0.82, edge_tokens=70, latency_ms=300.0),
    ledger_row(9, 66.0, tenant="globex", app="batch", model="gpt-4o-mini", lane="upstream", confidence=0.12, escalated=True,
               escalation_reason="loop", cost=0.004, latency_ms=700.0, route_reason="forced"),  # fmt: skip
    ledger_row(10, 80.0, cost=0.011, latency_ms=150.0),
]


def seed(path: Path, rows: list[LedgerRow]) -> Ledger:
    ledger = Ledger(path / FILENAME, commit_window_s=0.01)
    ledger.start()
    for row in rows:
        ledger.append(row)
    assert ledger.flush()
    return ledger


def raw_sums(rows: list[LedgerRow], lo: float, hi: float, tenant: str | None = None) -> dict[str, Any]:
    """The headline, by hand from the rows."""
    picked = [r for r in rows if lo <= r.ts < hi and (tenant is None or r.tenant == tenant)]
    ok = [r for r in picked if r.status < 400]
    lookups = [r for r in picked if r.cache_status in ("hit", "miss")]
    return {
        "requests": len(picked),
        "errors": sum(r.status >= 400 for r in picked),
        "rejected": sum(r.status == 429 for r in picked),
        "input_tokens": sum(r.input_tokens for r in picked),
        "output_tokens": sum(r.output_tokens for r in picked),
        "trimmed_tokens": sum(r.trimmed_tokens for r in picked),
        "cost_usd": sum(r.cost for r in picked),
        "saved_cache_usd": sum(r.saved_cache for r in picked),
        "saved_edge_usd": sum(r.saved_edge for r in picked),
        "saved_trim_usd": sum(r.saved_trim for r in picked),
        "local": sum(r.lane in ("cache", "edge") and r.status < 400 for r in picked),
        "hits": sum(r.cache_status == "hit" for r in picked),
        "lookups": len(lookups),
        "latencies": [r.latency_ms for r in ok],
        "ttfts": [r.ttft_ms for r in ok if r.ttft_ms is not None],
    }


def app_for(h: Harness, state_dir: Path | None = None) -> web.Application:
    auth = AuthSettings(
        mode="keys",
        keys=[
            {"sha256": hash_key(ADMIN), "tenant": "ops", "admin": True},
            {"sha256": hash_key(USER), "tenant": "acme", "app": "web"},
            {"sha256": hash_key(ACME_ADMIN), "tenant": "acme", "admin": True, "admin_scope": "tenant"},
        ],
    )
    app = web.Application(middlewares=[build_middleware(KeyTable(auth))])
    services = Services(settings=Settings(), policy=None, pool=None, telemetry=h.telemetry)  # type: ignore[arg-type]
    dashboard_route.add_routes(app, services)
    return app


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def seeded(make_telemetry: TelemetryFactory, rows: list[LedgerRow] = ROWS, **config: Any) -> Harness:
    h = await make_telemetry(**config)
    for row in rows:
        h.telemetry.ledger.append(row)
    assert h.telemetry.ledger.flush()
    return h


async def test_headline_and_breakdown_equal_the_hand_computed_sums(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    h = await seeded(make_telemetry)
    client = await aiohttp_client(app_for(h))
    resp = await client.get("/v1/dashboard", params={"from": "2026-03-10", "to": "2026-03-13", "tz": "UTC"}, headers=bearer(ADMIN))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    lo, hi = DAY0, DAY0 + 4 * 86400
    want = raw_sums(ROWS, lo, hi)
    head = body["headline"]
    assert (body["from"], body["to"], body["tz"], body["bucket"]) == ("2026-03-10T00:00:00Z", "2026-03-14T00:00:00Z", "UTC", "day")
    for name in ("requests", "errors", "rejected", "input_tokens", "output_tokens", "trimmed_tokens"):
        assert head[name] == want[name], name
    for name in ("cost_usd", "saved_cache_usd", "saved_edge_usd", "saved_trim_usd"):
        assert head[name] == pytest.approx(want[name], abs=1e-9), name
    saved = want["saved_cache_usd"] + want["saved_edge_usd"] + want["saved_trim_usd"]
    assert head["saved_usd"] == pytest.approx(saved, abs=1e-9)
    assert head["saved_share"] == pytest.approx(saved / (saved + want["cost_usd"]), abs=1e-6)
    assert head["local_share"] == pytest.approx(want["local"] / want["requests"], abs=1e-6)
    assert head["cache_hit_rate"] == pytest.approx(want["hits"] / want["lookups"], abs=1e-6)
    assert head["error_rate"] == pytest.approx(want["errors"] / want["requests"], abs=1e-6)
    assert head["percentiles"] == "exact"
    for q in (50, 95, 99):
        assert head["latency_ms"][f"p{q}"] == pytest.approx(float(np.percentile(want["latencies"], q)), abs=1e-3)
        assert head["ttft_ms"][f"p{q}"] == pytest.approx(float(np.percentile(want["ttfts"], q)), abs=1e-3)
    # by tenant, app and model
    rows = {(r["tenant"], r["app"], r["model"]): r for r in body["breakdown"]}
    assert set(rows) == {(r.tenant, r.app, r.model) for r in ROWS}
    for key, got in rows.items():
        mine = [r for r in ROWS if (r.tenant, r.app, r.model) == key]
        assert got["requests"] == len(mine)
        assert got["cost_usd"] == pytest.approx(sum(r.cost for r in mine), abs=1e-9)
        assert got["saved_usd"] == pytest.approx(sum(r.saved_cache + r.saved_edge + r.saved_trim for r in mine), abs=1e-9)
        assert got["rejected"] == sum(r.status == 429 for r in mine)
        assert got["input_tokens"] == sum(r.input_tokens for r in mine)
    # the series: UTC days, stacked by lane
    series = body["series"]
    assert series["labels"] == ["2026-03-10", "2026-03-11", "2026-03-12", "2026-03-13"]
    for lane, values in series["lanes"].items():
        for i, label in enumerate(series["labels"]):
            day_lo = DAY0 + i * 86400
            mine = [r for r in ROWS if r.lane == lane and day_lo <= r.ts < day_lo + 86400]
            assert values["requests"][i] == len(mine), (lane, label)
            assert values["cost_usd"][i] == pytest.approx(sum(r.cost for r in mine), abs=1e-9)


async def test_quality_errors_and_histograms(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    h = await seeded(make_telemetry)
    client = await aiohttp_client(app_for(h))
    resp = await client.get("/v1/dashboard", params={"from": "2026-03-10", "to": "2026-03-13"}, headers=bearer(ADMIN))
    body = await resp.json()
    quality = body["quality"]
    edge = quality["edge"]
    assert edge["requests"] == sum(r.lane == "edge" for r in ROWS)
    assert edge["escalated"] == sum(r.escalated for r in ROWS)
    assert edge["escalation_rate"] == pytest.approx(edge["escalated"] / (edge["requests"] + edge["escalated"]), abs=1e-6)
    assert edge["edge_tokens"] == sum(r.edge_tokens for r in ROWS)
    confidences = [r.confidence for r in ROWS if r.confidence is not None]
    assert edge["mean_confidence"] == pytest.approx(sum(confidences) / len(confidences), abs=1e-6)
    assert edge["reasons"] == [{"reason": "loop", "count": 1}, {"reason": "low_confidence", "count": 1}]
    assert quality["routes"] == [{"reason": "router", "count": 10}, {"reason": "forced", "count": 1}]
    served, escalated = quality["confidence_histogram"]["served"], quality["confidence_histogram"]["escalated"]
    assert served[int(0.91 * 20)] == 1 and served[int(0.82 * 20)] == 1 and sum(served) == 2
    assert escalated[int(0.31 * 20)] == 1 and escalated[int(0.12 * 20)] == 1 and sum(escalated) == 2
    similarity = quality["cache_similarity_histogram"]
    assert similarity[19] == 1 and similarity[17] == 1 and sum(similarity) == 2
    sessions = quality["sessions"]
    assert [(x["session"], x["tenant"], x["requests"], x["input_tokens"]) for x in sessions] == [("agent-1", "acme", 2, 200)]
    assert sessions[0]["cost_usd"] == pytest.approx(0.05) and sessions[0]["first"].startswith("2026-03-10T01:00")
    errors = body["errors"]
    assert [e["request_id"] for e in errors] == ["r6", "r5"]  # newest first
    assert errors[1]["trace_id"] == "ab" * 16 and errors[1]["status"] == 429
    assert errors[0]["error_code"] == "upstream_error"


@pytest.mark.parametrize("tz", ["Asia/Kolkata", "Asia/Kathmandu", "America/New_York", "Australia/Lord_Howe", "-03:30"])
async def test_single_days_add_up_to_the_multi_day_total_in_any_zone(
    make_telemetry: TelemetryFactory, aiohttp_client: Any, tz: str
) -> None:
    h = await seeded(make_telemetry)
    client = await aiohttp_client(app_for(h))

    async def get(params: dict[str, str]) -> dict[str, Any]:
        resp = await client.get("/v1/dashboard", params={**params, "tz": tz}, headers=bearer(ADMIN))
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())

    total = await get({"from": "2026-03-09", "to": "2026-03-14"})
    days = [await get({"from": day, "to": day}) for day in ("2026-03-09", "2026-03-10", "2026-03-11", "2026-03-12", "2026-03-13", "2026-03-14")]
    assert sum(d["headline"]["requests"] for d in days) == total["headline"]["requests"]
    assert sum(d["headline"]["cost_usd"] for d in days) == pytest.approx(total["headline"]["cost_usd"], abs=1e-9)
    # each local day by hand: [local midnight, next local midnight)
    zone = dash.zone_of(tz)
    for d in days:
        day = dt.date.fromisoformat(d["from_local"][:10])
        lo = dt.datetime.combine(day, dt.time(), zone).timestamp()
        hi = dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), zone).timestamp()
        assert d["headline"]["requests"] == raw_sums(ROWS, lo, hi)["requests"], d["from_local"]
    # the multi-day series shows the same local days
    per_day = [sum(v["requests"][i] for v in total["series"]["lanes"].values()) for i in range(len(total["series"]["labels"]))]
    assert per_day == [d["headline"]["requests"] for d in days]


def test_rollups_and_raw_rows_give_the_same_figures(tmp_path: Path) -> None:
    """A ragged range in a half-hour zone: rollup buckets and raw ends, against raw rows only."""
    import random

    rnd = random.Random(7)
    rows = [
        ledger_row(i, rnd.uniform(0, 24 * 9), tenant=rnd.choice(["acme", "globex"]), lane=rnd.choice(["upstream", "cache", "edge"]),
                   cost=rnd.uniform(0, 0.01), status=rnd.choice([200] * 9 + [429]), latency_ms=rnd.lognormvariate(5, 1))  # fmt: skip
        for i in range(3000)
    ]
    ledger = seed(tmp_path, rows)
    try:
        query = DashboardQuery.parse({"from": str(DAY0 + 12345.6), "to": str(DAY0 + 8 * 86400 + 777.7), "tz": "Asia/Kolkata", "bucket": "hour"})
        with ledger.snapshot() as conn:
            assert conn is not None and totals.rollups_current(conn)
            ranges = [(lo, hi) for _, lo, hi in query.buckets()]
            for keys in ((), ("lane",), ("tenant", "app", "model")):
                fast = totals.totals(conn, ranges, keys, rollups=True)
                slow = totals.totals(conn, ranges, keys, rollups=False)
                assert [{k: v for k, v in r.items() if not isinstance(v, float)} for r in fast] == [
                    {k: v for k, v in r.items() if not isinstance(v, float)} for r in slow
                ]
                for a, b in zip(fast, slow):
                    assert a["cost"] == pytest.approx(b["cost"], abs=1e-9)
            assert totals.histograms(conn, query.start, query.end) == totals.histograms(conn, query.start, query.end, rollups=False)
        want = raw_sums(rows, query.start, query.end)
        report = dash.read_report(ledger, query, budgets=None, now=query.end)
        assert report["rollups"] is True
        assert report["headline"]["requests"] == want["requests"]
        assert report["headline"]["cost_usd"] == pytest.approx(want["cost_usd"], abs=1e-9)
    finally:
        ledger.close()


def test_histogram_percentiles_are_within_one_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    rnd = random.Random(3)
    rows = [ledger_row(i, rnd.uniform(0, 48), latency_ms=rnd.lognormvariate(5, 1.2), ttft_ms=rnd.lognormvariate(3, 1)) for i in range(4000)]
    ledger = seed(tmp_path, rows)
    try:
        monkeypatch.setattr(dash, "EXACT_PERCENTILES_MAX_ROWS", 0)
        query = DashboardQuery.parse({"from": "2026-03-10", "to": "2026-03-11"})
        head = dash.read_report(ledger, query, budgets=None, now=query.end)["headline"]
        assert head["percentiles"] == "histogram"
        width = 2 ** (1 / 16)
        for q in (50, 95, 99):
            exact = float(np.percentile([r.latency_ms for r in rows], q))
            assert exact / width <= head["latency_ms"][f"p{q}"] <= exact * width
            exact_ttft = float(np.percentile([r.ttft_ms for r in rows if r.ttft_ms is not None], q))
            assert exact_ttft / width <= head["ttft_ms"][f"p{q}"] <= exact_ttft * width
    finally:
        ledger.close()


OLD_SCHEMA = """
CREATE TABLE requests (
    id INTEGER PRIMARY KEY, request_id TEXT NOT NULL, ts REAL NOT NULL, day TEXT NOT NULL, tenant TEXT NOT NULL,
    app TEXT NOT NULL, lane TEXT NOT NULL, model TEXT NOT NULL, requested_model TEXT NOT NULL, operation TEXT NOT NULL,
    stream INTEGER NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
    cached_input_tokens INTEGER NOT NULL, estimated INTEGER NOT NULL, trimmed_tokens INTEGER NOT NULL, cost REAL NOT NULL,
    saved_cache REAL NOT NULL, saved_edge REAL NOT NULL, saved_trim REAL NOT NULL, status INTEGER NOT NULL,
    complete INTEGER NOT NULL, error_code TEXT, latency_ms REAL NOT NULL, ttft_ms REAL, cache_status TEXT NOT NULL,
    route_score REAL
);
"""


def test_an_old_ledger_file_is_migrated_and_its_rollups_caught_up(tmp_path: Path) -> None:
    path = tmp_path / FILENAME
    conn = sqlite3.connect(path)
    conn.executescript(OLD_SCHEMA)
    old = ROWS[:6]
    for r in old:
        conn.execute(
            "INSERT INTO requests (request_id, ts, day, tenant, app, lane, model, requested_model, operation, stream, input_tokens,"
            " output_tokens, cached_input_tokens, estimated, trimmed_tokens, cost, saved_cache, saved_edge, saved_trim, status,"
            " complete, error_code, latency_ms, ttft_ms, cache_status, route_score) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (r.request_id, r.ts, r.day, r.tenant, r.app, r.lane, r.model, r.requested_model, r.operation, r.stream, r.input_tokens,
             r.output_tokens, r.cached_input_tokens, r.estimated, r.trimmed_tokens, r.cost, r.saved_cache, r.saved_edge, r.saved_trim,
             r.status, r.complete, r.error_code, r.latency_ms, r.ttft_ms, r.cache_status, r.route_score),
        )  # fmt: skip
    conn.commit()
    conn.close()
    ledger = seed(tmp_path, ROWS[6:])  # opens the old file: columns added, old rows rolled up
    try:
        columns = {r[1]: r for r in ledger.read("PRAGMA table_info(requests)")}
        for name in ("route_reason", "confidence", "escalated", "edge_tokens", "escalation_reason", "cache_similarity", "trace_id",
                     "cache_score"):
            assert name in columns
        [old_row] = ledger.read("SELECT escalated, edge_tokens, confidence FROM requests WHERE request_id = 'r2'")
        assert (old_row[0], old_row[1], old_row[2]) == (0, 0, None)  # the defaults fill the old rows
        import time

        deadline = time.monotonic() + 60
        while True:  # the writer catches up when idle
            with ledger.snapshot() as snap:
                assert snap is not None
                if totals.rollups_current(snap):
                    break
            assert time.monotonic() < deadline, "the rollups never caught up"
            time.sleep(0.05)
        query = DashboardQuery.parse({"from": "2026-03-09", "to": "2026-03-14"})
        report = dash.read_report(ledger, query, budgets=None, now=query.end)
        assert report["rollups"] is True
        assert report["headline"]["requests"] == len(ROWS)
        assert report["headline"]["cost_usd"] == pytest.approx(sum(r.cost for r in ROWS), abs=1e-9)
    finally:
        ledger.close()


async def test_admin_only_and_tenant_admins_see_their_tenant(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    h = await seeded(make_telemetry)
    client = await aiohttp_client(app_for(h))
    params = {"from": "2026-03-10", "to": "2026-03-13"}
    for path in ("/dashboard", "/v1/dashboard"):
        resp = await client.get(path, params=params, headers=bearer(USER))
        assert resp.status == 403, path
        assert (await resp.json())["error"]["type"] == "permission_error"
    # without a key: the page (it holds no figures and asks for a key), never the figures
    assert (await client.get("/dashboard", params=params)).status == 200
    assert (await client.get("/v1/dashboard", params=params)).status == 401
    resp = await client.get("/v1/dashboard", params={**params, "tenant": "globex"}, headers=bearer(ACME_ADMIN))
    assert resp.status == 403
    resp = await client.get("/v1/dashboard", params=params, headers=bearer(ACME_ADMIN))
    body = await resp.json()
    assert body["tenant"] == "acme" and body["scope"] == "tenant" and body["edge_engine"] is None
    want = raw_sums(ROWS, DAY0, DAY0 + 4 * 86400, tenant="acme")
    assert body["headline"]["requests"] == want["requests"]
    assert {r["tenant"] for r in body["breakdown"]} == {"acme"}
    resp = await client.get("/v1/dashboard", params={**params, "tenant": "globex"}, headers=bearer(ADMIN))
    assert (await resp.json())["headline"]["requests"] == raw_sums(ROWS, DAY0, DAY0 + 4 * 86400, tenant="globex")["requests"]


async def test_the_page_is_self_contained(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    h = await seeded(make_telemetry)
    client = await aiohttp_client(app_for(h))
    resp = await client.get("/dashboard", headers=bearer(ADMIN))
    assert resp.status == 200 and resp.content_type == "text/html"
    html = await resp.text()
    assert "/*SCRIPT*/" not in html and "/*STYLE*/" not in html and "/v1/dashboard" in html
    for external in ("http://", "https://", "//cdn", "<script src", "<link "):
        assert external not in html.replace("http://www.w3.org/2000/svg", ""), external
    assert "default-src 'none'" in resp.headers["Content-Security-Policy"]


async def test_csv_has_every_figure_shown(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    h = await seeded(make_telemetry)
    client = await aiohttp_client(app_for(h))
    params = {"from": "2026-03-10", "to": "2026-03-13", "tz": "Asia/Kolkata"}
    body = await (await client.get("/v1/dashboard", params=params, headers=bearer(ADMIN))).json()
    resp = await client.get("/v1/dashboard", params={**params, "format": "csv"}, headers=bearer(ADMIN))
    assert resp.status == 200 and resp.content_type == "text/csv"
    assert "attachment" in resp.headers["Content-Disposition"]
    lines = (await resp.text()).splitlines()
    assert lines[0] == "section,group,metric,value"
    assert f"headline,,requests,{body['headline']['requests']}" in lines
    assert "query,,tz,Asia/Kolkata" in lines
    assert any(line.startswith("breakdown,globex|batch|gpt-4o-mini,requests,") for line in lines)
    assert any(line.startswith("errors,r6,status,502") for line in lines)
    assert "sessions,agent-1,requests,2" in lines
    assert sum(1 for line in lines if line.startswith("series,")) == 3 * len(body["series"]["labels"]) * len(body["series"]["lanes"])


async def test_budgets_show_spend_against_limits(make_telemetry: TelemetryFactory, aiohttp_client: Any, clock: Any) -> None:
    now = clock.wall()
    rows = [ledger_row(i, (now - DAY0) / H - 0.5 - i * 0.01, cost=0.25) for i in range(3)]
    rows.append(ledger_row(9, (now - DAY0) / H - 0.4, status=429, cost=0.0))
    policy = {"budgets": {"enabled": True, "tenant": {"daily_spend_usd": 10.0, "monthly_spend_usd": 100.0}}}
    h = await seeded(make_telemetry, rows, policy=policy)
    client = await aiohttp_client(app_for(h))
    body = await (await client.get("/v1/dashboard", headers=bearer(ADMIN))).json()
    [tenant] = [b for b in body["budgets"] if b["scope"] == "tenant"]
    assert tenant["tenant"] == "acme" and tenant["daily_spend_usd"] == 10.0 and tenant["monthly_spend_usd"] == 100.0
    today = dt.datetime.fromtimestamp(now, dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
    assert tenant["spent_today_usd"] == pytest.approx(sum(r.cost for r in rows if r.ts >= today), abs=1e-9)
    assert tenant["rejected"] == 1


def test_query_parameters() -> None:
    q = DashboardQuery.parse({"from": "2026-11-01", "to": "2026-11-01", "tz": "America/New_York", "bucket": "hour"})
    assert q.end - q.start == 25 * 3600  # the day the clocks go back has 25 hours
    assert len(q.buckets()) == 25 and len({label for label, _, _ in q.buckets()}) == 25
    q = DashboardQuery.parse({"from": "2026-03-10", "to": "2026-03-10", "tz": "Asia/Kolkata", "bucket": "hour"})
    assert q.start == dt.datetime(2026, 3, 10, tzinfo=ZoneInfo("Asia/Kolkata")).timestamp()
    assert [lo % 3600 for _, lo, _ in q.buckets()] == [1800.0] * 24  # local hours start at :30 UTC
    q = DashboardQuery.parse({"from": "2026-03-10T06:00", "to": "2026-03-10T08:00Z", "tz": "+02:00"})
    assert (q.start, q.end) == (DAY0 + 4 * H, DAY0 + 8 * H)
    assert DashboardQuery.parse({"from": "2026-01-01", "to": "2026-06-30"}).bucket == "month"
    for bad, param in (({"tz": "Mars/Olympus"}, "tz"), ({"from": "2026-03-10", "to": "2026-03-09"}, "from"),
                       ({"bucket": "week"}, "bucket"), ({"from": "yesterday"}, "from"),
                       ({"from": "2020-01-01", "to": "2026-01-01", "bucket": "hour"}, "bucket")):  # fmt: skip
        with pytest.raises(InvalidInput) as err:
            DashboardQuery.parse(bad)
        assert err.value.param == param


def test_cover_splits_into_aligned_buckets_and_raw_ends() -> None:
    lo, hi = DAY0 - 1800.5, DAY0 + 2 * 86400 + 3600 + 900 + 10
    spans = totals.cover(lo, hi)
    assert spans[0] == (0, lo, DAY0 - 1800) and spans[1] == (900, DAY0 - 1800, DAY0)
    assert (86400, DAY0, DAY0 + 2 * 86400) in spans and spans[-1] == (0, DAY0 + 2 * 86400 + 4500, hi)
    assert sum(b - a for _, a, b in spans) == pytest.approx(hi - lo)


async def test_metering_fills_the_dashboard_columns(make_telemetry: TelemetryFactory) -> None:
    from gateway.context import Outcome, Usage
    from policies.domain import EdgeCheck
    from tests.unit.telemetry.conftest import make_ctx

    h = await make_telemetry()
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    escalated = make_ctx(request_id="esc", edge_check=EdgeCheck(confidence=0.42, threshold=0.6, passed=False, escalated=True, reason="low_confidence",
                                                                edge_output_tokens=30, edge_input_tokens=12))  # fmt: skip
    escalated.headers = {"traceparent": f"00-{trace}-00f067aa0ba902b7-01"}
    served = make_ctx(request_id="edge", lane="edge", edge_check=EdgeCheck(confidence=0.93, threshold=0.6, passed=True))
    hit = make_ctx(request_id="hit", lane="cache", cache_status="hit", cache_similarity=0.97)
    hit.attributes["tierlane.cache.score"] = 0.991  # the verifier's probability the hit was served at
    for ctx in (escalated, served, hit):
        ctx.usage = Usage(input_tokens=10, output_tokens=5)
        await h.telemetry.meter(ctx, Outcome(status=200, response=None, complete=True))
    assert h.telemetry.ledger.flush()
    rows = {r["request_id"]: r for r in h.telemetry.ledger.read("SELECT * FROM requests")}
    esc = rows["esc"]
    assert (esc["route_reason"], esc["confidence"], esc["escalated"], esc["edge_tokens"], esc["escalation_reason"]) == (
        "router", 0.42, 1, 42, "low_confidence")
    assert esc["trace_id"] == trace
    assert (rows["edge"]["escalated"], rows["edge"]["confidence"], rows["edge"]["escalation_reason"]) == (0, 0.93, None)
    assert rows["hit"]["cache_similarity"] == 0.97 and rows["hit"]["confidence"] is None and rows["hit"]["edge_tokens"] == 0
    assert rows["hit"]["cache_score"] == 0.991 and rows["edge"]["cache_score"] is None


async def test_sessions_show_their_cached_share_a_broken_prefix_and_masking(
    make_telemetry: TelemetryFactory, aiohttp_client: Any
) -> None:
    # two agent sessions of five turns: one reads nearly all its input from the provider's cache
    # after its first turns, the other stops reading it (a prefix broken on the way)
    warm = [ledger_row(100 + t, 2.0 + t / 60, session="warm", input_tokens=1000, cached_input_tokens=0 if t < 1 else 950,
                       cost=0.05 - t * 0.001, mask_mode="shadow", masked_tokens=300 * t, saved_mask=0.0001 * t)
            for t in range(5)]
    broken = [ledger_row(200 + t, 3.0 + t / 60, session="broken", input_tokens=1000, cached_input_tokens=900 if t < 2 else 0,
                         cost=0.04) for t in range(5)]
    h = await seeded(make_telemetry, warm + broken)
    client = await aiohttp_client(app_for(h))
    resp = await client.get("/v1/dashboard", params={"from": "2026-03-10", "to": "2026-03-10"}, headers=bearer(ADMIN))
    sessions = {x["session"]: x for x in (await resp.json())["quality"]["sessions"]}
    assert sessions["warm"]["cached_share_late"] == pytest.approx(0.95) and not sessions["warm"]["prefix_broken"]
    assert sessions["warm"]["cached_share"] == pytest.approx(3800 / 5000)
    assert sessions["broken"]["cached_share_late"] == 0.0 and sessions["broken"]["prefix_broken"]
    assert sessions["broken"]["cold_turns"] == 3 and sessions["warm"]["cold_turns"] == 0
    assert sessions["warm"]["mask_mode"] == "shadow" and sessions["warm"]["masked_tokens"] == 3000
    assert sessions["warm"]["saved_mask_usd"] == pytest.approx(0.001)
    assert sessions["broken"]["mask_mode"] is None and sessions["broken"]["saved_mask_usd"] == 0.0
