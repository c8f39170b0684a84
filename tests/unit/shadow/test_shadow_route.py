"""GET /v1/shadow through a real gateway: admin only, per-lane figures, `since`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from gateway.app import create_app
from gateway.auth import hash_key
from gateway.pipeline import shadow
from gateway.routes import shadow as shadow_route
from gateway.settings import Settings
from policies.policy import _deep_merge
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import PASS_THROUGH

ADMIN, USER = "sk-admin-0123456789", "sk-user-0123456789"


@pytest.fixture
def gateway(bg: BackgroundLoop, tmp_path: Path) -> RunningApp:
    keys = [{"sha256": hash_key(ADMIN), "tenant": "ops", "admin": True}, {"sha256": hash_key(USER), "tenant": "acme"}]
    data = _deep_merge(PASS_THROUGH, {"state_dir": str(tmp_path / "state"), "auth": {"mode": "keys", "keys": keys}})
    app = create_app(Settings.load(env={}, overrides=data))
    shadow_route.add_routes(app)
    running = RunningApp(bg, app)
    yield running
    running.stop()


def seed(state_dir: Path, rows: list[tuple[float, str, float]]) -> None:
    store = shadow.ShadowStore(state_dir / shadow.FILENAME)

    async def write() -> None:
        for ts, lane, sim in rows:
            await store.add(shadow.ShadowRow(ts=ts, request_id="r", tenant="t", app="a", lane=lane, model="m",
                                             similarity=sim, upstream_input_tokens=5, upstream_output_tokens=2))

    asyncio.run(write())


def get(url: str, key: str, **params: str) -> tuple[int, dict]:
    async def call() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/v1/shadow", params=params, headers={"Authorization": f"Bearer {key}"}) as r:
                return r.status, await r.json()

    return asyncio.run(call())


def test_report_per_lane_since_a_timestamp(gateway: RunningApp, tmp_path: Path) -> None:
    status, body = get(gateway.url, ADMIN)
    assert status == 200 and body["data"] == []  # nothing recorded yet: no file
    now = time.time()
    sims = [0.95, 0.9, 0.85, 0.7, 0.3]
    seed(tmp_path / "state", [(now - 10, "edge", s) for s in sims] + [(now - 10, "cache", 0.99), (now - 10_000, "cache", 0.1)])
    status, body = get(gateway.url, ADMIN)
    by_lane = {row["lane"]: row for row in body["data"]}
    assert by_lane["edge"]["count"] == 5
    assert by_lane["edge"]["mean"] == pytest.approx(sum(sims) / 5, abs=1e-4)
    assert by_lane["edge"]["share_above_0_8"] == pytest.approx(0.6)
    assert by_lane["edge"]["p10"] < by_lane["edge"]["mean"]
    assert by_lane["cache"]["count"] == 2
    _, recent = get(gateway.url, ADMIN, since=str(now - 100))
    assert {row["lane"]: row["count"] for row in recent["data"]} == {"edge": 5, "cache": 1}
    _, iso = get(gateway.url, ADMIN, since="2000-01-01T00:00:00Z")
    assert iso["since"].startswith("2000-01-01") and len(iso["data"]) == 2


def test_only_admins_and_valid_since(gateway: RunningApp) -> None:
    status, body = get(gateway.url, USER)
    assert status == 403 and "admin" in body["error"]["message"]
    status, body = get(gateway.url, ADMIN, since="yesterday-ish")
    assert status == 400 and body["error"]["param"] == "since"
