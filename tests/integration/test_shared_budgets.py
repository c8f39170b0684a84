"""Budgets and rate limits shared by two gateway replicas through a real Valkey server
(`state.backend: redis`): a limit holds across both, and a store outage fails no request
(`on_outage: local_share`, the default, with room left; or `allow`) or answers 503 (`deny`);
what was admitted alone reaches the store once it is back.

The upstream is a fixed-answer stub (tests/support/faults.py, mode "ok" with a delay so requests
overlap), not llama.cpp: the properties are the gateway's and the store's own state (what is
admitted, counted and refused), and the real model would only be slow.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.keys import PIPELINE, SERVICES
from policies.policy import Policy
from policies.pricing import Pricing
from telemetry.core import reservation_usd
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app
from tests.support.valkey import ValkeyServer, through_an_outage

MODEL = "fake-model"
TEXT = "one two three four five six seven eight"
PRICE = {"input": 2000.0, "output": 8000.0}  # expensive: a few requests reach a small budget
MSG = [{"role": "user", "content": "Count: one, two,"}]


def _replicas(bg: BackgroundLoop, make_gateway: Any, tmp_path: Path, valkey: ValkeyServer, budgets: dict[str, Any],
              delay: float = 0.0, **state: Any) -> list[Any]:  # fmt: skip
    up = RunningApp(bg, fault_app("ok", Recorder(), delay=delay, text=TEXT))
    return [
        make_gateway(
            state_dir=str(tmp_path / f"replica{i}"),
            upstreams=[upstream_cfg("a", up.url + "/v1", models=[MODEL], retries=0)],
            telemetry={"metrics": True},
            state={"backend": "redis", "url": valkey.url, "op_timeout_ms": 1000, **state},
            policy={"budgets": {"enabled": True, **budgets}, "pricing": {"models": {MODEL: PRICE}}},
        )
        for i in range(2)
    ]


def _post(gw: Any, **extra: Any) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": MSG, **extra}, timeout=30)


def _store_requests(valkey: ValkeyServer) -> float:
    """Requests the store counted for tenant "default" in the last minute."""
    client = redis.Redis.from_url(valkey.url)
    try:
        return sum(float(v) for v in client.hvals("tierlane:{default}:t:req"))
    finally:
        client.close()


def _metric(gw: Any, name: str) -> float:
    body = httpx.get(gw.url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(name + " "))


def test_a_requests_per_minute_limit_holds_across_two_replicas(bg, valkey, make_gateway, tmp_path):
    replicas = _replicas(bg, make_gateway, tmp_path, valkey, {"tenant": {"requests_per_minute": 10}})
    statuses = [_post(replicas[i % 2]).status_code for i in range(30)]
    assert statuses.count(200) == 10 and statuses.count(429) == 20, statuses
    refused = _post(replicas[0])
    assert refused.status_code == 429 and 0 < int(refused.headers["Retry-After"]) <= 60


async def _fire(urls: list[str], n: int, stream: bool) -> list[int]:
    body = {"model": MODEL, "messages": MSG, "max_tokens": 6, "stream": stream}
    async with httpx.AsyncClient(timeout=60) as client:
        async def one(i: int) -> int:
            async with client.stream("POST", urls[i % len(urls)] + "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    pass
                return r.status_code

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def _ledger_spend(state_dir: Path) -> float:
    conn = sqlite3.connect(state_dir / "ledger.sqlite3")
    try:
        return float(conn.execute("SELECT COALESCE(SUM(cost), 0) FROM requests").fetchone()[0])
    finally:
        conn.close()


def _drain(bg: BackgroundLoop, gw: Any) -> None:
    async def flush() -> None:
        await gw.app[PIPELINE].drain()
        telemetry = gw.app[SERVICES].telemetry
        await telemetry.usage(telemetry.usage_query({}))  # commits what was appended

    bg.call(flush())


def test_forty_concurrent_streams_on_two_replicas_overspend_by_at_most_one_reservation(bg, valkey, make_gateway, tmp_path):
    limit = 2.0  # about fourteen reservations
    replicas = _replicas(bg, make_gateway, tmp_path, valkey, {"tenant": {"daily_spend_usd": limit}}, delay=0.3)
    statuses = asyncio.run(_fire([gw.url for gw in replicas], 40, stream=True))
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1 and set(statuses) <= {200, 429}, statuses
    for gw in replicas:
        _drain(bg, gw)
    spent = sum(_ledger_spend(tmp_path / f"replica{i}") for i in range(2))
    price = Pricing.from_policy(Policy.load(extra={"pricing": {"models": {MODEL: PRICE}}})).upstream(MODEL)
    reservation = reservation_usd(price, {"model": MODEL, "messages": MSG}, 6)
    print(f"admitted {statuses.count(200)}/40, spent ${spent:.4f} of ${limit} (one reservation ${reservation:.4f})")
    assert 0 < spent <= limit + reservation
    client = redis.Redis.from_url(valkey.url)
    try:  # every hold was settled, and the store's spend is what the ledgers say
        assert float(client.hget("tierlane:{default}:t:s", "held") or 0) == 0.0
        assert float(client.hget("tierlane:{default}:t:s", "d") or 0) == pytest.approx(spent, rel=1e-6)
    finally:
        client.close()


async def _traffic_through_an_outage(urls: list[str], valkey: ValkeyServer) -> list[int]:
    """Four callers send requests (every third a stream) while the store is killed, then started again."""
    statuses: list[int] = []

    async def send(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "messages": MSG, "stream": i % 3 == 0}
        async with client.stream("POST", urls[i % len(urls)] + "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                pass
            statuses.append(r.status_code)

    await through_an_outage(valkey, send, before_s=0.5, down_s=1.0)
    return statuses


@pytest.mark.parametrize("mode", ["local_share", "allow"])
def test_a_store_outage_mid_traffic_fails_no_request_with_room_left(bg, valkey, make_gateway, tmp_path, mode):
    budgets = {"tenant": {"requests_per_minute": 100_000, "daily_spend_usd": 1000.0}}
    replicas = _replicas(bg, make_gateway, tmp_path, valkey, budgets, op_timeout_ms=300, on_outage=mode, heartbeat_s=0.2)
    statuses = asyncio.run(_traffic_through_an_outage([gw.url for gw in replicas], valkey))
    fallbacks = sum(_metric(gw, "tierlane_budget_store_fallback_admissions_total") for gw in replicas)
    print(f"{len(statuses)} requests through the outage, {fallbacks:.0f} admitted without the store")
    assert statuses and set(statuses) == {200}, statuses
    assert fallbacks >= 1
    assert sum(_metric(gw, "tierlane_budget_store_errors_total") for gw in replicas) >= fallbacks
    for gw in replicas:  # what each admitted alone is counted in the store by its heartbeat
        shared = gw.app[SERVICES].telemetry.shared
        deadline = time.monotonic() + 15
        while shared.owed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shared.owed == 0
    before = _store_requests(valkey)
    assert before >= fallbacks  # the restarted store lost what came before; the outage's requests are back in it
    assert [_post(gw).status_code for gw in replicas] == [200, 200]
    assert _store_requests(valkey) == before + 2  # both replicas use the store again
    assert sum(_metric(gw, "tierlane_budget_store_fallback_admissions_total") for gw in replicas) == fallbacks


def test_a_store_outage_answers_503_with_deny(bg, valkey, make_gateway, tmp_path):
    replicas = _replicas(bg, make_gateway, tmp_path, valkey, {"tenant": {"requests_per_minute": 1000}},
                         on_outage="deny", op_timeout_ms=300)  # fmt: skip
    assert [_post(gw).status_code for gw in replicas] == [200, 200]
    valkey.kill()
    for gw in replicas:
        r = _post(gw)
        assert r.status_code == 503 and r.json()["error"]["code"] == "budget_store_unavailable"
        assert int(r.headers["Retry-After"]) >= 1
    valkey.start()
    assert [_post(gw).status_code for gw in replicas] == [200, 200]
