"""The micro-batching embedder: real model, concurrent calls, shape and normalisation.

How a batch was formed is read from the embedder's own counters (`windows`: batches for which the
window timer was armed; `immediate`: batches sent without it) and from the encode calls a gate
around the real encoder records, never from wall time. The windows used are a minute long, so a
request held by one would also show as a test stuck for a minute.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from helpers import Gated

from policies.embedding.embedder import DIMENSION, Embedder, encode

pytestmark = pytest.mark.slow


async def test_embed_matches_direct_encode(embedder: Embedder, sentence_model) -> None:
    text = "How do I convert Celsius to Fahrenheit?"
    vector = await embedder.embed(text)
    assert vector.shape == (DIMENSION,)
    assert vector.dtype == np.float32
    assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-4
    direct = encode(sentence_model, [text])[0]
    assert float(vector @ direct) > 0.9999


async def test_concurrent_calls_share_batches_and_keep_order(embedder: Embedder, sentence_model) -> None:
    texts = [f"question number {i} about {word}" for i, word in enumerate(["cats", "tax", "rust", "jazz"] * 8)]
    before_batches, before_texts = embedder.batches, embedder.texts
    vectors = await asyncio.gather(*(embedder.embed(t) for t in texts))
    assert embedder.texts - before_texts == len(texts)
    assert embedder.batches - before_batches < len(texts)
    direct = encode(sentence_model, texts)
    for got, want in zip(vectors, direct):
        assert float(got @ want) > 0.9999


async def test_max_batch_bounds_each_encode(sentence_model) -> None:
    emb = Embedder(model=sentence_model, max_batch=4)
    await emb.start()
    try:
        await emb.embed_many([f"text {i}" for i in range(10)])
        assert emb.texts == 10
        assert emb.batches >= 3
    finally:
        await emb.close()


async def test_embed_before_start_is_an_error(sentence_model) -> None:
    emb = Embedder(model=sentence_model)
    with pytest.raises(RuntimeError, match="start"):
        await emb.embed("hello")


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        Embedder(max_batch=0)
    with pytest.raises(ValueError):
        Embedder(max_wait_ms=-1)
    with pytest.raises(ValueError):
        Embedder(max_queue=0)


MINUTE_MS = 60_000.0
TEXTS = ["How do I convert Celsius to Fahrenheit?", "jazz", "What is the capital of Australia?",
         "a much longer question about the tax rules for small businesses in Austria and in Germany",
         "rust borrow checker error E0502", "Wie spät ist es?", "2 + 2 = ?", "Summarise the plot of Hamlet."]


async def gated_embedder(sentence_encoder: Any, **kw: Any) -> tuple[Embedder, Gated]:
    """A started Embedder whose encodes go through a gate (open unless a test closes it)."""
    gated = Gated(sentence_encoder)
    gated.release.set()
    emb = Embedder(model=sentence_encoder, **kw)
    await emb.start()  # warmed up on the real encoder, not counted
    emb._encoder = gated  # type: ignore[assignment]
    return emb, gated


async def test_a_lone_request_is_sent_without_arming_the_window(sentence_encoder: Any) -> None:
    emb, gated = await gated_embedder(sentence_encoder, max_wait_ms=MINUTE_MS)
    try:
        vector = await emb.embed(TEXTS[0])
        assert (emb.batches, emb.immediate, emb.windows) == (1, 1, 0)
        assert gated.calls == [[TEXTS[0]]]
        np.testing.assert_array_equal(vector, sentence_encoder.encode([TEXTS[0]])[0])
        # one after another, each alone: none waits on the window either
        for text in TEXTS[1:4]:
            await emb.embed(text)
        assert (emb.batches, emb.immediate, emb.windows) == (4, 4, 0)
    finally:
        await emb.close()


async def test_a_text_queued_behind_a_busy_encoder_goes_next_without_the_window(sentence_encoder: Any) -> None:
    emb, gated = await gated_embedder(sentence_encoder, max_wait_ms=MINUTE_MS)
    gated.release.clear()
    try:
        first = asyncio.ensure_future(emb.embed(TEXTS[0]))
        await asyncio.get_running_loop().run_in_executor(None, gated.entered.wait, 60)
        second = asyncio.ensure_future(emb.embed(TEXTS[1]))
        for _ in range(3):
            await asyncio.sleep(0)  # the call puts its text in the queue
        assert emb._queue is not None and emb._queue.qsize() == 1
        gated.release.set()
        await asyncio.gather(first, second)
        assert gated.calls == [[TEXTS[0]], [TEXTS[1]]]
        assert (emb.batches, emb.immediate, emb.windows) == (2, 2, 0)
    finally:
        gated.release.set()
        await emb.close()


async def test_concurrent_requests_share_one_encode_with_the_vectors_of_one_at_a_time(sentence_encoder: Any) -> None:
    emb, gated = await gated_embedder(sentence_encoder, max_wait_ms=MINUTE_MS)
    try:
        alone = [await emb.embed(text) for text in TEXTS]
        assert emb.batches == len(TEXTS)
        together = await asyncio.gather(*(emb.embed(text) for text in TEXTS))
        assert gated.calls[len(TEXTS):] == [TEXTS]  # one encode call for all of them, in their order
        assert emb.batches == len(TEXTS) + 1 and emb.windows == 0  # all arrived in one pass: no window
        for one, batched in zip(alone, together):
            # onnxruntime's matmuls round differently with the batch's shape: the last bit of a float32 at most
            np.testing.assert_allclose(batched, one, rtol=0, atol=1e-6)
            assert float(one @ batched) > 1 - 1e-6
    finally:
        await emb.close()


async def test_the_window_gathers_texts_that_arrive_while_it_is_open(sentence_encoder: Any) -> None:
    emb, gated = await gated_embedder(sentence_encoder, max_wait_ms=MINUTE_MS, max_batch=3)
    try:
        first = asyncio.ensure_future(emb.embed(TEXTS[0]))
        await asyncio.sleep(0)  # queued; the batcher wakes after the next call is made
        second = asyncio.ensure_future(emb.embed(TEXTS[1]))  # arrives in the batcher's one pass of the loop
        for _ in range(5):
            await asyncio.sleep(0)  # the batcher has seen a second text: its window is open
        assert gated.calls == [] and emb.batches == 0
        third = asyncio.ensure_future(emb.embed(TEXTS[2]))  # fills the batch: it goes without the timer's end
        await asyncio.gather(first, second, third)
        assert gated.calls == [TEXTS[:3]]
        assert (emb.batches, emb.windows, emb.immediate) == (1, 1, 0)
    finally:
        await emb.close()


async def test_the_queue_is_bounded(sentence_encoder: Any) -> None:
    emb, gated = await gated_embedder(sentence_encoder, max_queue=2, max_batch=2, max_wait_ms=0)
    gated.release.clear()
    try:
        held = asyncio.ensure_future(emb.embed(TEXTS[0]))
        await asyncio.get_running_loop().run_in_executor(None, gated.entered.wait, 60)
        queued = [asyncio.ensure_future(emb.embed(text)) for text in TEXTS[1:3]]
        extra = asyncio.ensure_future(emb.embed(TEXTS[3]))  # waits for room
        for _ in range(5):
            await asyncio.sleep(0)
        assert emb._queue is not None and emb._queue.qsize() == 2 and not extra.done()
        assert await emb.embed_if_room(TEXTS[4]) is None and emb.shed == 1
        gated.release.set()
        await asyncio.gather(held, *queued, extra)
        assert gated.calls == [TEXTS[:1], TEXTS[1:3], TEXTS[3:4]]  # max_batch texts an encode at most
        assert emb.texts == 4
    finally:
        gated.release.set()
        await emb.close()
