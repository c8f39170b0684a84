"""GET /v1/usage (admin only, JSON or CSV, validated parameters) and `tierlane usage` over a real ledger."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gateway.auth import KeyTable, hash_key
from gateway.cli import main
from gateway.context import Outcome, Usage
from gateway.middleware import build_middleware
from gateway.routes import usage as usage_route
from gateway.services import Services
from gateway.settings import AuthSettings, Settings
from tests.unit.telemetry.conftest import Clock, Harness, TelemetryFactory, make_ctx

ADMIN, USER = "tl-admin-key", "tl-user-key"

REQUESTS = [
    # tenant, app, lane, model, input, output, trimmed
    ("acme", "web", "upstream", "gpt-4o", 1000, 100, 50),
    ("acme", "web", "cache", "gpt-4o", 1000, 100, 0),
    ("acme", "batch", "edge", "auto", 400, 40, 0),
    ("globex", "web", "upstream", "gpt-4o-mini", 200, 20, 0),
]


async def meter_all(h: Harness) -> None:
    for i, (tenant, app, lane, model, inp, out, trimmed) in enumerate(REQUESTS):
        ctx = make_ctx(request_id=f"r{i}", tenant=tenant, app=app, lane=lane, model=model, trim_saved={"p": trimmed})
        ctx.usage = Usage(input_tokens=inp, output_tokens=out)
        await h.telemetry.meter(ctx, Outcome(status=200, response=None, complete=True))


def gateway_app(h: Harness) -> web.Application:
    auth = AuthSettings(
        mode="keys",
        keys=[
            {"sha256": hash_key(ADMIN), "tenant": "ops", "admin": True},
            {"sha256": hash_key(USER), "tenant": "acme", "app": "web"},
        ],
    )
    app = web.Application(middlewares=[build_middleware(KeyTable(auth))])
    services = Services(settings=Settings(), policy=None, pool=None, telemetry=h.telemetry)  # type: ignore[arg-type]
    usage_route.add_routes(app, services)
    return app


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_usage_grouped_json_matches_what_was_metered(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    h = await make_telemetry()
    await meter_all(h)
    client = await aiohttp_client(gateway_app(h))
    resp = await client.get("/v1/usage?group_by=tenant,lane", headers=bearer(ADMIN))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    rows = {(r["tenant"], r["lane"]): r for r in body["data"]}
    assert set(rows) == {("acme", "upstream"), ("acme", "cache"), ("acme", "edge"), ("globex", "upstream")}
    assert rows[("acme", "cache")]["cost_usd"] == 0.0
    assert rows[("acme", "cache")]["saved_cache_usd"] > 0
    assert rows[("acme", "edge")]["saved_edge_usd"] > 0
    assert rows[("acme", "upstream")]["saved_trim_usd"] > 0 and rows[("acme", "upstream")]["trimmed_tokens"] == 50
    assert body["total"]["requests"] == 4
    assert body["total"]["input_tokens"] == sum(r[4] for r in REQUESTS)
    assert body["total"]["output_tokens"] == sum(r[5] for r in REQUESTS)


async def test_usage_csv_and_filters(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    h = await make_telemetry()
    await meter_all(h)
    client = await aiohttp_client(gateway_app(h))
    resp = await client.get(
        "/v1/usage", params={"group_by": "app", "tenant": "acme"}, headers={**bearer(ADMIN), "Accept": "text/csv"}
    )
    assert resp.status == 200 and resp.content_type == "text/csv"
    rows = list(csv.DictReader(io.StringIO(await resp.text())))
    assert {r["app"]: int(r["requests"]) for r in rows} == {"web": 2, "batch": 1}


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("group_by=colour", "group_by"),
        ("from=yesterday", "from"),
        ("to=2020-13-01", "to"),
        ("from=2030-01-02&to=2030-01-01", "from"),
    ],
)
async def test_bad_parameters_name_the_parameter(
    make_telemetry: TelemetryFactory, aiohttp_client: Any, query: str, param: str
) -> None:
    client = await aiohttp_client(gateway_app(await make_telemetry()))
    resp = await client.get(f"/v1/usage?{query}", headers=bearer(ADMIN))
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


async def test_usage_needs_an_admin_key(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    client = await aiohttp_client(gateway_app(await make_telemetry()))
    resp = await client.get("/v1/usage", headers=bearer(USER))
    assert resp.status == 403
    assert (await resp.json())["error"]["type"] == "permission_error"
    assert (await client.get("/v1/usage")).status == 401


async def test_time_range_and_day_grouping(make_telemetry: TelemetryFactory, aiohttp_client: Any, clock: Clock) -> None:
    h = await make_telemetry()
    await meter_all(h)
    clock.advance(86400)
    await meter_all(h)
    client = await aiohttp_client(gateway_app(h))
    body = await (await client.get("/v1/usage?group_by=day", headers=bearer(ADMIN))).json()
    # The ledger is dated by the telemetry's wall clock, which the test moved a day ahead.
    assert [r["requests"] for r in body["data"]] == [4, 4]
    second_day = body["data"][1]["day"]
    body = await (await client.get(f"/v1/usage?from={second_day}&to={second_day}", headers=bearer(ADMIN))).json()
    assert body["total"]["requests"] == 4


async def test_cli_prints_the_same_totals(
    make_telemetry: TelemetryFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str], clock: Clock
) -> None:
    h = await make_telemetry()
    await meter_all(h)
    h.telemetry.ledger.flush()
    state = tmp_path / "state"
    start = str(int(clock.wall()) - 3600)
    assert main(["usage", "--state-dir", str(state), "--group-by", "lane", "--from", start, "--format", "csv"]) == 0
    rows = {r["lane"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert {lane: int(r["requests"]) for lane, r in rows.items()} == {"cache": 1, "edge": 1, "upstream": 2}
    assert main(["usage", "--state-dir", str(state), "--group-by", "tenant", "--from", start]) == 0
    table = capsys.readouterr().out
    assert "globex" in table and "total" in table
    assert main(["usage", "--state-dir", str(state), "--group-by", "colour"]) == 2
    assert "--group-by" in capsys.readouterr().err
