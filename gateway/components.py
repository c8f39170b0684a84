"""The optional long-lived components, declared once: how each is switched on, built and closed.

Each entry builds one attribute of `Services`. Builders receive the settings and policy and
return an object with an async `close()`; the app starts them in order and closes them in
reverse order.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.settings import Settings
from policies.policy import Policy

Builder = Callable[[Settings, Policy], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Component:
    attribute: str  # the Services field it fills
    enabled: Callable[[Settings, Policy], bool]
    build: Builder


def _section_on(name: str) -> Callable[[Settings, Policy], bool]:
    return lambda settings, policy: bool(policy.section(name).get("enabled", True))


async def _telemetry(settings: Settings, policy: Policy) -> Any:
    from telemetry.core import build_telemetry

    return await build_telemetry(settings, policy)


async def _engine(settings: Settings, policy: Policy) -> Any:
    from edge_engine import EdgeEngine, EdgeSettings

    cfg = settings.edge.model_dump(exclude={"enabled", "aliases"}, exclude_none=True)
    # One core is left to the event loop and the embedder: llama.cpp's spinning threads
    # collapse throughput when they share every core with other work.
    cfg.setdefault("n_threads", max(1, (os.cpu_count() or 1) - 1))
    engine = EdgeEngine(EdgeSettings(**cfg))
    await engine.start()
    return engine


async def _embedder(settings: Settings, policy: Policy) -> Any:
    from policies.embedder import Embedder

    cfg = settings.embedder
    embedder = Embedder(
        max_wait_ms=cfg.max_wait_ms,
        max_batch=cfg.max_batch,
        threads=cfg.threads,
        backend=cfg.backend,
        cache_dir=cfg.cache_dir,
    )
    await embedder.start()
    return embedder


async def _cache(settings: Settings, policy: Policy) -> Any:
    from policies.cache.service import open_cache

    return await open_cache(settings.state_dir, policy)


COMPONENTS: list[Component] = [
    Component("telemetry", lambda s, p: True, _telemetry),
    Component("engine", lambda s, p: s.edge.enabled, _engine),
    # One embedding per request, shared by the semantic cache and the router.
    Component("embedder", lambda s, p: s.embedder.enabled, _embedder),
    Component("cache", _section_on("cache"), _cache),
]
