"""Small aiohttp upstreams that misbehave on purpose (fault injection only)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


def completion(text: str = "hello there", model: str = "fake-model") -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }


def chunk(content: str | None = None, finish: str | None = None, role: str | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "fake-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def frame(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"


@dataclass
class Recorder:
    """What a fault upstream saw: hits, request headers and bodies, and cancelled handlers."""

    hits: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0
    inflight: int = 0
    max_inflight: int = 0


def fault_app(mode: str, rec: Recorder, **opts: Any) -> web.Application:
    """An upstream whose /v1/chat/completions behaves as `mode` says."""

    async def handler(request: web.Request) -> web.StreamResponse:
        rec.hits += 1
        rec.headers.append(dict(request.headers))
        body = await request.json()
        rec.bodies.append(body)
        rec.inflight += 1
        rec.max_inflight = max(rec.max_inflight, rec.inflight)
        try:
            return await _behave(request, body)
        except asyncio.CancelledError:
            rec.cancelled += 1
            raise
        finally:
            rec.inflight -= 1

    async def _behave(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        fail_first = opts.get("fail_first", 10**9)
        if mode == "ok":
            await asyncio.sleep(opts.get("delay", 0))
            return await _ok(request, body)
        if mode == "slow":
            await asyncio.sleep(opts.get("delay", 30))
            return await _ok(request, body)
        if mode == "status":
            if rec.hits <= fail_first:
                headers = {"Retry-After": str(opts["retry_after"])} if "retry_after" in opts else {}
                err = {"error": {"message": f"injected {opts['status']}", "type": "server_error"}}
                return web.json_response(err, status=opts["status"], headers=headers)
            return await _ok(request, body)
        if mode == "reset":
            if rec.hits <= fail_first:
                assert request.transport is not None
                request.transport.abort()
                await asyncio.sleep(1)
                return web.Response()
            return await _ok(request, body)
        if mode == "malformed":
            return web.Response(body=b'{"id": "x", "choices": [', content_type="application/json")
        if mode == "huge":
            return web.json_response(completion("x" * opts.get("size", 40 * 1024 * 1024)))
        if mode == "cut_stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(frame(chunk(role="assistant", content="")))
            await resp.write(frame(chunk(content="partial")))
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
            return resp
        if mode == "slow_stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(frame(chunk(role="assistant", content="")))
            for i in range(opts.get("chunks", 200)):
                await resp.write(frame(chunk(content=f"t{i} ")))
                await asyncio.sleep(opts.get("interval", 0.05))
            await resp.write(frame(chunk(finish="stop")))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        raise AssertionError(mode)

    async def _ok(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        text = opts.get("text", "hello there")
        if not body.get("stream"):
            return web.json_response(completion(text, body.get("model", "fake-model")))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(frame(chunk(role="assistant", content="")))
        for word in text.split(" "):
            await resp.write(frame(chunk(content=word + " ")))
        await resp.write(frame(chunk(finish="stop")))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {**chunk(), "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
            await resp.write(frame(usage))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def embeddings(request: web.Request) -> web.Response:
        rec.hits += 1
        body = await request.json()
        data = [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}]
        return web.json_response({"object": "list", "data": data, "model": body["model"], "usage": {"prompt_tokens": 2, "total_tokens": 2}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/embeddings", embeddings)
    return app
