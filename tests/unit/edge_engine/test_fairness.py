"""No request holds the edge for others: tenants share slots and queue, and each request's time is bounded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from edge_engine import EdgeSettings, SamplingParams
from edge_engine.errors import EngineBusy, GrammarTooComplex
from edge_engine.json_mode import grammar_for
from edge_engine.settings import GrammarSettings
from tests.unit.edge_engine.conftest import EngineRunner

pytestmark = pytest.mark.slow

LONG = SamplingParams(temperature=0.0, max_tokens=48, stop_on_loop=False)
SHORT = SamplingParams(temperature=0.0, max_tokens=2)
ASK = [{"role": "user", "content": "Write a long story about a cat."}]


@pytest.fixture(scope="module")
def small() -> Iterator[EngineRunner]:
    """Two slots, a queue of four: one tenant may hold one slot and two queue places while another is about."""
    r = EngineRunner(EdgeSettings(n_threads=1, prefix_reuse=False, n_ctx=512, slots=2, prefix_slots=0, max_queue=4,
                                  tenant_slot_share=0.5, tenant_queue_share=0.5, speculative={"enabled": False}))
    yield r
    r.close()


async def first_token_at(generation) -> float:  # type: ignore[no-untyped-def]
    await generation.__anext__()
    return time.perf_counter()


def test_a_free_slot_goes_to_the_tenant_with_fewest_running(small: EngineRunner) -> None:
    async def scenario() -> tuple[list[float], float]:
        engine = small.engine
        async for _ in await engine.submit(messages=ASK, params=SHORT, scope="b"):  # b has been about lately
            pass
        hog = [await engine.submit(messages=ASK, params=LONG, scope="a") for _ in range(2)]
        other = await engine.submit(messages=ASK, params=SHORT, scope="b")
        times = await asyncio.gather(*(first_token_at(g) for g in hog), first_token_at(other))
        for g in [*hog, other]:
            g.cancel()
        return list(times[:2]), times[2]

    hog_times, other_time = small.run(scenario())
    # tenant a may hold one of the two slots while b is about: b's request runs beside a's first
    # and starts before a's second, which waits for a slot of its own tenant's to end
    assert other_time < max(hog_times)


def test_one_tenant_cannot_fill_the_whole_queue(small: EngineRunner) -> None:
    async def scenario() -> None:
        engine = small.engine
        async for _ in await engine.submit(messages=ASK, params=SHORT, scope="b"):  # b has been about lately
            pass
        held = []
        with pytest.raises(EngineBusy, match="this tenant"):
            for _ in range(6):
                held.append(await engine.submit(messages=ASK, params=LONG, scope="a"))
        assert len(held) <= 3  # its one slot and its two places in the queue
        other = await engine.submit(messages=ASK, params=SHORT, scope="b")  # the rest of the queue is b's to take
        async for _ in other:
            pass
        for g in held:
            g.cancel()

    small.run(scenario())


def test_a_request_running_past_max_request_s_ends_with_length() -> None:
    r = EngineRunner(EdgeSettings(n_threads=1, prefix_reuse=False, n_ctx=512, slots=1, prefix_slots=0, max_request_s=0.3,
                                  speculative={"enabled": False}))
    try:
        async def scenario() -> tuple[str | None, int]:
            last = None
            async for event in r.engine.generate(messages=ASK, params=SamplingParams(temperature=0.0, max_tokens=400,
                                                                                       stop_on_loop=False)):
                last = event
            assert last is not None
            return last.finish_reason, last.completion_tokens

        reason, tokens = r.run(scenario())
        assert reason == "length" and 0 < tokens < 400
    finally:
        r.close()


def test_grammar_sampling_time_is_bounded_per_request() -> None:
    r = EngineRunner(EdgeSettings(n_threads=1, prefix_reuse=False, n_ctx=512, slots=1, prefix_slots=0,
                                  grammar=GrammarSettings(max_sampling_ms=0.001), speculative={"enabled": False}))
    try:
        async def scenario() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=32, grammar=grammar_for({"type": "json_object"}))
            with pytest.raises(GrammarTooComplex):
                async for _ in r.engine.generate(messages=ASK, params=params):
                    pass
            assert r.engine.stats()["grammar_stops_total"] == 1
            # the engine goes on: a plain request is answered
            async for _ in r.engine.generate(messages=ASK, params=SHORT):
                pass

        r.run(scenario())
    finally:
        r.close()


def test_a_tenant_arriving_after_one_filled_the_engine_alone_is_admitted_at_the_next_step() -> None:
    runner = EngineRunner(EdgeSettings(n_threads=1, prefix_reuse=False, n_ctx=512, slots=2, prefix_slots=0, max_queue=4,
                                       tenant_slot_share=1.0, speculative={"enabled": False}))
    try:
        async def drained(generation) -> float:  # type: ignore[no-untyped-def]
            async for _ in generation:
                pass
            return time.perf_counter()

        async def scenario() -> tuple[float, list[float]]:
            engine = runner.engine
            hog = [await engine.submit(messages=ASK, params=LONG, scope="alone") for _ in range(2)]
            ending = [asyncio.ensure_future(drained(g)) for g in hog]  # read as they come, like a client
            await asyncio.sleep(0.5)  # the hog's second request takes the other slot where it may
            newcomer = await engine.submit(messages=ASK, params=SHORT, scope="newcomer")  # never seen before
            arrived = await first_token_at(newcomer)
            ends = await asyncio.gather(*ending)
            newcomer.cancel()
            return arrived, list(ends)

        arrived, ends = runner.run(scenario())
        # the lone tenant holds one of the two slots (one stays reserved): the newcomer runs at once,
        # before either of the hog's 48-token requests ends (before: it waited for one of them to end)
        assert arrived < min(ends)
    finally:
        runner.close()
