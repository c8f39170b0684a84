"""What the front doors share: the chat context they build, dropped-field records, SSE frames."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import orjson
from aiohttp import web

from gateway import protocol
from gateway.apis.field_policy import DROPPED_ATTRIBUTE, DROPPED_HEADER, Dropped, header_value
from gateway.caller import Caller
from gateway.context import Api, RequestContext, Usage
from gateway.keys import SETTINGS
from gateway.routes.openai import read_body
from gateway.session import SESSION_ATTRIBUTE, SESSION_HEADER, session_key

# The span attribute that lists the fields a front door accepted but could not pass on.


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body (size-limited like every other endpoint)."""
    server = request.app[SETTINGS].server
    return protocol.parse_body(await read_body(request, server.max_body_bytes), server.max_items)


def caller_of(source: web.Request | Caller) -> Caller:
    return source if isinstance(source, Caller) else Caller.of(source)


def field_record(source: web.Request | Caller) -> Dropped:
    """An empty record of dropped fields under the operator's `apis` policy."""
    apis = caller_of(source).settings.apis
    return Dropped(unknown_fields=apis.unknown_fields, hosted_tools=apis.hosted_tools)


def chat_context(source: web.Request | Caller, body: dict[str, Any], api: Api, dropped: Dropped | Iterable[str] = (),
                 session: str | None = None) -> RequestContext:
    """The context of a translated request: `body` is a chat-completions body, validated as one (its
    messages and tools, which the translation made from blocks validated already, not again)."""
    caller = caller_of(source)
    wire = protocol.validate("chat", body, max_n=caller.settings.server.max_n, translated=True)
    ctx = RequestContext(
        request_id=caller.request_id,
        operation="chat",
        body=body,
        headers=caller.headers,
        principal=caller.principal,
        model=wire.model,
        stream=wire.stream,
        api=api,
        received_at=caller.received_at,
        request=wire,
        client_model=wire.model,
        session=session or session_key(caller.headers.get(SESSION_HEADER)),
    )
    names = sorted(set(dropped.names if isinstance(dropped, Dropped) else dropped))
    if names:
        ctx.attributes[DROPPED_ATTRIBUTE] = ",".join(names)
        ctx.response_headers[DROPPED_HEADER] = header_value(names)
    if ctx.session is not None:
        ctx.attributes[SESSION_ATTRIBUTE] = ctx.session
    return ctx


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with a name (the framing both Anthropic's and the Responses API use)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def answer_usage(ctx: RequestContext, body: dict[str, Any] | None) -> Usage:
    """The answer's usage: what the lane reported on ctx, else the body's own, else none."""
    if ctx.usage is not None:
        return ctx.usage
    return Usage.from_openai((body or {}).get("usage")) or Usage()


def first_choice(body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The message and finish reason of a chat answer's first choice (front doors ask for n=1)."""
    choices = body.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message")
    reason = choice.get("finish_reason")
    return (message if isinstance(message, dict) else {}), (reason if isinstance(reason, str) else None)


def arguments_object(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as an object ({} when they are none, or not an object)."""
    try:
        value = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_calls(message: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each tool call of a chat message."""
    out: list[tuple[str, str, str]] = []
    for call in message.get("tool_calls") or ():
        if not isinstance(call, dict):
            continue
        function = call.get("function")
        if not isinstance(function, dict):
            function = {}
        out.append((str(call.get("id") or new_id("call_")), str(function.get("name") or ""), str(function.get("arguments") or "")))
    return out
