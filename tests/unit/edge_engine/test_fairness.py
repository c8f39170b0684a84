"""No request holds the edge for others: tenants share slots and queue, and each request's time is bounded."""

from __future__ import annotations

import asyncio
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
HOG = SamplingParams(temperature=0.0, max_tokens=400, stop_on_loop=False)  # cancelled once it made its point
ASK = [{"role": "user", "content": "Write a long story about a cat."}]


@pytest.fixture(scope="module")
def small() -> Iterator[EngineRunner]:
    """Two slots, a queue of four: one tenant may hold one slot and two queue places while another is about."""
    r = EngineRunner(EdgeSettings(n_threads=1, prefix_reuse=False, n_ctx=512, slots=2, prefix_slots=0, max_queue=4,
                                  tenant_slot_share=0.5, tenant_queue_share=0.5, speculative={"enabled": False}))
    yield r
    r.close()


async def first_token(generation, name: str, order: list[str]) -> None:  # type: ignore[no-untyped-def]
    """Notes `name` in `order` when the generation's first token reaches the loop: the scheduler
    hands tokens over in the order it makes them, so `order` is the engine's order, on any host."""
    await generation.__anext__()
    order.append(name)


def test_a_free_slot_goes_to_the_tenant_with_fewest_running(small: EngineRunner) -> None:
    async def scenario() -> list[str]:
        engine = small.engine
        async for _ in await engine.submit(messages=ASK, params=SHORT, scope="b"):  # b has been about lately
            pass
        hog = [await engine.submit(messages=ASK, params=LONG, scope="a") for _ in range(2)]
        other = await engine.submit(messages=ASK, params=SHORT, scope="b")
        order: list[str] = []
        await asyncio.gather(first_token(hog[0], "a first", order), first_token(hog[1], "a second", order),
                             first_token(other, "b", order))
        for g in [*hog, other]:
            g.cancel()
        return order

    order = small.run(scenario())
    # tenant a may hold one of the two slots while b is about: b's request runs beside a's first
    # and starts before a's second, which waits for a slot of its own tenant's to end
    assert order.index("b") < order.index("a second"), order


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
        async def scenario() -> list[str]:
            # NOTE: ordered by the engine's own events as the loop reads them (the scheduler hands
            # them over in the order it makes them), never by wall time: on a fast host a request
            # ends sooner, on a slow one later, and the order holds on both
            engine = runner.engine
            order: list[str] = []
            running = asyncio.Event()

            async def read(name: str, generation) -> None:  # type: ignore[no-untyped-def]
                async for event in generation:
                    if name == "hog 0" and not running.is_set():
                        running.set()
                    if event.finish_reason is not None:
                        order.append(f"{name} ended ({event.finish_reason}, {event.completion_tokens} tokens)")

            hog = [await engine.submit(messages=ASK, params=HOG, scope="alone") for _ in range(2)]
            readers = [asyncio.ensure_future(read(f"hog {i}", g)) for i, g in enumerate(hog)]
            await asyncio.wait_for(running.wait(), 120)  # the hog's first request decodes: it filled the engine
            newcomer = await engine.submit(messages=ASK, params=SHORT, scope="newcomer")  # never seen before
            await asyncio.wait_for(newcomer.__anext__(), 120)
            order.append("newcomer's first token")
            for g in [*hog, newcomer]:
                g.cancel()
            for reader in readers:  # a cancelled generation yields nothing more: stop reading it
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            return order

        order = runner.run(scenario())
        # the lone tenant holds one of the two slots (one stays reserved): the newcomer runs at the
        # next step, while the hog's 400-token requests still decode (before: it waited for one to end)
        assert order[0] == "newcomer's first token", order
    finally:
        runner.close()
