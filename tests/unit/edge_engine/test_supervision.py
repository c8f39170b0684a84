"""Chaos: a failing step fails only its requests; a dead scheduler is replaced; nothing hangs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from edge_engine import EdgeSettings, SamplingParams
from edge_engine.errors import EngineBusy, EngineError, EngineFailure
from edge_engine.scheduler import MAX_STEP_FAILURES
from tests.unit.edge_engine.conftest import EngineRunner

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def chaos() -> Iterator[EngineRunner]:
    """An engine of its own: these tests break it on purpose."""
    r = EngineRunner(EdgeSettings(n_threads=1, prefix_reuse=False, n_ctx=512, slots=4, prefill_step_ms=None))
    yield r
    r.close()


async def _answer(engine: Any, text: str = "Name a colour.") -> str:
    out = []
    async for event in engine.generate(messages=[{"role": "user", "content": text}], params=PARAMS):
        out.append(event.text)
    return "".join(out)


def _break_decode(engine: Any, times: int) -> list[int]:
    """Makes the next `times` decode calls of the live context raise; returns a call counter."""
    ctx = engine._scheduler.ctx
    real = ctx.decode
    calls = [0]

    def decode(entries: list[Any]) -> int:
        calls[0] += 1
        if calls[0] <= times:
            raise RuntimeError("injected step failure")
        return real(entries)

    ctx.decode = decode
    return calls


def test_a_failing_step_fails_only_its_requests_and_the_engine_goes_on(chaos) -> None:
    engine = chaos.engine
    reference = chaos.run(_answer(engine))
    before = engine.stats()["step_failures_total"]
    _break_decode(engine, 1)

    async def scenario() -> list[Any]:
        return await asyncio.wait_for(
            asyncio.gather(*(_answer(engine) for _ in range(3)), return_exceptions=True), timeout=30
        )

    results = chaos.run(scenario())
    failed = [r for r in results if isinstance(r, EngineFailure)]
    assert failed, results
    assert all(isinstance(r, (str, EngineFailure)) for r in results), results
    assert engine.available
    assert engine.stats()["step_failures_total"] == before + 1
    assert chaos.run(_answer(engine)) == reference  # served, and greedy text unchanged
    chaos.run(_settled(engine))


async def _settled(engine: Any) -> None:
    """Every sequence released (the last event reaches the caller just before its slot is freed)."""
    deadline = asyncio.get_running_loop().time() + 60  # polled with a bound only a leak reaches
    while asyncio.get_running_loop().time() < deadline:
        stats = engine.stats()
        if stats["active_sequences"] == 0 and stats["queue_depth"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"sequences left behind: {engine.stats()}")


def test_a_dead_scheduler_fails_fast_and_is_replaced(chaos) -> None:
    engine = chaos.engine
    reference = chaos.run(_answer(engine))
    restarts = engine.stats()["restarts_total"]
    old = engine._scheduler
    _break_decode(engine, MAX_STEP_FAILURES)  # enough failures in a row to give up on the context

    async def scenario() -> tuple[list[Any], Any]:
        outcomes = []
        for _ in range(MAX_STEP_FAILURES):
            try:
                outcomes.append(await asyncio.wait_for(_answer(engine), timeout=30))
            except EngineError as exc:
                outcomes.append(exc)
        # the scheduler has given up: a submission now is refused at once, not queued
        try:
            await asyncio.wait_for(_answer(engine), timeout=5)
            refused = None
        except EngineBusy as exc:
            refused = exc
        return outcomes, refused

    outcomes, refused = chaos.run(scenario())
    assert all(isinstance(o, EngineFailure) for o in outcomes), outcomes
    assert refused is not None and refused.retry_after
    assert not old.running

    async def wait_back() -> None:
        deadline = asyncio.get_running_loop().time() + 120  # a new context on a slow machine: polled, generously
        while asyncio.get_running_loop().time() < deadline:
            if engine.available:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the engine did not come back")

    chaos.run(wait_back())
    assert engine._scheduler is not old
    assert engine.stats()["restarts_total"] == restarts + 1
    assert chaos.run(_answer(engine)) == reference
