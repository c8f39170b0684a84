"""The micro-batching embedder: real model, concurrent calls, shape and normalisation."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

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
