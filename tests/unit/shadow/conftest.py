"""The real embedding model and a small local upstream, for the shadow hook tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from policies.embedder import Embedder, load_sentence_model
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.faults import Recorder, fault_app

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

UPSTREAM_ANSWER = "Paris is the capital of France."


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


@pytest.fixture
def upstream(bg: BackgroundLoop) -> Iterator[tuple[RunningApp, Recorder]]:
    rec = Recorder()
    app = RunningApp(bg, fault_app("ok", rec, text=UPSTREAM_ANSWER))
    yield app, rec
    app.stop()


@pytest.fixture
def broken_upstream(bg: BackgroundLoop) -> Iterator[tuple[RunningApp, Recorder]]:
    rec = Recorder()
    app = RunningApp(bg, fault_app("status", rec, status=500))
    yield app, rec
    app.stop()


def chat_answer(text: str) -> dict[str, Any]:
    return {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                      "finish_reason": "stop"}]}
