"""Shared fixtures for the cache tests: the real embedding model, loaded once per session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

from policies.embedder import Embedder, load_sentence_model

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer


@pytest.fixture(scope="session")
def sentence_model() -> SentenceTransformer:
    return load_sentence_model()


@pytest.fixture
async def embedder(sentence_model: SentenceTransformer) -> AsyncIterator[Embedder]:
    emb = Embedder(model=sentence_model)
    await emb.start()
    try:
        yield emb
    finally:
        await emb.close()
