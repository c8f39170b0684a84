"""Whatever `usage` an upstream reports, metering goes on: counts validated, clamped or estimated; no negative cost."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.assemble import StreamAssembler
from gateway.context import Outcome, Usage
from gateway.lanes import upstream as upstream_lane
from gateway.settings import Settings
from gateway.upstream.pool import UpstreamPool
from policies.policy import Policy
from policies.pricing import Pricing
from telemetry.billing import compute_bill
from tests.unit.telemetry.conftest import Harness, TelemetryFactory, make_ctx

PRICING = Pricing.from_policy(Policy.load())
ANSWER = "Paris is the capital of France."

# Each of these is unusable as a whole: the caller falls back to its local estimate.
UNUSABLE: list[Any] = [
    "lots",
    ["prompt_tokens", 5],
    5,
    True,
    {"total_tokens": 12},
    {"prompt_tokens": "12", "completion_tokens": 3},
    {"prompt_tokens": True, "completion_tokens": 3},
    {"prompt_tokens": math.nan, "completion_tokens": 3},
    {"prompt_tokens": math.inf, "completion_tokens": 3},
    {"prompt_tokens": -math.inf, "completion_tokens": 3},
    {"prompt_tokens": 12.5, "completion_tokens": 3},
    {"prompt_tokens": -900_000, "completion_tokens": 3},
    {"prompt_tokens": 12, "completion_tokens": -1},
    {"prompt_tokens": [12], "completion_tokens": 3},
    {"prompt_tokens": {"n": 12}, "completion_tokens": 3},
]


@pytest.mark.parametrize("usage", UNUSABLE, ids=repr)
def test_an_unusable_usage_report_is_none_and_never_raises(usage: Any) -> None:
    assert Usage.from_openai(usage) is None


@pytest.mark.parametrize("huge", [1e20, 10**30, 1.7e308])
def test_huge_counts_are_clamped_and_marked_estimated(huge: float) -> None:
    usage = Usage.from_openai({"prompt_tokens": huge, "completion_tokens": huge})
    assert usage is not None and usage.estimated
    assert (usage.input_tokens, usage.output_tokens) == (Usage.MAX_TOKENS, Usage.MAX_TOKENS)
    assert type(usage.input_tokens) is int and type(usage.output_tokens) is int


@pytest.mark.parametrize(
    ("details", "cached"),
    [
        ("garbage", 0),
        ([16], 0),
        (16, 0),
        ({"cached_tokens": "16"}, 0),
        ({"cached_tokens": -16}, 0),
        ({"cached_tokens": math.nan}, 0),
        ({"cached_tokens": 10**30}, 37),  # clamped to the input tokens
    ],
    ids=repr,
)
def test_malformed_prompt_details_keep_the_counts_but_no_discount(details: Any, cached: int) -> None:
    usage = Usage.from_openai({"prompt_tokens": 37, "completion_tokens": 7, "prompt_tokens_details": details})
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.cached_input_tokens, usage.estimated) == (37, 7, cached, True)


def test_a_well_formed_report_is_taken_as_it_is() -> None:
    # Guard: the validation must not flag what OpenAI sends (integral floats included).
    usage = Usage.from_openai(
        {"prompt_tokens": 37, "completion_tokens": 7.0, "total_tokens": 44, "prompt_tokens_details": {"cached_tokens": 16}}
    )
    assert usage == Usage(input_tokens=37, output_tokens=7, cached_input_tokens=16, estimated=False)
    assert type(usage.output_tokens) is int
    assert Usage.from_openai({"prompt_tokens": 9, "total_tokens": 9}) == Usage(input_tokens=9)  # embeddings
    assert Usage.from_openai({"prompt_tokens": 9, "completion_tokens": 0, "prompt_tokens_details": None}) == Usage(
        input_tokens=9
    )


@pytest.mark.parametrize("lane", ["upstream", "edge", "cache"])
def test_cost_is_never_negative(lane: str) -> None:
    ctx = make_ctx(lane=lane, model="gpt-4o", target_model="gpt-4o")
    bill = compute_bill(ctx, Usage(input_tokens=-5_000_000, output_tokens=-1_000_000, cached_input_tokens=-3), PRICING)
    assert bill.cost >= 0.0
    assert bill.saved_cache >= 0.0 and bill.saved_edge >= 0.0 and bill.saved_trim >= 0.0


def usage_upstream(usage: Any) -> web.Application:
    """A real OpenAI-compatible server that reports `usage` verbatim, streamed or not."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(
                {"id": "c1", "object": "chat.completion", "model": body["model"], "usage": usage,
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "stop"}]}
            )  # fmt: skip
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunks = [
            {"id": "c1", "object": "chat.completion.chunk", "model": body["model"],
             "choices": [{"index": 0, "delta": {"content": ANSWER}, "finish_reason": "stop"}]},
            {"id": "c1", "object": "chat.completion.chunk", "model": body["model"], "choices": [], "usage": usage},
        ]  # fmt: skip
        for chunk in chunks:
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def ask(h: Harness, url: str, *, stream: bool, request_id: str) -> dict[str, Any]:
    settings = Settings.load(env={}, overrides={"upstreams": [{"name": "u", "base_url": url, "retries": 0}]})
    pool = UpstreamPool(settings)
    await pool.start()
    try:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "capital of France?"}], "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        ctx = make_ctx(request_id=request_id, body=body, stream=stream, target_model="gpt-4o-mini")
        ctx.pool = "default"
        answer = await upstream_lane.answer(pool, ctx)
        if answer.chunks is not None:
            assembler = StreamAssembler()
            async for chunk in answer.chunks:
                assembler.add(chunk)
            response = assembler.response()
        else:
            response = answer.body or {}
        await h.telemetry.meter(ctx, Outcome(status=200, response=response, complete=True))
    finally:
        await pool.close()
    assert h.telemetry.ledger.flush(timeout=5.0)
    [row] = h.telemetry.ledger.read("SELECT * FROM requests WHERE request_id = ?", (request_id,))
    return dict(row)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 1e20, "completion_tokens": 7},
        {"prompt_tokens": -1_000_000, "completion_tokens": -500_000},
        {"prompt_tokens": 37, "completion_tokens": "seven", "prompt_tokens_details": "none"},
        "lots",
        [37, 7],
    ],
    ids=repr,
)
async def test_bad_upstream_usage_is_metered_sanely_and_the_ledger_keeps_writing(
    make_telemetry: TelemetryFactory, aiohttp_server: Any, usage: Any, stream: bool
) -> None:
    h = await make_telemetry()
    server = await aiohttp_server(usage_upstream(usage), host="127.0.0.1")
    url = f"http://127.0.0.1:{server.port}/v1"
    row = await ask(h, url, stream=stream, request_id="bad")
    assert row["estimated"] == 1
    assert 0 <= row["input_tokens"] <= Usage.MAX_TOKENS and 0 <= row["output_tokens"] <= Usage.MAX_TOKENS
    assert row["cost"] >= 0.0
    # The writer is still alive and nothing was dropped: the next request is recorded too.
    good = await aiohttp_server(usage_upstream({"prompt_tokens": 37, "completion_tokens": 7}), host="127.0.0.1")
    after = await ask(h, f"http://127.0.0.1:{good.port}/v1", stream=stream, request_id="good")
    assert (after["input_tokens"], after["output_tokens"], after["estimated"]) == (37, 7, 0)
    assert h.telemetry.ledger.failed == 0
