"""A small local upstream for the shadow hook tests (the embedder fixture is suite-wide)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.background import BackgroundLoop, RunningApp
from tests.support.faults import Recorder, fault_app

UPSTREAM_ANSWER = "Paris is the capital of France."


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
