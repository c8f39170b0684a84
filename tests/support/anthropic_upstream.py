"""An upstream that serves the Messages API itself (as vLLM and Anthropic do), recording what it gets."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from tests.support.faults import Recorder

TEXT = "Paris is the capital."
TOOL_USE_ID = "toolu_fixture"
TOOL_INPUT = {"city": "Paris"}
USAGE = {"input_tokens": 11, "output_tokens": 5, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0}
ERROR_TYPES = {529: "overloaded_error", 500: "api_error", 429: "rate_limit_error", 400: "invalid_request_error"}


def _event(data: dict[str, Any]) -> bytes:
    return b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _calls_tool(body: dict[str, Any]) -> bool:
    """Whether the request offers tools and the conversation's last turn holds no tool result."""
    last = (body.get("messages") or [{}])[-1].get("content")
    answered = isinstance(last, list) and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in last)
    return bool(body.get("tools")) and not answered


def anthropic_app(rec: Recorder, usage: dict[str, Any] | None = None, call_tools: bool = False,
                  fail: str | None = None, status: int = 529, fail_first: int = 10**9,
                  retry_after: str | None = None) -> web.Application:
    """Answers every /v1/messages with a thinking block and TEXT, as JSON or as Anthropic's events,
    reporting `usage` (USAGE unless given). With `call_tools`, a request offering tools whose last
    turn holds no tool result is answered with a call of its first tool (TOOL_INPUT) instead of TEXT.

    `fail` makes the first `fail_first` requests fail as Anthropic does when overloaded (`status`
    529) or broken (500): "status" answers that status with its error body (and `retry_after`);
    "before_content" streams `message_start` then an error event; "after_content" streams a first
    piece of text, then the error event."""
    reported = usage or USAGE

    async def messages(request: web.Request) -> web.StreamResponse:
        rec.hits += 1
        rec.headers.append(dict(request.headers))
        body = await request.json()
        rec.bodies.append(body)
        message = {"id": "msg_native", "type": "message", "role": "assistant", "model": body["model"],
                   "content": [{"type": "thinking", "thinking": "Easy.", "signature": "sig"}, {"type": "text", "text": TEXT}],
                   "stop_reason": "end_turn", "stop_sequence": None, "usage": reported}
        if fail is not None and rec.hits <= fail_first:
            return await _fail(request, body, message)
        if call_tools and _calls_tool(body):
            return await _tool_use(request, body, message)
        if not body.get("stream"):
            return web.json_response(message)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = {**message, "content": [], "stop_reason": None, "usage": {**reported, "output_tokens": 1}}
        await resp.write(_event({"type": "message_start", "message": start}))
        await resp.write(_event({"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "thinking", "thinking": "", "signature": ""}}))
        await resp.write(_event({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Easy."}}))
        await resp.write(_event({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}}))
        await resp.write(_event({"type": "content_block_stop", "index": 0}))
        await resp.write(_event({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}))
        for piece in ("Paris ", "is the ", "capital."):
            await resp.write(_event({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": piece}}))
        await resp.write(_event({"type": "content_block_stop", "index": 1}))
        await resp.write(_event({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                 "usage": {"output_tokens": reported["output_tokens"]}}))
        await resp.write(_event({"type": "message_stop"}))
        return resp

    async def _tool_use(request: web.Request, body: dict[str, Any], message: dict[str, Any]) -> web.StreamResponse:
        use = {"type": "tool_use", "id": TOOL_USE_ID, "name": body["tools"][0]["name"], "input": TOOL_INPUT}
        message = {**message, "content": [use], "stop_reason": "tool_use"}
        if not body.get("stream"):
            return web.json_response(message)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = {**message, "content": [], "stop_reason": None, "usage": {**reported, "output_tokens": 1}}
        arguments = orjson.dumps(TOOL_INPUT).decode()
        await resp.write(_event({"type": "message_start", "message": start}))
        await resp.write(_event({"type": "content_block_start", "index": 0, "content_block": {**use, "input": {}}}))
        for piece in (arguments[:5], arguments[5:]):
            await resp.write(_event({"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "input_json_delta", "partial_json": piece}}))
        await resp.write(_event({"type": "content_block_stop", "index": 0}))
        await resp.write(_event({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                 "usage": {"output_tokens": reported["output_tokens"]}}))
        await resp.write(_event({"type": "message_stop"}))
        return resp

    async def _fail(request: web.Request, body: dict[str, Any], message: dict[str, Any]) -> web.StreamResponse:
        error = {"type": "error", "error": {"type": ERROR_TYPES[status], "message": f"injected {status}"}}
        if fail == "status" or not body.get("stream"):
            headers = {"Retry-After": retry_after} if retry_after is not None else {}
            return web.json_response(error, status=status, headers=headers)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = {**message, "content": [], "stop_reason": None, "usage": {**reported, "output_tokens": 1}}
        await resp.write(_event({"type": "message_start", "message": start}))
        await resp.write(_event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}))
        await resp.write(_event({"type": "ping"}))
        if fail == "after_content":
            await resp.write(_event({"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": "Paris "}}))
        await resp.write(_event(error))
        return resp

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    return app
