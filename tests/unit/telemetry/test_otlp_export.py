"""OTLP/HTTP export, configured only by OTEL_* variables, reaches a local receiver that decodes the protobuf."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from gateway.context import Outcome, Usage
from policies.policy import Policy
from telemetry import Telemetry, TelemetryConfig
from telemetry.tokens import heuristic_count
from tests.unit.telemetry.conftest import make_ctx


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind)


async def test_spans_and_metrics_reach_an_otlp_receiver(tmp_path: Path, aiohttp_server: Any) -> None:
    traces: list[ExportTraceServiceRequest] = []
    metrics: list[ExportMetricsServiceRequest] = []
    headers: list[str] = []

    async def receive_traces(request: web.Request) -> web.Response:
        headers.append(request.headers.get("x-tenant-key", ""))
        traces.append(ExportTraceServiceRequest.FromString(await request.read()))
        return web.Response(status=200)

    async def receive_metrics(request: web.Request) -> web.Response:
        metrics.append(ExportMetricsServiceRequest.FromString(await request.read()))
        return web.Response(status=200)

    receiver = web.Application()
    receiver.router.add_post("/v1/traces", receive_traces)
    receiver.router.add_post("/v1/metrics", receive_metrics)
    server = await aiohttp_server(receiver, host="127.0.0.1")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.port}",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant-key=s3cret",
        "OTEL_SERVICE_NAME": "tierlane-test",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
        "OTEL_METRIC_EXPORT_INTERVAL": "600000",
    }
    telemetry = Telemetry(
        TelemetryConfig(state_dir=tmp_path, tenants=("acme",)), Policy.load(), env=env, token_count=heuristic_count
    )
    await telemetry.start()
    ctx = make_ctx(lane="edge", target_model="edge", model="auto")
    with telemetry.model_span(ctx):
        ctx.usage = Usage(input_tokens=11, output_tokens=7)
        ctx.lane_seconds = 0.1
    await telemetry.meter(ctx, Outcome(status=200, response=None, complete=True))
    await telemetry.close()  # the exporters run on their own threads; close flushes both
    for _ in range(50):
        if traces and metrics:
            break
        await asyncio.sleep(0.1)

    spans = [s for t in traces for rs in t.resource_spans for ss in rs.scope_spans for s in ss.spans]
    [span] = spans
    assert span.name == "chat edge"
    attrs = {kv.key: _value(kv.value) for kv in span.attributes}
    assert attrs["gen_ai.provider.name"] == "llama.cpp"
    assert attrs["gen_ai.usage.input_tokens"] == 11 and attrs["gen_ai.usage.output_tokens"] == 7
    resource = {kv.key: _value(kv.value) for kv in traces[0].resource_spans[0].resource.attributes}
    assert resource["service.name"] == "tierlane-test"
    assert resource["deployment.environment"] == "test"
    assert headers[0] == "s3cret"

    names = {m.name for req in metrics for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert {"gen_ai.client.token.usage", "gen_ai.client.operation.duration", "tierlane.saved"} <= names
