"""The SQLite response store's admission: reservations under real concurrency, the gateway-wide ceiling,
and a file from a newer schema."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from gateway.apis.response_store import (
    Limits,
    QuotaExceeded,
    SqliteResponseStore,
    StoreFull,
    Usage,
)
from tests.unit.gateway.test_response_store_inputs import BIG, record


def test_64_concurrent_reservations_pass_the_quota_by_at_most_one_request_and_failures_release(tmp_path):
    quota = Limits(records=10_000, bytes=10 * 1024 * 1024)
    size = 400 * 1024

    async def run() -> None:
        store = SqliteResponseStore(tmp_path / "r.sqlite3", ttl_s=60)
        await store.start()
        try:
            gate = asyncio.Event()

            async def request(i: int, fail: bool) -> str:
                try:
                    reservation = await store.reserve("t", size, quota)
                except QuotaExceeded:
                    return "refused"
                try:
                    await gate.wait()  # the work: every admitted request is in flight at once
                    if fail:
                        raise RuntimeError("upstream failed")
                    await store.put("t", f"resp_{i}", record(f"resp_{i}", f"{i:06d}" + "y" * size))
                    return "stored"
                except RuntimeError:
                    return "failed"
                finally:
                    store.release(reservation)

            async def open_gate() -> None:
                await asyncio.sleep(0.05)
                gate.set()

            # failures first: their reservations come back, and all the room is there again
            outcomes, _ = await asyncio.gather(asyncio.gather(*(request(i, True) for i in range(64))), open_gate())
            assert "failed" in outcomes and store.reserved("t") == Usage() and await store.usage("t") == Usage()
            gate.clear()
            outcomes, _ = await asyncio.gather(asyncio.gather(*(request(i, False) for i in range(64))), open_gate())
            used = await store.usage("t")
            assert used.bytes <= quota.bytes + size + 1024, used
            assert outcomes.count("stored") == used.records and "refused" in outcomes
            assert store.reserved("t") == Usage()
        finally:
            await store.close()

    asyncio.run(run())


def test_the_gateway_wide_ceiling_refuses_a_stored_request_with_507(tmp_path):
    async def run() -> None:
        store = SqliteResponseStore(tmp_path / "r.sqlite3", ttl_s=60)
        await store.start()
        try:
            limits = Limits(records=100, bytes=10 * len(BIG), total_bytes=3 * len(BIG))
            for tenant in ("a", "b", "c"):  # each well within its own quota
                reservation = await store.reserve(tenant, len(BIG), limits)
                await store.put(tenant, "resp_1", record("resp_1", tenant + BIG))
                store.release(reservation)
            with pytest.raises(StoreFull) as full:
                await store.reserve("d", 10, limits)
            assert full.value.status == 507
            assert full.value.payload()["error"]["code"] == "response_store_full"
            assert "responses.max_bytes_total" in full.value.payload()["error"]["message"]
            assert await store.delete("a", "resp_1")  # DELETE makes room
            store.release(await store.reserve("d", 10, limits))
        finally:
            await store.close()

    asyncio.run(run())


def test_a_file_from_a_newer_schema_is_refused(tmp_path):
    path = tmp_path / "r.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()

    async def run() -> None:
        store = SqliteResponseStore(path, ttl_s=60)
        with pytest.raises(Exception, match="newer tierlane"):
            await store.start()
        await store.close()

    asyncio.run(run())
