"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a front door.

A Messages request becomes the chat-completions body an equivalent chat request would send, so
every stage (and the cache key) sees the same question whichever API asked it; the chat answer
comes back as a Message, or as Anthropic's stream events. Errors keep Anthropic's shape.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from gateway import protocol
from gateway.apis.common import (
    answer_usage,
    arguments_object,
    chat_context,
    field_record,
    first_choice,
    new_id,
    read_json,
    sse,
    tool_calls,
)
from gateway.apis.messages_wire import CountTokensRequest, MessagesRequest, to_chat
from gateway.apis.native import MESSAGES
from gateway.caller import Caller
from gateway.context import RequestContext, Usage
from gateway.errors import GatewayError, as_gateway_error, render_unexpected
from gateway.keys import ERROR_FORMATS, PIPELINE
from gateway.respond import StreamEncoder, answer_headers, serve
from gateway.session import session_key
from policies.domain import Outcome
from policies.errors import PolicyError
from telemetry.tokens import estimate_request_tokens

# Chat finish reasons as Anthropic stop reasons.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                "content_filter": "refusal"}


# Answers -----------------------------------------------------------------------------------


def usage_block(usage: Usage) -> dict[str, int]:
    """Anthropic's usage: input_tokens excludes the tokens read from and written to a prompt cache."""
    cached = min(usage.cached_input_tokens, usage.input_tokens)
    written = min(usage.cache_write_tokens + usage.cache_write_1h_tokens, usage.input_tokens - cached)
    return {
        "input_tokens": usage.input_tokens - cached - written,
        "output_tokens": usage.output_tokens,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
    }


def to_message(ctx: RequestContext, body: dict[str, Any], message_id: str) -> dict[str, Any]:
    """A chat answer as a Message."""
    message, reason = first_choice(body)
    content: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for call_id, name, arguments in tool_calls(message):
        content.append({"type": "tool_use", "id": call_id, "name": name, "input": arguments_object(arguments)})
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.client_model or body.get("model") or ctx.model,
        "content": content,
        "stop_reason": STOP_REASONS.get(reason or "stop", "end_turn"),
        "stop_sequence": None,
        "usage": usage_block(answer_usage(ctx, body)),
    }


class MessagesEncoder:
    """Chat chunks as Anthropic's events: message_start, content blocks, message_delta, message_stop."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self.id = new_id("msg_")
        self.started = False
        self.blocks = 0  # content blocks opened so far
        self.open: int | None = None  # the index of the block still open
        self.open_text = False
        self.tools: dict[int, int] = {}  # chat tool call index -> content block index
        self.native = False  # the events come from an upstream that serves the Messages API

    def _start(self, model: Any) -> bytes:
        self.started = True
        usage = usage_block(self.ctx.usage or Usage())  # known at once only for cache hits
        usage["output_tokens"] = 0
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant",
                                   "model": self.ctx.client_model or model or self.ctx.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage}
        return sse("message_start", {"type": "message_start", "message": message})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        index, self.open, self.open_text = self.open, None, False
        return sse("content_block_stop", {"type": "content_block_stop", "index": index})

    def _open(self, block: dict[str, Any]) -> bytes:
        closed = self._close()
        self.open = index = self.blocks
        self.blocks += 1
        return closed + sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        native = chunk.get("native")
        if native is not None:  # an upstream serving the Messages API: its own events, as they come
            self.native = True
            if native.get("type") == "message_start" and isinstance(native.get("message"), dict) and self.ctx.client_model:
                native = {**native, "message": {**native["message"], "model": self.ctx.client_model}}
            return sse(str(native.get("type")), native)
        out = [] if self.started else [self._start(chunk.get("model"))]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if not self.open_text:
                    out.append(self._open({"type": "text", "text": ""}))
                    self.open_text = True
                out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.open,
                                                       "delta": {"type": "text_delta", "text": text}}))
            for call in delta.get("tool_calls") or ():
                position = call.get("index", 0)
                function = call.get("function") or {}
                if position not in self.tools:
                    block: dict[str, Any] = {"type": "tool_use", "id": call.get("id") or new_id("toolu_"), "name": function.get("name") or "",
                             "input": {}}
                    out.append(self._open(block))
                    self.tools[position] = self.blocks - 1
                if function.get("arguments"):
                    out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.tools[position],
                                                           "delta": {"type": "input_json_delta",
                                                                     "partial_json": function["arguments"]}}))
        return b"".join(out)

    async def end(self, response: dict[str, Any]) -> bytes:
        if self.native:
            return b""  # message_stop came from the upstream
        out = [] if self.started else [self._start(response.get("model"))]
        out.append(self._close())
        _, reason = first_choice(response)
        delta = {"stop_reason": STOP_REASONS.get(reason or "stop", "end_turn"), "stop_sequence": None}
        usage = usage_block(answer_usage(self.ctx, response))
        out.append(sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def error(self, err: GatewayError) -> bytes:
        return sse("error", error_payload(err))


class MessagesWire:
    async def body(self, ctx: RequestContext, body: dict[str, Any]) -> dict[str, Any]:
        return to_message(ctx, body, new_id("msg_"))

    def encoder(self, ctx: RequestContext) -> StreamEncoder:
        return MessagesEncoder(ctx)


WIRE = MessagesWire()

# Errors ------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_payload(err: GatewayError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status) or ("invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def render_error(err: GatewayError, request_id: str) -> bytes:
    return orjson.dumps({**error_payload(err), "request_id": request_id})


# Handlers ----------------------------------------------------------------------------------


def _session(req: MessagesRequest) -> str | None:
    """Anthropic's `metadata.user_id`; Claude Code puts a JSON object with its `session_id` there."""
    user_id = req.metadata.user_id if req.metadata is not None else None
    if user_id is not None and user_id.startswith("{"):
        try:
            value = orjson.loads(user_id)
        except orjson.JSONDecodeError:
            value = None
        if isinstance(value, dict) and session_key(value.get("session_id")):
            return session_key(value.get("session_id"))
    return session_key(user_id)


def message_context(caller: Caller, raw: dict[str, Any]) -> RequestContext:
    """The context of a Messages request (`raw`, the client's body), translated into chat; answered in `WIRE`."""
    req = protocol.check(MessagesRequest, raw)
    body, dropped = to_chat(req, raw, field_record(caller))
    ctx = chat_context(caller, body, "messages", dropped, session=_session(req))
    ctx.response_headers["request-id"] = ctx.request_id  # where Anthropic's SDKs look for it
    ctx.native_body = raw  # for an upstream that serves the Messages API itself
    ctx.native_api = MESSAGES  # and how its answers read as chat
    return ctx


async def create_message(request: web.Request) -> web.StreamResponse:
    return await serve(request, message_context(Caller.of(request), await read_json(request)), WIRE)


async def count_tokens(request: web.Request) -> web.Response:
    """The request's input tokens (messages, system and tools) by the local tokenizer, bounded
    (telemetry.tokens: at most EXACT_CHARS tokenized, the rest estimated); counted against the
    tenant's rate limits and written to the ledger as a zero-cost row (operation `count_tokens`)."""
    raw = await read_json(request)
    body, dropped = to_chat(protocol.check(CountTokensRequest, raw), raw, field_record(request))
    ctx = chat_context(request, body, "messages", dropped)
    ctx.operation = "count_tokens"
    ctx.lane, ctx.target_model = "none", None  # no lane answers it: no price, nothing reserved
    pipeline = request.app[PIPELINE]
    telemetry = pipeline.services.telemetry
    try:
        if telemetry is not None and telemetry.budgets.enabled:
            await telemetry.admit_async(ctx)
        if telemetry is not None:
            tokens = (await asyncio.to_thread(telemetry.estimate_usage, body, None)).input_tokens
        else:
            tokens = estimate_request_tokens(body)
    except (GatewayError, PolicyError) as exc:
        err = as_gateway_error(exc) or render_unexpected(exc)
        pipeline.complete(ctx, Outcome(status=err.status, response=None, complete=False, error_code=err.code or err.type))
        raise err from None
    except BaseException:
        pipeline.complete(ctx, Outcome(status=499, response=None, complete=False, error_code="client_closed_request"))
        raise
    ctx.usage = Usage()  # a count costs nothing
    pipeline.complete(ctx, Outcome(status=200, response=None, complete=True))
    return web.json_response({"input_tokens": tokens}, headers=answer_headers(ctx))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app[ERROR_FORMATS]["/v1/messages"] = render_error
