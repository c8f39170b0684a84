"""Spend limits hold under concurrency: 40 parallel requests and 40 parallel streams pass a limit
by at most one request's reservation (against the real llama.cpp server as the upstream)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest

from policies.policy import Policy
from policies.pricing import Pricing
from telemetry.core import reservation_usd
from tests.support.config import PASS_THROUGH
from tests.support.llama_server import UPSTREAM_MODEL

pytestmark = pytest.mark.slow

LIMIT = 0.5  # USD per day for the tenant
# An expensive model, so a few requests reach the limit.
PRICE = {"input": 2000.0, "output": 8000.0}
MAX_TOKENS = 6
BODY = {"model": UPSTREAM_MODEL, "messages": [{"role": "user", "content": "Count: one, two,"}], "max_tokens": MAX_TOKENS, "temperature": 0}


def _gateway(make_gateway: Any, llama_upstream: Any) -> Any:
    policy = {
        **PASS_THROUGH["policy"],
        "budgets": {"enabled": True, "tenant": {"daily_spend_usd": LIMIT}},
        "pricing": {"models": {UPSTREAM_MODEL: PRICE}},
    }
    return make_gateway(
        upstreams=[{"name": "llama", "base_url": llama_upstream.base_url, "models": [UPSTREAM_MODEL], "read_timeout_s": 120}],
        policy=policy,
    )


def _reservation() -> float:
    pricing = Pricing.from_policy(Policy.load(extra={"pricing": {"models": {UPSTREAM_MODEL: PRICE}}}))
    return reservation_usd(pricing.upstream(UPSTREAM_MODEL), BODY, MAX_TOKENS)


def _ledger_spend(state_dir: Path) -> tuple[float, int]:
    conn = sqlite3.connect(state_dir / "ledger.sqlite3")
    try:
        cost, rows = conn.execute("SELECT COALESCE(SUM(cost), 0), COUNT(*) FROM requests WHERE tenant = 'default'").fetchone()
    finally:
        conn.close()
    return float(cost), int(rows)


async def _fire(url: str, stream: bool) -> list[int]:
    body = {**BODY, "stream": stream}
    async with httpx.AsyncClient(timeout=180) as client:
        async def one() -> int:
            if not stream:
                return (await client.post(url + "/v1/chat/completions", json=body)).status_code
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    pass
                return r.status_code

        return list(await asyncio.gather(*(one() for _ in range(40))))


@pytest.mark.parametrize("stream", [False, True], ids=["requests", "streams"])
def test_forty_concurrent_callers_overspend_by_at_most_one_reservation(make_gateway, llama_upstream, tmp_path, stream):
    gw = _gateway(make_gateway, llama_upstream)
    statuses = asyncio.run(_fire(gw.url, stream))
    admitted = statuses.count(200)
    assert admitted >= 1 and statuses.count(429) >= 1, statuses
    assert set(statuses) <= {200, 429}, statuses
    r = httpx.get(gw.url + "/v1/usage", params={"group_by": "tenant"}, timeout=30)  # flushes the ledger
    assert r.status_code == 200, r.text
    spent, rows = _ledger_spend(tmp_path / "state")
    assert rows == 40  # every request has its row, refused ones included
    reservation = _reservation()
    assert spent > 0
    print(f"{'streams' if stream else 'requests'}: admitted {admitted}/40, spent ${spent:.4f} of ${LIMIT} (one reservation ${reservation:.4f})")
    assert spent <= LIMIT + reservation, (spent, LIMIT, reservation, admitted)
