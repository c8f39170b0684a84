"""Fixtures for the telemetry tests: a Telemetry with in-memory exporters, request contexts, a clock."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.context import Principal, RequestContext, RouteDecision
from policies.policy import Policy
from telemetry import Telemetry, TelemetryConfig
from telemetry.tokens import heuristic_count


class Clock:
    """A clock the test moves by hand: monotonic seconds and a wall clock in step."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.wall0 = time.time()

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.wall0 + (self.now - 1000.0)

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_ctx(
    *,
    request_id: str = "req_1",
    tenant: str = "acme",
    app: str = "web",
    model: str = "gpt-4o-mini",
    lane: str = "upstream",
    body: dict[str, Any] | None = None,
    stream: bool = False,
    **fields: Any,
) -> RequestContext:
    body = body or {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    ctx = RequestContext(
        request_id=request_id,
        operation="chat",
        body=body,
        headers={},
        principal=Principal(tenant=tenant, app=app),
        model=model,
        stream=stream,
        lane=lane,
        **fields,
    )
    if ctx.route is None:
        ctx.route = RouteDecision(lane=lane, score=0.25, reason="router")
    return ctx


@pytest.fixture
def ctx_factory() -> Callable[..., RequestContext]:
    return make_ctx


@dataclass
class Harness:
    """A started Telemetry and the in-memory exporters it writes to."""

    telemetry: Telemetry
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader

    def metric_points(self) -> dict[str, list[Any]]:
        data = self.metrics.get_metrics_data()
        out: dict[str, list[Any]] = {}
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    out.setdefault(metric.name, []).extend(metric.data.data_points)
        return out


TelemetryFactory = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def make_telemetry(tmp_path: Path, clock: Clock) -> AsyncIterator[TelemetryFactory]:
    """`await make_telemetry(policy=..., **config)`: started, with in-memory span exporter and metric reader."""
    made: list[Telemetry] = []

    async def factory(policy: dict[str, Any] | None = None, **config: Any) -> Harness:
        settings = {
            "state_dir": tmp_path / "state",
            "tenants": ("acme",),
            "apps": ("web",),
            "commit_window_s": 0.05,
            **config,
        }
        spans, metrics = InMemorySpanExporter(), InMemoryMetricReader()
        telemetry = Telemetry(
            TelemetryConfig(**settings),
            Policy.load(extra=policy),
            env={},
            span_exporter=spans,
            metric_reader=metrics,
            token_count=heuristic_count,
            wall=clock.wall,
            monotonic=clock.monotonic,
        )
        made.append(telemetry)
        await telemetry.start()
        return Harness(telemetry, spans, metrics)

    yield factory
    for telemetry in made:
        await telemetry.close()


def tenant_budgets(**tenant: float) -> Any:
    """Budgets with these limits on the tenant scope (policies.budgets.Budgets)."""
    from policies.budgets import Budgets

    return Budgets(Policy.load(extra={"budgets": {"enabled": True, "tenant": tenant}}))


@pytest.fixture
async def client(valkey: Any) -> AsyncIterator[Any]:
    """A plain redis client on the test's Valkey server (to look at or pause the store)."""
    import redis.asyncio as aioredis

    c = aioredis.Redis.from_url(valkey.url)
    yield c
    await c.aclose()
