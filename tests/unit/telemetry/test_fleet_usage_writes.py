"""The fleet usage writer against a real Valkey server: every row reaches the totals exactly once,
through a store that stops answering for a while (writes that time out but ran later are not added
again) and through one that is killed and started again (rows metered meanwhile arrive after)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from telemetry import fleet_usage
from telemetry.fleet_usage import FleetUsage
from telemetry.ledger import LedgerRow
from telemetry.usage import UsageQuery
from tests.support.valkey import ValkeyServer


def _row(i: int, tenant: str = "acme", ts: float | None = None) -> LedgerRow:
    return LedgerRow(
        request_id=f"r{i}", ts=time.time() if ts is None else ts, tenant=tenant, app="web", lane="upstream", model="m",
        requested_model="m", operation="chat", stream=False, input_tokens=10, output_tokens=5, cached_input_tokens=0,
        estimated=False, trimmed_tokens=0, cost=0.25, saved_cache=0.0, saved_edge=0.0, saved_trim=0.0, status=200,
        complete=True, error_code=None, latency_ms=1.0, ttft_ms=None, cache_status="miss", route_score=None,
    )  # fmt: skip


async def _totals(usage: FleetUsage) -> dict[str, float]:
    rows = await usage.query(UsageQuery.parse({"group_by": "tenant"}))
    return {row["tenant"]: row["requests"] for row in rows}


async def _until(condition, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.05)


async def test_rows_of_two_hours_and_tenants_add_up(valkey: ValkeyServer) -> None:
    usage = FleetUsage.connect(valkey.url, key_prefix="t:", connect_timeout_s=1.0, op_timeout_s=1.0)
    try:
        now = time.time()
        for i in range(6):
            usage.record(_row(i, tenant="acme" if i % 3 else "globex", ts=now - 3600 * (i % 2)))
        await usage.flush()
        assert await _totals(usage) == {"acme": 4, "globex": 2}
        rows = await usage.query(UsageQuery.parse({"group_by": "tenant", "tenant": "acme"}))
        assert rows[0]["cost_usd"] == pytest.approx(1.0) and rows[0]["input_tokens"] == 40
        assert (usage.sent, usage.errors, usage.dropped) == (6, 0, 0)
    finally:
        await usage.close()


async def test_a_write_that_timed_out_but_ran_later_is_not_added_twice(valkey: ValkeyServer) -> None:
    admin = aioredis.Redis.from_url(valkey.url)
    usage = FleetUsage.connect(valkey.url, key_prefix="t:", connect_timeout_s=1.0, op_timeout_s=0.1)
    try:
        usage.record(_row(0))
        await usage.flush()  # connected, scripts loaded
        await admin.execute_command("CLIENT", "PAUSE", "1500", "WRITE")  # longer than a write may take: it times out, runs later
        for i in range(1, 6):
            usage.record(_row(i))
        await _until(lambda: _errors(usage))  # the batch timed out and is sent again
        await _until(lambda: _idle(usage))
        assert usage.errors >= 1 and usage.dropped == 0
        assert await _totals(usage) == {"acme": 6}  # the late first attempt and a retry: added once
    finally:
        await usage.close()
        await admin.aclose()


async def _errors(usage: FleetUsage) -> bool:
    return usage.errors > 0


async def _idle(usage: FleetUsage) -> bool:
    return usage.sent == 6


async def test_rows_metered_while_the_store_is_down_arrive_when_it_is_back(valkey: ValkeyServer) -> None:
    usage = FleetUsage.connect(valkey.url, key_prefix="t:", connect_timeout_s=0.2, op_timeout_s=0.2)
    try:
        usage.record(_row(0))
        await usage.flush()
        valkey.kill()
        for i in range(1, 21):
            usage.record(_row(i))
            await asyncio.sleep(0.01)
        await usage.flush()
        assert usage.errors >= 1 and usage.sent == 1
        valkey.start()  # empty: no persistence

        async def arrived() -> bool:
            return usage.sent == 21

        await _until(arrived)
        assert await _totals(usage) == {"acme": 20}  # everything metered since the store went away
        assert usage.dropped == 0
    finally:
        await usage.close()


async def test_rows_beyond_what_may_wait_and_rows_unsent_at_stop_are_counted(
    valkey: ValkeyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fleet_usage, "MAX_PENDING", 3)
    usage = FleetUsage.connect(valkey.url, key_prefix="t:", connect_timeout_s=0.2, op_timeout_s=0.1)
    valkey.kill()
    for i in range(8):  # one group per tenant: the first batch takes tenants 0-..., then 3 may wait
        usage.record(_row(i, tenant=f"t{i}"))
        await asyncio.sleep(0)
    waiting = usage._pending_rows + (usage._unsent.rows if usage._unsent else 0)
    assert usage.dropped == 8 - waiting > 0
    await usage.close()
    assert usage.dropped == 8 and usage.sent == 0


async def test_a_batch_the_store_refuses_is_dropped_and_later_rows_still_arrive(valkey: ValkeyServer) -> None:
    admin = aioredis.Redis.from_url(valkey.url)
    usage = FleetUsage.connect(valkey.url, key_prefix="t:", connect_timeout_s=1.0, op_timeout_s=0.2)
    try:
        now = time.time()  # one timestamp for the key and the row: an hour that turns in between moves neither
        hour = int(now // 3600)
        await admin.set(f"t:{{acme}}:usage:{hour}", "not a hash")  # WRONGTYPE for the hour's HINCRBYFLOAT
        usage.record(_row(0, ts=now))
        await usage.flush()
        assert usage.dropped == 1 and usage.sent == 0
        await admin.delete(f"t:{{acme}}:usage:{hour}")
        usage.record(_row(1))
        await usage.flush()
        assert usage.sent == 1 and await _totals(usage) == {"acme": 1}
        # one seq key per replica and tenant, expiring: a replica that stops leaves nothing for good
        [seq_key] = await admin.keys("t:{acme}:usage:seq:*")
        assert 0 < await admin.ttl(seq_key) <= fleet_usage.SEQ_TTL_S
    finally:
        await usage.close()
        await admin.aclose()
