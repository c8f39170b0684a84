"""The optional long-lived components, declared once: how each is switched on, built and closed.

Each entry builds one attribute of `Services`. Builders receive the settings and policy and
return an object with an async `close()`; the app starts them in order and closes them in
reverse order.
"""

from __future__ import annotations

import asyncio
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


def _cache_on(settings: Settings, policy: Policy) -> bool:
    from policies.cache.config import CacheConfig

    # NOTE: parsing the raw section (overrides included) here, not where the cache is built,
    # makes a misspelt key in any override fail at start-up even when the cache is off.
    return CacheConfig.from_section(policy.section("cache")).enabled


async def _telemetry(settings: Settings, policy: Policy) -> Any:
    from gateway.errors import known_error_codes
    from telemetry.core import build_telemetry

    return await build_telemetry(settings, policy, known_error_codes())


async def _engine(settings: Settings, policy: Policy) -> Any:
    from edge_engine import EdgeEngine

    # The `edge` section is the engine's settings model (validated and defaulted at load); the
    # lane's own fields on it (enabled, aliases) are never read by the engine.
    engine = EdgeEngine(settings.edge)
    await engine.start()
    return engine


async def _embedder(settings: Settings, policy: Policy) -> Any:
    from policies.embedding.embedder import Embedder

    await _warm_normalisation()  # embedding texts are normalised with it (the router's too)
    cfg = settings.embedder
    embedder = Embedder(
        max_wait_ms=cfg.max_wait_ms,
        max_batch=cfg.max_batch,
        max_queue=cfg.max_queue,
        threads=cfg.threads,
        backend=cfg.backend,
        cache_dir=cfg.cache_dir,
        precision=cfg.precision,
    )
    await embedder.start()
    return embedder


async def _warm_normalisation() -> None:
    """Build the stream-safe NFKC table (~0.4 s, once) off the loop, before traffic: cache keys,
    embedding texts and the edge prior's features normalise with it."""
    from policies import unicode_norm

    await asyncio.to_thread(unicode_norm.warm)


async def _cache(settings: Settings, policy: Policy) -> Any:
    await _warm_normalisation()
    state = settings.state
    # NOTE: the precision configured, not the one serving: a fallback to torch (float32, logged)
    # leaves the vectors a cosine of ~0.99 apart, inside what the verifier decides on anyway.
    from policies.embedding.embedder import vector_space

    space = vector_space(settings.embedder.precision)
    if state.backend == "redis":
        from policies.cache.shared import open_shared_cache  # redis is imported only when configured

        return await open_shared_cache(
            policy,
            state.url,
            key_prefix=state.key_prefix,
            connect_timeout_s=state.connect_timeout_ms / 1000.0,
            op_timeout_s=state.op_timeout_ms / 1000.0,
            stream_max_len=state.cache_stream_max_len,
            vector_space=space,
        )
    from policies.cache.service import open_cache

    return await open_cache(settings.state_dir, policy, vector_space=space)


async def _cascade(settings: Settings, policy: Policy) -> Any:
    await _warm_normalisation()  # the edge prior's features normalise with it
    from gateway.cascade import Cascade
    from gateway.edge_calibration import BackgroundCalibration, find_for_model
    from policies.cascade import CascadePolicy

    # NOTE: a calibration measured on another GGUF would judge this model by that one's
    # answers: it is refused (logged), and the edge lane takes no `auto` traffic until this
    # model has its own (gateway/edge_calibration.py).
    named = settings.edge.calibration or CascadePolicy(policy).section.calibration
    calibration, status = await find_for_model(settings.edge, named)
    cascade = Cascade(policy, calibration, status)
    if calibration is None and settings.edge.calibrate_on_start:
        cascade.background = BackgroundCalibration(status, settings.edge, cascade.take_calibration)  # see after_start
    return cascade


async def _responses(settings: Settings, policy: Policy) -> Any:
    from gateway.apis.response_store import open_store

    return await open_store(settings)


def _route_quality_on(settings: Settings, policy: Policy) -> bool:
    from gateway.route_quality import quality_on

    return quality_on(policy)


async def _route_quality(settings: Settings, policy: Policy) -> Any:
    from gateway.route_quality import open_route_quality

    return await open_route_quality(settings, policy)


def _learn_on(settings: Settings, policy: Policy) -> bool:
    from policies.learn.config import LearnPolicy

    # NOTE: parsed even where no template is named, so a misspelt key fails at start-up.
    return LearnPolicy(policy).any_template


async def _learn(settings: Settings, policy: Policy) -> Any:
    from policies.learn.service import open_learning

    if not settings.edge.enabled:  # pairs are kept; the adapters are served by the edge model only
        return await open_learning(settings.state_dir, policy)
    from edge_engine.adapters import AdapterLimits

    edge = settings.edge
    limits = AdapterLimits(n_threads=edge.n_threads)
    return await open_learning(settings.state_dir, policy, base_model=edge.resolved_model_path(),
                               base_sha256=edge.model_sha256, adapters=limits)  # fmt: skip


COMPONENTS: list[Component] = [
    Component("telemetry", lambda s, p: True, _telemetry),
    Component("engine", lambda s, p: s.edge.enabled, _engine),
    # One embedding per request, shared by the semantic cache and the router.
    Component("embedder", lambda s, p: s.embedder.enabled, _embedder),
    Component("cache", _cache_on, _cache),
    Component("cascade", lambda s, p: s.edge.enabled, _cascade),
    Component("responses", lambda s, p: True, _responses),
    # lanes.upstream.tiers.max_quality_loss: regions and the learnt thresholds (gateway/route_quality.py)
    Component("route_quality", _route_quality_on, _route_quality),
    # policy `learn`: opened only where some tenant/app names a template to learn (docs/edge-learn.md)
    Component("learn", _learn_on, _learn),
]
