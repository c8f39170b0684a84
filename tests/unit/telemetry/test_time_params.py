"""Time parameters: NaN, infinities, out-of-range values and garbage are a 400 naming the parameter, never a 500."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gateway.auth import KeyTable, hash_key
from gateway.keys import SETTINGS
from gateway.middleware import build_middleware
from gateway.routes import shadow as shadow_route
from gateway.settings import AuthSettings, Settings
from policies.errors import InvalidInput as InvalidRequest
from telemetry.timefmt import iso_time, parse_time
from tests.unit.telemetry.conftest import TelemetryFactory
from tests.unit.telemetry.test_usage_report import ADMIN, bearer, gateway_app

LAST_SECOND = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC).timestamp()  # the latest a report can print

BAD = [
    "nan",
    "NaN",
    "inf",
    "-inf",
    "Infinity",
    "1e300",
    "-1e300",
    "-1",  # before 1970
    "1e12",  # past 9999
    "1969-12-31",
    "0001-01-01T00:00:00+05:00",  # before year 1 in UTC
    "9999-12-31T23:59:59-05:00",  # past year 9999 in UTC
    "yesterday",
    "",
]


@pytest.mark.parametrize("raw", BAD)
@pytest.mark.parametrize("end_of_day", [False, True])
def test_bad_times_raise_invalid_request_naming_the_parameter(raw: str, end_of_day: bool) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_time(raw, "to", end_of_day=end_of_day)
    assert err.value.param == "to"


def test_good_times_at_the_edges_of_the_range() -> None:
    assert parse_time("0", "from") == 0.0
    assert parse_time("1970-01-01", "from") == 0.0
    assert parse_time("2030-01-02", "to", end_of_day=True) == dt.datetime(2030, 1, 3, tzinfo=dt.UTC).timestamp()
    assert parse_time("2030-01-02T03:04:05+01:00", "to") == dt.datetime(2030, 1, 2, 2, 4, 5, tzinfo=dt.UTC).timestamp()
    # The whole last day: its end is the last second a report can print.
    end = parse_time("9999-12-31", "to", end_of_day=True)
    assert end == LAST_SECOND and iso_time(end) == "9999-12-31T23:59:59Z"
    assert iso_time(parse_time(str(LAST_SECOND), "to")) == "9999-12-31T23:59:59Z"


@pytest.mark.parametrize(
    ("query", "param"),
    [("to=nan", "to"), ("from=-inf", "from"), ("to=1e300", "to"), ("from=nan", "from"), ("to=-1e300", "to")],
)
async def test_usage_endpoint_answers_400_for_non_finite_times(
    make_telemetry: TelemetryFactory, aiohttp_client: Any, query: str, param: str
) -> None:
    client = await aiohttp_client(gateway_app(await make_telemetry()))
    resp = await client.get(f"/v1/usage?{query}", headers=bearer(ADMIN))
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


async def test_usage_endpoint_takes_the_last_day_of_the_range(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    client = await aiohttp_client(gateway_app(await make_telemetry()))
    resp = await client.get("/v1/usage?to=9999-12-31", headers=bearer(ADMIN))
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["to"] == "9999-12-31T23:59:59Z"


def shadow_app(tmp_path: Path) -> web.Application:
    auth = AuthSettings(mode="keys", keys=[{"sha256": hash_key(ADMIN), "tenant": "ops", "admin": True}])
    app = web.Application(middlewares=[build_middleware(KeyTable(auth))])
    app[SETTINGS] = Settings(state_dir=tmp_path)
    shadow_route.add_routes(app)
    return app


@pytest.mark.parametrize("since", ["1e300", "nan", "-inf", "-5"])
async def test_shadow_endpoint_answers_400_for_out_of_range_since(aiohttp_client: Any, tmp_path: Path, since: str) -> None:
    client = await aiohttp_client(shadow_app(tmp_path))
    resp = await client.get("/v1/shadow", params={"since": since}, headers=bearer(ADMIN))
    assert resp.status == 400, await resp.text()
    assert (await resp.json())["error"]["param"] == "since"
