"""Real-model tests of the edge engine: batch invariance, cancellation, stops, overflow, full queue."""

from __future__ import annotations

import asyncio

import pytest

from edge_engine import GenerationEvent, SamplingParams
from edge_engine.errors import ContextTooLong, EngineBusy

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three fruits.",
    "Explain gravity to a child in two sentences, using a simple picture.",
    "What is 2+2?",
    "Name a famous painter and one of their works, then explain why it matters to art history.",
    "Say hello.",
    "Describe a cat.",
]


async def collect(engine, prompt: str, max_tokens: int = 24, **kw) -> tuple[str, GenerationEvent]:
    text, last = [], None
    async for event in engine.generate(messages=[{"role": "user", "content": prompt}], params=SamplingParams(temperature=0, max_tokens=max_tokens, **kw)):
        text.append(event.text)
        last = event
    assert last is not None
    return "".join(text), last


@pytest.mark.parametrize("name", ["runner", "plain_runner"])
def test_greedy_output_is_the_same_alone_and_batched_with_seven_others(name, request) -> None:
    # 48 tokens and two batched rounds: prompts of different lengths arriving together share
    # prompt steps; without flash attention, a prompt cut again by its neighbours changed text.
    runner = request.getfixturevalue(name)
    solo = [runner.run(collect(runner.engine, p, max_tokens=48)) for p in PROMPTS]

    async def together():
        return await asyncio.gather(*(collect(runner.engine, p, max_tokens=48) for p in PROMPTS))

    for _ in range(2):
        batched = runner.run(together())
        assert [t for t, _ in batched] == [t for t, _ in solo]
        assert [e.completion_tokens for _, e in batched] == [e.completion_tokens for _, e in solo]


def test_prompts_of_unequal_length_ingested_together_keep_their_greedy_text(plain_runner) -> None:
    # Without flash attention, llama.cpp's attention matmuls round differently for a prompt cut
    # into other pieces, and with a KV stream per sequence it cuts a step into passes of equal
    # tokens per sequence: these prompts changed text in 2 of 3 rounds when unequal pieces
    # shared a step (prompts 3 and 4).
    prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three fruits.",
        "Explain gravity to a child in two sentences.",
        "Name a famous painter and one work.",
        "Say hello.",
    ]
    solo = [plain_runner.run(collect(plain_runner.engine, p, max_tokens=48))[0] for p in prompts]

    async def together():
        return await asyncio.gather(*(collect(plain_runner.engine, p, max_tokens=48) for p in prompts))

    for _ in range(4):
        assert [t for t, _ in plain_runner.run(together())] == solo


def test_greedy_output_is_the_same_with_prefix_reuse_and_a_long_prompt_beside(reuse_runner) -> None:
    engine = reuse_runner.engine
    first = [reuse_runner.run(collect(engine, p)) for p in PROMPTS]  # fills the prefix entries
    again = [reuse_runner.run(collect(engine, p)) for p in PROMPTS]
    assert any(e.cached_tokens for _, e in again), "the second pass should reuse cached prefixes"

    async def together():
        # a long prompt is ingested in chunks while the others decode beside it
        long = asyncio.create_task(collect(engine, "Describe the sea in detail. " * 30, max_tokens=4))
        out = await asyncio.gather(*(collect(engine, p) for p in PROMPTS))
        await long
        return out

    batched = reuse_runner.run(together())
    texts = [t for t, _ in first]
    assert [t for t, _ in again] == texts
    assert [t for t, _ in batched] == texts


def test_greedy_output_matches_a_fresh_engine_after_traffic(runner, reuse_runner) -> None:
    # different slot layout, pool size and history: the text of a greedy request must not move
    fresh = runner.run(collect(runner.engine, PROMPTS[3]))
    used = reuse_runner.run(collect(reuse_runner.engine, PROMPTS[3]))
    assert fresh[0] == used[0]


def test_usage_and_length_finish(runner) -> None:
    text, last = runner.run(collect(runner.engine, "Count from one to one hundred in words.", max_tokens=5))
    assert last.finish_reason == "length" and last.completion_tokens == 5
    prompt = runner.engine.tokenize_request(messages=[{"role": "user", "content": "Count from one to one hundred in words."}])
    assert last.prompt_tokens == len(prompt)


def test_stop_sequence_cuts_the_text_and_reports_stop(runner) -> None:
    full, _ = runner.run(collect(runner.engine, "List three fruits.", max_tokens=24))
    stop = full[len(full) // 3 : len(full) // 3 + 2]
    cut, last = runner.run(collect(runner.engine, "List three fruits.", max_tokens=24, stop=[stop]))
    assert last.finish_reason == "stop"
    assert cut == full[: full.index(stop)]


def test_prompt_longer_than_the_context_is_a_400(runner) -> None:
    with pytest.raises(ContextTooLong) as err:
        runner.run(collect(runner.engine, "word " * 2000))
    assert err.value.param == "messages" and "maximum context length" in err.value.message


def test_cancel_frees_the_slot_and_kv_cells(runner) -> None:
    async def scenario():
        gen = await runner.engine.submit(messages=[{"role": "user", "content": "Tell a long story."}], params=SamplingParams(temperature=0, max_tokens=200))
        await gen.__anext__()
        assert runner.engine.stats()["active_sequences"] == 1
        gen.cancel()
        deadline = asyncio.get_running_loop().time() + 60  # freed at the scheduler's next step: polled, generously
        while runner.engine.stats()["active_sequences"] != 0:
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.02)
        return runner.engine.stats()

    stats = runner.run(scenario())
    assert stats["active_sequences"] == 0 and stats["kv_cells_reserved"] == 0


def test_full_queue_gets_503_with_retry_after(runner) -> None:
    async def scenario():
        params = SamplingParams(temperature=0, max_tokens=400)
        # 8 slots of 1024 cells: long reservations leave later requests queued
        gens = [await runner.engine.submit(prompt="Once upon a time", params=params) for _ in range(2)]
        with pytest.raises(EngineBusy) as err:
            for _ in range(16):
                gens.append(await runner.engine.submit(prompt="Once upon a time", params=params))
        for g in gens:
            g.cancel()
        return err.value

    err = runner.run(scenario())
    assert err.retry_after is not None and err.retry_after >= 1


def test_prompt_steps_are_calibrated_once_within_the_chunk_cap(runner, reuse_runner) -> None:
    for r in (runner, reuse_runner):
        per_step = r.engine.stats()["prompt_tokens_per_step"]
        assert 1 <= per_step <= r.engine.settings.prefill_chunk
        # attention reads every earlier cell, so a step deep in a prompt carries fewer tokens
        assert 1 <= r.engine.stats()["prompt_tokens_per_step_at_n_ctx"] <= per_step
    # the calibrated size is a constant of the engine: traffic does not move it
    before = reuse_runner.engine.stats()["prompt_tokens_per_step"]
    reuse_runner.run(collect(reuse_runner.engine, "Describe the sea in detail. " * 10, max_tokens=2))
    assert reuse_runner.engine.stats()["prompt_tokens_per_step"] == before


def test_a_short_request_gets_its_first_token_before_a_long_prompt_is_ingested(reuse_runner) -> None:
    engine = reuse_runner.engine
    long_prompt = "Summarise these notes. " + " ".join(f"Note {i}: the bridge over river {i} was rebuilt." for i in range(25))

    async def scenario():
        order: list[str] = []

        async def first_token(name: str, prompt: str) -> None:
            gen = await engine.submit(messages=[{"role": "user", "content": prompt}], params=SamplingParams(temperature=0, max_tokens=2))
            async for _ in gen:
                order.append(name)
                break
            gen.cancel()

        long = asyncio.create_task(first_token("long", long_prompt))
        # the long prompt is being ingested: polled (a fixed sleep is too short on a slow machine,
        # where "short" would simply come first, and too long on a fast one, where "long" would be done)
        deadline = asyncio.get_running_loop().time() + 60
        while engine.stats()["active_sequences"] < 1:
            assert asyncio.get_running_loop().time() < deadline, engine.stats()
            await asyncio.sleep(0.001)
        await first_token("short", "Say hello.")
        await long
        return order

    assert reuse_runner.run(scenario()) == ["short", "long"]


def test_a_running_stream_keeps_getting_tokens_while_a_long_prompt_is_ingested(reuse_runner) -> None:
    engine = reuse_runner.engine
    long_prompt = "Summarise these notes. " + " ".join(f"Note {i}: the ferry to island {i} leaves at dawn." for i in range(30))

    async def scenario():
        running = await engine.submit(messages=[{"role": "user", "content": "Count from one to fifty in words."}],
                                      params=SamplingParams(temperature=0, max_tokens=60))
        await running.__anext__()  # decoding has started
        long = await engine.submit(messages=[{"role": "user", "content": long_prompt}], params=SamplingParams(temperature=0, max_tokens=1))
        long_first = asyncio.get_running_loop().create_future()

        async def drain_long() -> None:
            async for _ in long:
                if not long_first.done():
                    long_first.set_result(None)

        task = asyncio.create_task(drain_long())
        during = 0
        async for _ in running:
            if not long_first.done():
                during += 1
        await task
        prompt_tokens = len(engine.tokenize_request(messages=[{"role": "user", "content": long_prompt}]))
        return during, prompt_tokens, engine.stats()["prompt_tokens_per_step"]

    during, prompt_tokens, per_step = reuse_runner.run(scenario())
    assert prompt_tokens > 3 * per_step, "the long prompt must need several prompt steps"
    # decode_gap_ms bounds how long running streams wait while prompts are ingested
    assert during >= 4, during


def test_prefix_reuse_never_crosses_scopes(reuse_runner) -> None:
    """A shared prefix shows in cached tokens and in TTFT: one tenant must not learn another's prompt."""
    engine = reuse_runner.engine
    secret = "My account number is 4411-2233-9988 and my password is hunter2; please summarise. " * 2

    async def ask(scope: str, text: str) -> int:
        last = None
        async for event in engine.generate(
            messages=[{"role": "user", "content": text}], params=SamplingParams(temperature=0, max_tokens=2), scope=scope
        ):
            last = event
        assert last is not None
        return last.cached_tokens

    reuse_runner.run(ask("tenant-a", secret))
    guess = reuse_runner.run(ask("tenant-b", secret))  # an exact guess by another tenant
    again = reuse_runner.run(ask("tenant-a", secret))  # the owner still reuses its own prefix
    unrelated = reuse_runner.run(ask("tenant-c", "Tell me about the weather on Mars today, please."))
    assert guess == unrelated == 0  # not even the chat template's system prompt is shared
    assert again > 20


def test_penalties_run_and_change_a_greedy_answer(runner) -> None:
    prompt = "Write the word 'classic' twenty times, separated by commas."
    plain, _ = runner.run(collect(runner.engine, prompt, max_tokens=24))
    penalised, last = runner.run(
        collect(runner.engine, prompt, max_tokens=24, repeat_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.0)
    )
    assert last.completion_tokens > 0
    assert penalised != plain
    # the engine goes on serving after requests with penalties
    assert runner.run(collect(runner.engine, prompt, max_tokens=24))[0] == plain
