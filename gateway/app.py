"""`create_app(settings)`: builds the aiohttp application and everything it runs with."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.apis import messages, responses
from gateway.auth import KeyTable
from gateway.batches import anthropic_routes as batch_messages
from gateway.batches import openai_routes as batch_openai
from gateway.batches import service as batches
from gateway.components import COMPONENTS
from gateway.keys import ERROR_FORMATS, MODELS, PIPELINE, SERVICES, SETTINGS
from gateway.middleware import build_middleware
from gateway.pipeline import order
from gateway.pipeline.resolve import ModelCatalog
from gateway.pipeline.runner import Pipeline
from gateway.routes import cache_admin, dashboard, health, learn_admin, metrics, openai, shadow, usage
from gateway.services import Services
from gateway.settings import Settings
from gateway.upstream.pool import UpstreamPool
from policies.policy import Policy
from policies.router.tier_prices import unpriced_tier_warnings

log = logging.getLogger(__name__)


def load_policy(settings: Settings) -> Policy:
    return Policy.load(settings.policy_file, extra=settings.policy)


def create_app(settings: Settings | None = None, policy: Policy | None = None) -> web.Application:
    """The gateway as an aiohttp application; components start in its cleanup context."""
    settings = settings or Settings.load()
    policy = policy or load_policy(settings)
    app = web.Application(
        middlewares=[build_middleware(KeyTable(settings.auth))],
        client_max_size=settings.server.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[ERROR_FORMATS] = {}
    openai.add_routes(app)
    messages.add_routes(app)
    batch_openai.add_routes(app)
    batch_messages.add_routes(app)
    responses.add_routes(app)
    health.add_routes(app)
    usage.add_routes(app)
    shadow.add_routes(app)
    cache_admin.add_routes(app)
    learn_admin.add_routes(app)
    metrics.add_routes(app)
    dashboard.add_routes(app)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        pool = UpstreamPool(settings)
        services = Services(settings=settings, policy=policy, pool=pool)
        started: list[object] = []
        pipeline: Pipeline | None = None
        try:
            began = time.perf_counter()
            await pool.start()
            services.startup_s["pool"] = round(time.perf_counter() - began, 3)
            for component in COMPONENTS:
                if component.enabled(settings, policy):
                    began = time.perf_counter()
                    value = await component.build(settings, policy)
                    services.startup_s[component.attribute] = round(time.perf_counter() - began, 3)
                    setattr(services, component.attribute, value)
                    started.append(value)
            for value in started:  # work a component starts once every other one runs
                after_start = getattr(value, "after_start", None)
                if after_start is not None:
                    await after_start(services)
            services.warnings = unpriced_tier_warnings(policy)
            for warning in services.warnings:
                log.warning("%s", warning)
            log.info("started in %.2f s: %s", sum(services.startup_s.values()),
                     ", ".join(f"{k} {v:.2f} s" for k, v in services.startup_s.items()))
            if services.cache is not None and services.telemetry is not None:
                services.telemetry.watch_cache_bounds(services.cache.bounds.stats)
            if services.route_quality is not None and services.telemetry is not None:
                services.telemetry.watch_route_bounds(services.route_quality.stats)
            if pool.has_upstreams() and services.telemetry is not None:
                services.telemetry.watch_flow(pool.flow_stats)
            if services.learn is not None and services.telemetry is not None:
                services.telemetry.watch_learn(services.learn.stats)
            app[SERVICES] = services
            app[MODELS] = ModelCatalog.from_services(services)
            pipeline = app[PIPELINE] = Pipeline(services, order.STAGES, order.HOOKS)
            yield
        finally:
            # First: hooks still finishing (metering, shadow calls) use the components and the pool.
            if pipeline is not None:
                try:
                    await pipeline.close()
                except Exception:
                    log.exception("closing the pipeline failed")
            for value in reversed(started):
                try:
                    await value.close()  # type: ignore[attr-defined]
                except Exception:
                    log.exception("closing %r failed", value)
            await pool.close()

    app.cleanup_ctx.append(lifecycle)
    app.cleanup_ctx.append(batches.lifecycle)  # after the pipeline is built; its runner stops before the pipeline closes
    return app
