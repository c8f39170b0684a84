"""Hostile admin queries and exports: every time parameter lands in a representable range (a 400, never a
500), the error states the true bounds, and client-chosen names never become spreadsheet formulas."""

from __future__ import annotations

import csv
import io
import itertools
from typing import Any

import pytest

from telemetry import dashboard as dash
from telemetry.csv_safe import neutralise
from telemetry.dashboard import DashboardQuery
from telemetry.usage import MEASURES, UsageQuery
from telemetry.usage import to_csv as usage_to_csv
from tests.unit.telemetry.conftest import TelemetryFactory
from tests.unit.telemetry.test_dashboard import ADMIN, app_for, bearer, ledger_row, seeded

ZONES = ["UTC", "+14:00", "-12:00", "+05:45", "America/New_York"]
TIMES = ["9999-12-31", "9999-12-31T23:59:59", "9999-12-30", "1970-01-01", "1970-01-01T00:00:00", "0", "253402300799",
         "0001-01-01", "1969-12-31T23:00:00-05:00"]


@pytest.mark.parametrize(("zone", "frm", "to", "bucket"), [
    (z, f, t, b) for z, (f, t), b in itertools.product(ZONES, itertools.combinations(TIMES, 2), ("hour", "month", "auto"))
])
def test_far_future_and_far_past_ranges_parse_or_are_a_400(zone: str, frm: str, to: str, bucket: str) -> None:
    for lo, hi in ((frm, to), (to, frm)):
        try:
            query = DashboardQuery.parse({"from": lo, "to": hi, "tz": zone, "bucket": bucket})
        except dash.InvalidInput as err:
            assert err.param in ("from", "to", "bucket"), err.message
            continue
        buckets = query.buckets()
        assert buckets and buckets[0][1] == query.start and buckets[-1][2] == query.end
        assert all(lo_ < hi_ for _, lo_, hi_ in buckets)


def test_the_last_day_of_the_calendar_is_a_valid_to_in_any_zone() -> None:
    for zone in ZONES:
        query = DashboardQuery.parse({"from": "9999-12-30", "to": "9999-12-31", "tz": zone, "bucket": "day"})
        assert [label for label, _, _ in query.buckets()][-1] == "9999-12-31"


def test_the_error_text_states_the_true_bounds() -> None:
    with pytest.raises(dash.InvalidInput) as err:
        DashboardQuery.parse({"from": "1969-12-31"})
    assert "1970-01-01T00:00:00Z and 9999-12-31T23:59:59Z" in err.value.message


async def test_the_reported_overflow_is_a_200(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    client = await aiohttp_client(app_for(await seeded(make_telemetry)))
    for params in ({"to": "9999-12-31T23:59:59", "tz": "+14:00"}, {"to": "9999-12-31"}, {"to": "9999-12-31", "tz": "+14:00"},
                   {"from": "9999-12-31", "to": "9999-12-31", "tz": "-12:00", "bucket": "hour"}):
        for fmt in ("json", "csv"):
            resp = await client.get("/v1/dashboard", params={**params, "format": fmt}, headers=bearer(ADMIN))
            assert resp.status == 200, (params, await resp.text())


@pytest.mark.parametrize("cell", ["=HYPERLINK(\"http://x\",\"y\")", "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)", "\tx", "\rx"])
def test_formula_cells_are_neutralised(cell: str) -> None:
    assert neutralise(cell) == "'" + cell


@pytest.mark.parametrize("cell", ["-0.25", "+3e-5", "12", "gpt-4o", "acme|web|=x", ""])
def test_numbers_and_plain_names_are_left_alone(cell: str) -> None:
    assert neutralise(cell) == cell


async def test_model_names_in_exports_are_never_formulas(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    evil = ["+cmd|' /C calc'!A0", "=HYPERLINK(\"http://evil\",\"x\")"]
    rows = [ledger_row(i, 1.0 + i, model=name, tenant=name, cost=0.01) for i, name in enumerate(evil)]
    client = await aiohttp_client(app_for(await seeded(make_telemetry, rows)))
    window = {"from": "2026-03-10", "to": "2026-03-13"}
    dashboard_csv = await (await client.get("/v1/dashboard", params={**window, "format": "csv"}, headers=bearer(ADMIN))).text()
    query = UsageQuery(start=0.0, end=1e10, group_by=("tenant", "model"))
    usage_csv = usage_to_csv(query, [{"tenant": name, "model": name, **dict.fromkeys(MEASURES, -0.5)} for name in evil])
    for text in (dashboard_csv, usage_csv):
        cells = [c for row in csv.reader(io.StringIO(text)) for c in row]
        assert any("cmd|" in c for c in cells), text  # the names are there ...
        assert not [c for c in cells if c[:1] in ("=", "+", "@") or (c[:1] == "-" and not _number(c))]  # ... never as formulas


def _number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True
