"""Small aiohttp upstreams that misbehave on purpose (fault injection only)."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from aiohttp import web

from tests.support.background import BackgroundLoop


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
    # GET /v1/models (only with `models_route=True`): when each came, what it gets, how late; while
    # `models_held` is true an answer waits (a probe kept in flight until the test lets it go)
    models_gets: list[float] = field(default_factory=list)
    models_status: int = 200
    models_delay: float = 0.0
    models_held: bool = False
    # GET /metrics: this Prometheus text (404 while None), as a server with metrics on answers it
    metrics: str | None = None
    metrics_gets: int = 0


HOLD_MAX_S = 60.0  # a hold nobody releases ends here: the test then fails on what it checks, it does not hang


async def _until(condition: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + HOLD_MAX_S
    while not condition() and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110 - polls the test's state
        await asyncio.sleep(0.005)


def ask_then_leave(bg: BackgroundLoop, url: str, body: dict[str, Any], rec: Recorder, within: float = 60.0) -> None:
    """POST `body` to `url` and disconnect once the upstream `rec` records has read the request (not
    after a client timeout, which a slow machine may reach before the gateway even forwarded it)."""

    async def go() -> None:
        asked = len(rec.bodies)  # appended once the body is read, right before the handler's `try`
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        async with httpx.AsyncClient(timeout=within) as client:
            request = asyncio.ensure_future(client.post(url, json=body))
            try:
                while len(rec.bodies) == asked:
                    assert not request.done(), f"answered before the upstream was asked: {request.result()}"
                    assert loop.time() < deadline, "the request never reached the upstream"
                    await asyncio.sleep(0.005)
            finally:
                request.cancel()  # the client leaves: httpx closes the connection it was reading
                with contextlib.suppress(asyncio.CancelledError):
                    await request

    bg.call(go())


def fault_app(mode: str, rec: Recorder, **opts: Any) -> web.Application:
    """An upstream whose /v1/chat/completions behaves as `mode` says.

    With `models_route=True` it also serves GET /v1/models (an empty list, with the status
    `rec.models_status` holds, after `rec.models_delay` seconds and once `rec.models_held` is
    false), noting each in `rec.models_gets`. In mode "ok", `hold_until` (a callable) keeps each
    answer until it returns true (at most HOLD_MAX_S): a barrier the test sets, not a delay.
    """

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
            if "hold_until" in opts:
                await _until(opts["hold_until"])
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
        if mode == "body":  # a 200 with opts["body"]: raw bytes, or anything JSON can say
            raw = opts["body"]
            return web.Response(body=raw if isinstance(raw, bytes) else orjson.dumps(raw), content_type="application/json")
        if mode == "bad_stream":  # a good first chunk, then the data of opts["bad"] (bytes or JSON)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(frame(chunk(role="assistant", content="")))
            await resp.write(frame(chunk(content="fine ")))
            await resp.write(frame(opts["bad"]))
            await resp.write(frame(chunk(finish="stop")))
            await resp.write(b"data: [DONE]\n\n")
            return resp
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

    async def models(request: web.Request) -> web.Response:
        rec.models_gets.append(time.monotonic())
        await asyncio.sleep(rec.models_delay)
        await _until(lambda: not rec.models_held)
        return web.json_response({"object": "list", "data": []}, status=rec.models_status)

    async def metrics(request: web.Request) -> web.Response:
        rec.metrics_gets += 1
        if rec.metrics is None:
            return web.Response(status=404, text="metrics are off")
        return web.Response(text=rec.metrics, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/metrics", metrics)
    if opts.get("models_route"):
        app.router.add_get("/v1/models", models)
    return app


class BlackHole:
    """A 127.0.0.1 port where connecting hangs: a listening socket that never accepts.

    Its accept queue is filled first (backlog 0, plus the connections it took), so the
    kernel drops every further SYN and a client's connect attempt runs into its timeout.
    """

    def __init__(self) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        self.port = self._listener.getsockname()[1]
        self._fillers: list[socket.socket] = []
        for _ in range(64):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probe.setblocking(False)
            probe.connect_ex(("127.0.0.1", self.port))
            _, writable, _ = select.select([], [probe], [], 0.3)
            if not writable:  # this SYN was dropped: the queue is full
                probe.close()
                return
            self._fillers.append(probe)
        raise RuntimeError("could not fill the accept queue of the black-hole listener")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        for sock in self._fillers:
            sock.close()
        self._listener.close()
