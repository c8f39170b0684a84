"""A response store that fails after the answer loses the record, never the (billed) answer."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from gateway import protocol
from gateway.apis import responses_wire as rw
from gateway.apis.response_store import StoreFailed
from gateway.apis.responses import STORE_HEADER, ResponsesEncoder, ResponsesWire, Turn
from gateway.context import Principal, RequestContext, Usage

ANSWER = {"model": "m", "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi."}}]}


class BrokenStore:
    async def put(self, tenant: str, response_id: str, record: Any) -> None:
        raise StoreFailed("the response store did not answer: TimeoutError", retry_after=1)

    async def get(self, tenant: str, response_id: str) -> None:
        return None

    async def delete(self, tenant: str, response_id: str) -> bool:
        return False

    async def close(self) -> None:
        return None


def turn_and_ctx() -> tuple[Turn, RequestContext]:
    req = protocol.check(rw.ResponsesRequest, {"model": "m", "input": "Hi."})
    turn = Turn(req=req, id="resp_1", created_at=1, tenant="t", inputs=[], store=BrokenStore(), model="m")
    ctx = RequestContext(request_id="r", operation="chat", body={}, headers={}, model="m",
                         principal=Principal(tenant="t", app="a", key_id="k"), usage=Usage(input_tokens=2, output_tokens=1))
    return turn, ctx


def test_a_whole_answer_is_returned_with_store_false_and_a_header():
    turn, ctx = turn_and_ctx()
    response = asyncio.run(ResponsesWire(turn).body(ctx, ANSWER))
    assert response["store"] is False and response["output"][0]["content"][0]["text"] == "Hi."
    assert ctx.response_headers[STORE_HEADER] == "failed" and ctx.attributes["tierlane.responses.store_failed"] is True


def test_a_stream_completes_with_store_false():
    turn, ctx = turn_and_ctx()
    encoder = ResponsesEncoder(ctx, turn)
    raw = encoder.chunk({"model": "m", "choices": [{"index": 0, "delta": {"content": "Hi."}}]}) + asyncio.run(encoder.end(ANSWER))
    events = [orjson.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.split(b"\n\n") if block]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["store"] is False
    assert all(event["type"] != "error" for event in events)
