"""Shared fixtures for the cache tests: the real embedding model, loaded once per session."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from policies.cache.service import SemanticCache
from policies.embedding.embedder import Embedder
from policies.policy import Policy

sys.path.insert(0, str(Path(__file__).parent))

from helpers import Flow


@pytest.fixture
async def open_cache(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[SemanticCache]]]:
    """Opens real caches under tmp_path (optionally with a policy overlay); closes them after the test."""
    opened: list[SemanticCache] = []

    async def make(state_dir: Path | None = None, **cache_policy: Any) -> SemanticCache:
        policy = Policy.load(extra={"cache": cache_policy} if cache_policy else None)
        cache = SemanticCache(state_dir or tmp_path, policy)
        await cache.start()
        opened.append(cache)
        return cache

    yield make
    for cache in opened:
        await cache.close()


@pytest.fixture
async def flow(open_cache: Callable[..., Awaitable[SemanticCache]], embedder: Embedder) -> Flow:
    return Flow(await open_cache(), embedder)
