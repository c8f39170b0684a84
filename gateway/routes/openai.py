"""The OpenAI-compatible endpoints: translate wire ⇄ RequestContext and nothing more."""

from __future__ import annotations

import time
import zlib
from typing import Any

from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from gateway import protocol
from gateway.caller import Caller
from gateway.context import RequestContext, WireOperation
from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.keys import BODY_BYTES, MODELS, RECEIVED_AT, REQUEST_ID, SETTINGS
from gateway.respond import serve
from gateway.session import SESSION_ATTRIBUTE, SESSION_HEADER, session_key


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes (else 413); an unreadable encoding is a 400. Its size is
    kept on the request (BODY_BYTES)."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"the request body is larger than the limit of {limit} bytes")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"the request body is larger than the limit of {limit} bytes") from None
    except (web.HTTPException, RequestPayloadError, HttpProcessingError, ClientPayloadError, zlib.error, ValueError, EOFError) as exc:
        # NOTE: aiohttp inflates gzip/deflate bodies while reading; garbage raises from deep
        # inside the decompressor (a 500 before) or as its own plain-text 400.
        encoding = request.headers.get("Content-Encoding", "identity")
        raise InvalidRequest(
            f"the request body could not be read as Content-Encoding {encoding!r}: {exc}",
            code="invalid_body_encoding",
        ) from None
    request[BODY_BYTES] = len(raw)  # what a stage that needs the body's size reads, instead of serialising it again
    return raw


def openai_context(caller: Caller, operation: WireOperation, body: dict[str, Any]) -> RequestContext:
    """The context of an OpenAI endpoint's request: `body` (parsed and bounded) validated for `operation`."""
    wire = protocol.validate(operation, body, max_n=caller.settings.server.max_n)
    ctx = RequestContext(
        request_id=caller.request_id,
        operation=operation,
        body=body,
        headers=caller.headers,
        principal=caller.principal,
        model=wire.model,
        stream=wire.stream,
        api=operation,
        received_at=caller.received_at,
        request=wire,
        # a conversation's key: the header, else the client's own prompt-cache key
        session=session_key(caller.headers.get(SESSION_HEADER), body.get("prompt_cache_key")),
    )
    if ctx.session is not None:
        ctx.attributes[SESSION_ATTRIBUTE] = ctx.session
    return ctx


async def _handle(request: web.Request, operation: WireOperation) -> web.StreamResponse:
    server = request.app[SETTINGS].server
    body = protocol.parse_body(await read_body(request, server.max_body_bytes), server.max_items)
    return await serve(request, openai_context(Caller.of(request), operation, body))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completions")


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "embeddings")


async def list_models(request: web.Request) -> web.Response:
    return web.json_response(
        {"object": "list", "data": request.app[MODELS].listing()},
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
