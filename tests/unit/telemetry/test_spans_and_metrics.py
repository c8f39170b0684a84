"""Spans follow the GenAI conventions; metrics reach the OTel reader and a parseable, bounded /metrics."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from gateway.context import Outcome, Usage
from gateway.errors import UpstreamError
from telemetry.spans import NoopSpan
from tests.unit.telemetry.conftest import Harness, TelemetryFactory, make_ctx

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def app_for(h: Harness, fail: bool = False) -> web.Application:
    """A real aiohttp app wired the way the gateway wires telemetry: middleware, stage, model call, hook."""
    t = h.telemetry

    @web.middleware
    async def traced(request: web.Request, handler: Any) -> web.StreamResponse:
        with t.server_span(request) as server:
            response = await handler(request)
            server.set_status_code(response.status)
            return response

    async def chat(request: web.Request) -> web.Response:
        tenant = request.query.get("tenant", "acme")
        ctx = make_ctx(tenant=tenant, model="gpt-4o", target_model="gpt-4o", stream=True, cache_status="miss")
        ctx.body["max_tokens"] = 64
        with t.stage_span(ctx, "budget"):
            t.admit(ctx)
        with t.model_span(ctx) as model:
            if fail:
                raise UpstreamError("boom")
            ctx.usage = Usage(input_tokens=120, output_tokens=30, cached_input_tokens=20, cache_write_tokens=7, cache_write_1h_tokens=3)
            ctx.lane_seconds = 0.25
            ctx.first_token_at = ctx.received_at + 0.05
            model.set_response({"id": "chatcmpl-1", "model": "gpt-4o-2024-08-06", "choices": [{"finish_reason": "stop"}]})
        await t.meter(ctx, Outcome(status=200, response={"model": "gpt-4o-2024-08-06"}, complete=True))
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[traced])
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def one_request(client: TestClient, tenant: str = "acme") -> int:
    resp = await client.post(f"/v1/chat/completions?tenant={tenant}", headers={"traceparent": TRACEPARENT})
    return resp.status


async def test_server_stage_and_model_spans(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    h = await make_telemetry()
    assert await one_request(await aiohttp_client(app_for(h))) == 200
    spans = {s.name: s for s in h.spans.get_finished_spans()}
    assert set(spans) == {"POST /v1/chat/completions", "tierlane.budget", "chat gpt-4o"}
    server, stage, model = spans["POST /v1/chat/completions"], spans["tierlane.budget"], spans["chat gpt-4o"]
    assert server.kind == SpanKind.SERVER and model.kind == SpanKind.CLIENT
    # The request joined the caller's trace, and every span is a child of the SERVER span.
    assert format(server.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    assert stage.parent.span_id == server.context.span_id
    assert model.parent.span_id == server.context.span_id
    attrs = model.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "openai"
    assert attrs["gen_ai.request.model"] == "gpt-4o"
    assert attrs["gen_ai.response.model"] == "gpt-4o-2024-08-06"
    assert attrs["gen_ai.response.id"] == "chatcmpl-1"
    assert attrs["gen_ai.usage.input_tokens"] == 120
    assert attrs["gen_ai.usage.output_tokens"] == 30
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 20
    assert attrs["gen_ai.usage.cache_creation.input_tokens"] == 10  # 5-minute and 1-hour writes
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("stop",)
    assert attrs["gen_ai.request.stream"] is True
    assert attrs["gen_ai.request.max_tokens"] == 64
    assert attrs["tierlane.tenant"] == "acme" and attrs["tierlane.lane"] == "upstream"
    # No prompt or answer text unless the operator opts in.
    assert not any("messages" in key for span in spans.values() for key in span.attributes)
    sattrs = server.attributes
    assert sattrs["http.response.status_code"] == 200
    assert sattrs["tierlane.cost_usd"] > 0
    assert sattrs["tierlane.cache.status"] == "miss"
    assert sattrs["tierlane.route.score"] == 0.25
    assert "tierlane.saved.trim_usd" in sattrs


async def test_content_is_recorded_only_when_opted_in(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    h = await make_telemetry(record_content=True)
    await one_request(await aiohttp_client(app_for(h)))
    model = next(s for s in h.spans.get_finished_spans() if s.kind == SpanKind.CLIENT)
    assert "capital of France" in model.attributes["gen_ai.input.messages"]


async def test_errors_mark_spans_and_tracing_off_costs_nothing(
    make_telemetry: TelemetryFactory, aiohttp_client: Any
) -> None:
    h = await make_telemetry()
    assert await one_request(await aiohttp_client(app_for(h, fail=True))) == 500
    by_kind = {s.kind: s for s in h.spans.get_finished_spans()}
    assert by_kind[SpanKind.CLIENT].status.status_code == StatusCode.ERROR
    assert by_kind[SpanKind.CLIENT].attributes["error.type"] == "bad_gateway"
    assert by_kind[SpanKind.SERVER].attributes["http.response.status_code"] == 502

    off = await make_telemetry(tracing=False)
    ctx = make_ctx()
    assert isinstance(off.telemetry.stage_span(ctx, "x"), NoopSpan)
    assert await one_request(await aiohttp_client(app_for(off))) == 200
    assert off.spans.get_finished_spans() == ()


async def test_otel_metrics_follow_the_genai_names(make_telemetry: TelemetryFactory, aiohttp_client: Any) -> None:
    h = await make_telemetry()
    await one_request(await aiohttp_client(app_for(h)))
    points = h.metric_points()
    tokens = {p.attributes["gen_ai.token.type"]: p for p in points["gen_ai.client.token.usage"]}
    assert tokens["input"].sum == 120 and tokens["output"].sum == 30
    assert tokens["input"].attributes["gen_ai.response.model"] == "other"  # unlisted model names are folded
    [duration] = points["gen_ai.client.operation.duration"]
    assert duration.sum == 0.25
    [ttft] = points["gen_ai.server.time_to_first_token"]
    assert abs(ttft.sum - 0.05) < 1e-9
    [cost] = points["tierlane.cost"]
    assert cost.value > 0 and cost.attributes["tierlane.lane"] == "upstream"


async def test_prometheus_output_parses_and_labels_stay_bounded(
    make_telemetry: TelemetryFactory, aiohttp_client: Any
) -> None:
    h = await make_telemetry()
    client = await aiohttp_client(app_for(h))
    for i in range(20):
        await one_request(client, tenant=f"tenant-{i}")
    await one_request(client, tenant="acme")
    families = {f.name: f for f in text_string_to_metric_families(h.telemetry.render_metrics().decode())}
    requests = families["tierlane_requests"]
    tenants = {s.labels["tenant"] for s in requests.samples if s.name == "tierlane_requests_total"}
    assert tenants == {"acme", "other"}
    by_tenant = {s.labels["tenant"]: s.value for s in requests.samples if s.name == "tierlane_requests_total"}
    assert by_tenant == {"acme": 1.0, "other": 20.0}
    for name in (
        "gen_ai_client_token_usage",
        "gen_ai_client_operation_duration_seconds",
        "gen_ai_server_time_to_first_token_seconds",
        "tierlane_request_duration_seconds",
        "tierlane_cost_usd",
        "tierlane_tokens",
    ):
        assert name in families, name
    buckets = [s for s in families["gen_ai_server_time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert buckets and all(s.labels["tenant"] in ("acme", "other") for s in buckets)
