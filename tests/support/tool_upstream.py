"""A chat upstream that asks for a tool, then answers from the tool's result.

Only for the tool round trips of the front-door tests: the bundled SmolLM2-135M behind
llama.cpp's server does not produce tool calls reliably, so a real model cannot drive them.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from tests.support.faults import Recorder, frame

TOOL = "get_weather"
ARGUMENTS = '{"city": "Paris"}'


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-tool", "object": "chat.completion.chunk", "created": 1, "model": "tool-model",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def tool_app(rec: Recorder) -> web.Application:
    """Asks for `get_weather` unless the last message is a tool result, which it repeats in its answer."""

    async def handler(request: web.Request) -> web.StreamResponse:
        rec.hits += 1
        body = await request.json()
        rec.bodies.append(body)
        last = body["messages"][-1]
        if last["role"] == "tool":
            message: dict[str, Any] = {"role": "assistant", "content": f"It is {last['content']}."}
            finish = "stop"
        else:
            call = {"id": "call_1", "type": "function", "function": {"name": TOOL, "arguments": ARGUMENTS}}
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            finish = "tool_calls"
        usage = {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}
        if not body.get("stream"):
            return web.json_response({"id": "chatcmpl-tool", "object": "chat.completion", "created": int(time.time()),
                                      "model": "tool-model", "usage": usage,
                                      "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(frame(_chunk({"role": "assistant", "content": ""})))
        if message.get("tool_calls"):
            head = {"index": 0, "id": "call_1", "type": "function", "function": {"name": TOOL, "arguments": ""}}
            await resp.write(frame(_chunk({"tool_calls": [head]})))
            for piece in (ARGUMENTS[:8], ARGUMENTS[8:]):
                await resp.write(frame(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})))
        else:
            words = message["content"].split(" ")
            for i, word in enumerate(words):
                await resp.write(frame(_chunk({"content": word if i == len(words) - 1 else word + " "})))
        await resp.write(frame(_chunk({}, finish)))
        await resp.write(frame({**_chunk({}), "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return app


def weather(arguments: Any) -> str:
    args = orjson.loads(arguments) if isinstance(arguments, str) else arguments
    return f"sunny in {args['city']}"
