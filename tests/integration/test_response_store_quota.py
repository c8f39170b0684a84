"""The stored-responses quota under concurrency, through a real gateway: reservations taken at
admission hold 64 concurrent requests to the quota plus one request, and a request that fails or
whose client goes away gives its reservation back."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import orjson
import pytest

from gateway.apis.response_store import SqliteResponseStore, Usage
from gateway.auth import hash_key
from gateway.keys import SERVICES
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app

pytestmark = pytest.mark.slow

KEY = "tl-store-quota-tenant"
QUOTA = 10 * 1024 * 1024
INPUT = 400 * 1024
CONCURRENT = 64
RESERVE_OUTPUT = 64 * 1024  # responses.reserve_output_bytes's default


def _body(i: int, model: str = "m") -> bytes:
    # distinct inputs: identical ones are stored once, and this is about the quota
    return orjson.dumps({"model": model, "input": f"{i:06d}" + "x" * INPUT, "max_output_tokens": 4})


def test_64_concurrent_stored_requests_pass_the_quota_by_at_most_one_and_failures_release(bg, make_gateway):
    rec, bad_rec = Recorder(), Recorder()
    released = threading.Event()
    up = RunningApp(bg, fault_app("ok", rec, text="Noted.", hold_until=released.is_set))
    bad = RunningApp(bg, fault_app("status", bad_rec, status=400))
    gw = make_gateway(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"]),
                                 upstream_cfg("bad", bad.url + "/v1", models=["broken"], retries=0)],
                      auth={"mode": "keys", "keys": [{"sha256": hash_key(KEY), "tenant": "t"}]},
                      responses={"max_bytes_per_tenant": QUOTA})
    store = gw.app[SERVICES].responses
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120,
                                     limits=httpx.Limits(max_connections=CONCURRENT)) as client:
            tasks = [asyncio.ensure_future(client.post("/v1/responses", content=_body(i), headers=headers))
                     for i in range(CONCURRENT)]
            # every request is either refused or held at the upstream before any is answered (and stored)
            deadline = time.monotonic() + 60
            while rec.hits + sum(t.done() for t in tasks) < CONCURRENT:
                assert time.monotonic() < deadline, (rec.hits, sum(t.done() for t in tasks))
                await asyncio.sleep(0.02)
            released.set()
            return [r.status_code for r in await asyncio.gather(*tasks)]

    statuses = asyncio.run(burst())
    stored = bg.call(store.usage("t"))
    one_request = len(_body(0)) + RESERVE_OUTPUT  # what one request reserves
    assert stored.bytes <= QUOTA + one_request, (stored, statuses.count(200))
    assert statuses.count(200) == stored.records and statuses.count(200) >= QUOTA // one_request
    assert set(statuses) == {200, 429}
    assert bg.call(_reserved(store)) == Usage()  # every reservation settled or released

    # requests that fail (upstream 400) or whose client goes away give their reservation back
    for response_id in bg.call(_ids(store))[: stored.records // 2]:
        assert bg.call(store.delete("t", response_id))
    room = bg.call(store.usage("t"))

    async def failures() -> list[int]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as client:
            answers = await asyncio.gather(*(client.post("/v1/responses", content=_body(1000 + i, "broken"),
                                                         headers=headers) for i in range(CONCURRENT)))
            return [r.status_code for r in answers]

    failed = asyncio.run(failures())
    assert 200 not in failed and bad_rec.hits > 0
    assert bg.call(_reserved(store)) == Usage() and bg.call(store.usage("t")) == room
    released.clear()

    async def goes_away() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as client:
            task = asyncio.ensure_future(client.post("/v1/responses", content=_body(2000), headers=headers))
            hits = rec.hits
            deadline = time.monotonic() + 30
            while rec.hits == hits:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            task.cancel()  # the client disconnects while its request is held at the upstream
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(goes_away())
    released.set()
    deadline = time.monotonic() + 30
    while bg.call(_reserved(store)) != Usage():
        assert time.monotonic() < deadline, bg.call(_reserved(store))
        time.sleep(0.05)

    # and a later request fits: nothing is left reserved by the failures
    async def later() -> int:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as client:
            return (await client.post("/v1/responses", content=_body(3000), headers=headers)).status_code

    assert asyncio.run(later()) == 200


async def _reserved(store: SqliteResponseStore) -> Usage:
    return store.reserved("t")


async def _ids(store: SqliteResponseStore) -> list[str]:
    """The tenant's stored ids, once the records written behind are on disk."""
    while store._flushing is not None:
        await store._flushing
    return await store._run(lambda: [row[0] for row in store._conn().execute(
        "SELECT id FROM responses WHERE tenant = 't'")])
