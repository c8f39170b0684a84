"""Metered usage of upstream answers, streamed or not, equals what the upstream reported; without a report it is estimated."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.assemble import StreamAssembler
from gateway.context import Outcome
from gateway.lanes import upstream as upstream_lane
from gateway.settings import Settings
from gateway.upstream.pool import UpstreamPool
from policies.errors import LimitExceeded as RateLimited
from tests.unit.telemetry.conftest import Harness, TelemetryFactory, make_ctx

WORDS = ["Paris", " is", " the", " capital", " of", " France", "."]


def upstream_app(report_usage: bool) -> web.Application:
    """A real OpenAI-compatible server with its own token counts (deliberately unlike any estimate)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        usage = {"prompt_tokens": 37, "completion_tokens": len(WORDS), "total_tokens": 37 + len(WORDS),
                 "prompt_tokens_details": {"cached_tokens": 16}}  # fmt: skip
        if not body.get("stream"):
            answer = {"id": "c1", "object": "chat.completion", "model": body["model"],
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(WORDS)},
                                   "finish_reason": "stop"}]}  # fmt: skip
            if report_usage:
                answer["usage"] = usage
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in WORDS:
            chunk = {"id": "c1", "object": "chat.completion.chunk", "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}  # fmt: skip
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        last = {"id": "c1", "object": "chat.completion.chunk", "model": body["model"],
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}  # fmt: skip
        await resp.write(b"data: " + orjson.dumps(last) + b"\n\n")
        if report_usage and (body.get("stream_options") or {}).get("include_usage"):
            tail = {"id": "c1", "object": "chat.completion.chunk", "model": body["model"], "choices": [], "usage": usage}
            await resp.write(b"data: " + orjson.dumps(tail) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def ask(h: Harness, url: str, *, stream: bool, request_id: str = "r1") -> dict[str, Any]:
    settings = Settings.load(env={}, overrides={"upstreams": [{"name": "u", "base_url": url, "retries": 0}]})
    pool = UpstreamPool(settings)
    await pool.start()
    try:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "capital of France?"}], "stream": stream}
        ctx = make_ctx(request_id=request_id, body=body, stream=stream, target_model="gpt-4o-mini")
        ctx.pool = "default"
        h.telemetry.admit(ctx)
        answer = await upstream_lane.answer(pool, ctx)
        if answer.chunks is not None:
            assembler = StreamAssembler()
            async for chunk in answer.chunks:
                assembler.add(chunk)
                h.telemetry.charge_chunk(ctx, chunk)
            response = assembler.response()
        else:
            response = answer.body or {}
        await h.telemetry.meter(ctx, Outcome(status=200, response=response, complete=True))
    finally:
        await pool.close()
    h.telemetry.ledger.flush()
    [row] = h.telemetry.ledger.read("SELECT * FROM requests WHERE request_id = ?", (request_id,))
    return dict(row)


@pytest.mark.parametrize("stream", [False, True])
async def test_metered_usage_equals_the_upstreams(make_telemetry: TelemetryFactory, aiohttp_server: Any, stream: bool) -> None:
    h = await make_telemetry()
    server = await aiohttp_server(upstream_app(report_usage=True), host="127.0.0.1")
    row = await ask(h, f"http://127.0.0.1:{server.port}/v1", stream=stream)
    assert (row["input_tokens"], row["output_tokens"], row["cached_input_tokens"]) == (37, len(WORDS), 16)
    assert row["estimated"] == 0 and row["stream"] == int(stream)
    price = h.telemetry.pricing.upstream("gpt-4o-mini")
    assert row["cost"] == pytest.approx((21 * price.input + 16 * price.cached_input + 7 * price.output) / 1e6)


@pytest.mark.parametrize("stream", [False, True])
async def test_missing_upstream_usage_is_estimated_and_marked(
    make_telemetry: TelemetryFactory, aiohttp_server: Any, stream: bool
) -> None:
    h = await make_telemetry()
    server = await aiohttp_server(upstream_app(report_usage=False), host="127.0.0.1")
    row = await ask(h, f"http://127.0.0.1:{server.port}/v1", stream=stream)
    assert row["estimated"] == 1
    assert row["input_tokens"] > 0 and row["output_tokens"] > 0


async def test_stream_is_stopped_when_its_tokens_pass_the_limit(make_telemetry: TelemetryFactory, aiohttp_server: Any) -> None:
    # The request's estimate (~10 tokens) fits; the streamed answer pushes the tenant past 12 tokens a minute.
    h = await make_telemetry(policy={"budgets": {"tenant": {"tokens_per_minute": 12}}})
    server = await aiohttp_server(upstream_app(report_usage=True), host="127.0.0.1")
    with pytest.raises(RateLimited) as err:
        await ask(h, f"http://127.0.0.1:{server.port}/v1", stream=True)
    assert "stream stopped" in err.value.message
