"""One real SmolLM2 engine per test module (model load is the expensive part)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from edge_engine import EdgeEngine, EdgeSettings
from edge_engine.settings import SpeculativeSettings
from edge_engine.speculative import DraftCost


class EngineRunner:
    """An engine living on its own event loop thread, so sync tests can drive it with run()."""

    def __init__(self, settings: EdgeSettings) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = EdgeEngine(settings)
        self.run(self.engine.start())

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.engine.close())
        self.loop.close()


@pytest.fixture(scope="session")
def runner() -> Iterator[EngineRunner]:
    # one thread: the CI box is shared, and ggml's spinning barriers collapse when oversubscribed
    r = EngineRunner(EdgeSettings(n_threads=1, prefix_reuse=False, max_queue=8, n_ctx=1024, slots=8))
    yield r
    r.close()


@pytest.fixture(scope="session")
def reuse_runner() -> Iterator[EngineRunner]:
    """Prefix reuse on and small prompt chunks: a prompt's tail is recomputed in other shapes."""
    r = EngineRunner(EdgeSettings(n_threads=1, prefix_reuse=True, prefill_chunk=16, n_ctx=512, slots=8))
    yield r
    r.close()


@pytest.fixture(scope="session")
def plain_runner() -> Iterator[EngineRunner]:
    """Attention without the fused kernel (f16 cache), whole prompts per step: the other exact set-up."""
    r = EngineRunner(
        EdgeSettings(n_threads=1, prefix_reuse=False, max_queue=8, n_ctx=1024, slots=8, flash_attn=False, prefill_step_ms=None)
    )
    yield r
    r.close()


@pytest.fixture(scope="module")
def spec_runner() -> Iterator[EngineRunner]:
    """Drafts at any batch size and as long as a match allows: free draft rows in the cost model."""
    spec = SpeculativeSettings(max_batch=64, min_acceptance=0.0, max_draft=12)
    r = EngineRunner(EdgeSettings(n_threads=1, prefix_reuse=False, max_queue=16, n_ctx=1024, slots=8, speculative=spec))
    r.engine._scheduler.draft_cost = DraftCost(first=0.0, row=0.0)  # type: ignore[union-attr]
    yield r
    r.close()
