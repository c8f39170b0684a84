"""The Redis budget store alone, against a real Valkey server: atomic checks, holds that expire
when no replica settles them, and stream charges that stop at the limit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from policies.budgets import Budgets
from policies.errors import BudgetExceeded, LimitExceeded
from policies.policy import Policy
from policies.shared_state.redis_budgets import RedisBudgets
from policies.shared_state.redis_mux import MuxClient
from policies.shared_state.shared_budgets import SharedBudgets
from tests.support.valkey import ValkeyServer
from tests.unit.telemetry.conftest import tenant_budgets as _budgets


@pytest.fixture
async def connect(valkey: ValkeyServer) -> AsyncIterator[Callable[[], MuxClient]]:
    """A new connection per call (one per store: stores stand for replicas), all closed at the end."""
    opened: list[MuxClient] = []

    def new() -> MuxClient:
        opened.append(MuxClient(valkey.url))
        return opened[-1]

    yield new
    for mux in opened:
        await mux.close()


async def _held(client: aioredis.Redis) -> float:
    return float(await client.hget("tierlane:{acme}:t:s", "held") or 0.0)


async def test_concurrent_admissions_let_exactly_the_limit_through(
    client: aioredis.Redis, connect: Callable[[], MuxClient]
) -> None:
    stores = [RedisBudgets(_budgets(requests_per_minute=10), connect()) for _ in range(3)]  # three "replicas"

    async def one(i: int) -> bool:
        try:
            await stores[i % 3].admit(f"r{i}", "acme", "web", 5, 0.0)
        except LimitExceeded as exc:
            assert exc.retry_after is not None and 0 < exc.retry_after <= 60
            return False
        return True

    assert sum(await asyncio.gather(*(one(i) for i in range(40)))) == 10


async def test_a_hold_nobody_settles_expires(client: aioredis.Redis, connect: Callable[[], MuxClient]) -> None:
    store = RedisBudgets(_budgets(daily_spend_usd=1.0), connect(), hold_ttl_s=0.5)
    await store.admit("dies", "acme", "web", 5, 1.0)  # its replica dies: never settled
    assert await _held(client) == pytest.approx(1.0)
    with pytest.raises(BudgetExceeded, match="reserved"):
        await store.admit("next", "acme", "web", 5, 0.3)
    await asyncio.sleep(0.7)
    await store.admit("next", "acme", "web", 5, 0.3)  # the sweep released the dead hold first
    assert await _held(client) == pytest.approx(0.3)
    await store.settle("next", "acme", "web", 10, 0.25)
    assert await _held(client) == 0.0
    assert float(await client.hget("tierlane:{acme}:t:s", "d") or 0) == pytest.approx(0.25)


async def test_stream_charges_use_up_the_hold_and_stop_past_the_limit(
    client: aioredis.Redis, connect: Callable[[], MuxClient]
) -> None:
    store = RedisBudgets(_budgets(daily_spend_usd=0.01), connect())
    await store.admit("s", "acme", "web", 5, 0.004)
    assert await store.charge("s", "acme", "web", 10, 0.003) is None
    assert await _held(client) == pytest.approx(0.001)
    assert await store.charge("s", "acme", "web", 10, 0.007) is None  # $0.01: at the budget
    assert await _held(client) == 0.0
    breach = await store.charge("s", "acme", "web", 1, 0.0001)
    assert isinstance(breach, BudgetExceeded) and "stream stopped" in breach.message
    await store.settle("s", "acme", "web", 21, 0.0101)  # the final usage replaces what was charged
    assert float(await client.hget("tierlane:{acme}:t:s", "d") or 0) == pytest.approx(0.0101)
    with pytest.raises(BudgetExceeded):
        await store.admit("after", "acme", "web", 5, 0.0)


async def test_unlimited_callers_never_reach_the_store(tmp_path: Path) -> None:
    unreachable = MuxClient("redis://127.0.0.1:1/0", connect_timeout_s=0.1)
    store = RedisBudgets(Budgets(Policy.load(extra={"budgets": {"enabled": True}})), unreachable)
    await store.admit("x", "acme", "web", 5, 1.0)
    assert await store.charge("x", "acme", "web", 5, 1.0) is None
    await store.settle("x", "acme", "web", 5, 1.0)
    await unreachable.close()


async def _script_calls(client: aioredis.Redis) -> int:
    stats = await client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval"))


async def test_streams_are_charged_in_batches_and_a_breach_ends_them(
    client: aioredis.Redis, connect: Callable[[], MuxClient]
) -> None:
    budgets = _budgets(tokens_per_minute=100)
    shared = SharedBudgets(budgets, RedisBudgets(budgets, connect()), op_timeout_s=1.0, batch_tokens=10, batch_s=60.0)
    await shared.admit("s", "acme", "web", 5, 0.0)
    before = await _script_calls(client)
    request = shared._open["s"]
    produced, breach = 0, None
    for _ in range(300):  # one token per chunk, as a stream produces them
        breach = shared.charge_chunk("s", 1, 0.0)
        if breach is not None:
            break
        produced += 1
        # NOTE: the stream goes on once the batch it set off is answered. Paced by the clock instead,
        # how many chunks pass while a batch is out is the machine's speed, not the code's.
        if request.flush is not None:
            await asyncio.wait({request.flush})
    assert isinstance(breach, LimitExceeded) and "stream stopped" in breach.message
    assert 95 < produced <= 95 + 10  # found by the batch that passed the limit: the next chunk is stopped
    assert await _script_calls(client) - before <= produced // 10 + 1  # one round trip per 10 tokens
    await shared.settle("s", 5 + produced, 0.0)
    assert shared.in_flight() == 0
    window = sum(float(v) for v in await client.hvals("tierlane:{acme}:t:tok"))
    assert window == 5 + produced  # the final count replaced what the batches charged
