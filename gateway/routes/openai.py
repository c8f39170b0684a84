"""The OpenAI-compatible endpoints: translate wire ⇄ RequestContext and nothing more."""

from __future__ import annotations

import time

from aiohttp import web

from gateway import protocol
from gateway.context import Operation, Outcome, RequestContext
from gateway.errors import GatewayError, PayloadTooLarge
from gateway.keys import CONTEXT, PIPELINE, PRINCIPAL, RECEIVED_AT, REQUEST_ID, RESOLVER, SETTINGS
from gateway.respond import deliver


async def _read(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"the request body is larger than the limit of {limit} bytes")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"the request body is larger than the limit of {limit} bytes") from None


async def _handle(request: web.Request, operation: Operation) -> web.StreamResponse:
    app = request.app
    settings = app[SETTINGS]
    body = protocol.parse_body(await _read(request, settings.server.max_body_bytes))
    protocol.validate(operation, body, max_n=settings.server.max_n)
    ctx = RequestContext(
        request_id=request[REQUEST_ID],
        operation=operation,
        body=body,
        headers=request.headers,
        principal=request[PRINCIPAL],
        model=body["model"],
        stream=bool(body.get("stream")) and operation != "embeddings",
        received_at=request[RECEIVED_AT],
    )
    request[CONTEXT] = ctx
    app[RESOLVER].resolve(ctx)
    pipeline = app[PIPELINE]
    try:
        answer = await pipeline.answer(ctx)
    except GatewayError as exc:
        pipeline.complete(ctx, Outcome(status=exc.status, response=None, complete=False, error_code=exc.code or exc.type))
        raise
    return await deliver(request, ctx, answer, pipeline)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completions")


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "embeddings")


async def list_models(request: web.Request) -> web.Response:
    return web.json_response(
        {"object": "list", "data": request.app[RESOLVER].listing()},
        headers={
            "x-request-id": request[REQUEST_ID],
            "x-tierlane-lane": "none",
            "x-tierlane-overhead-ms": f"{(time.perf_counter() - request[RECEIVED_AT]) * 1000:.3f}",
        },
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", list_models)
