"""The upstream lane: forward the request to the pool and relay its answer.

It decides nothing: the pool and the model to ask it for are on the context, set by the
resolve and route stages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import aiohttp

from gateway.apis.field_policy import DROPPED_ATTRIBUTE, DROPPED_HEADER
from gateway.apis.native import MESSAGES
from gateway.context import TRIM_HEADER, Answer, NativeApi, RequestContext, Usage
from gateway.errors import BadUpstreamResponse, GatewayError, ModelNotFound, UpstreamError, UpstreamTimeout
from gateway.upstream.affinity import key_for
from gateway.upstream.pool import NativeRequest, UpstreamPool, UpstreamReply, forwardable_headers
from gateway.upstream.sse import DONE, iter_events
from telemetry.tokens import INLINE_CHARS, prompt_texts

PATHS = {"chat": "/chat/completions", "completions": "/completions", "embeddings": "/embeddings"}


Estimate = Callable[[dict[str, Any], dict[str, Any] | None], Usage]


async def answer(
    pool: UpstreamPool,
    ctx: RequestContext,
    inject_trace: Callable[[dict[str, str]], None] | None = None,
    estimate: Estimate | None = None,
) -> Answer:
    """Send ctx.body upstream; return the JSON answer or a relay of the stream.

    The client's `traceparent` is forwarded as is; with tracing on, `inject_trace` replaces
    it with the gateway's own span, a child of the client's trace.
    """
    body = ctx.body
    if ctx.target_model is None:
        # Only `auto` can get here without a model: its pool's upstreams name none.
        raise ModelNotFound(
            f"model {ctx.model!r} was routed to upstream pool {ctx.pool!r}, which names no model: list models "
            "on its upstreams or set lanes.upstream.pools.<pool>.model in the policy",
            param="model",
        )
    path = PATHS[ctx.operation]
    pool_name = ctx.pool or "default"
    # NOTE: a front door's request goes as the client sent it (model mapped) to a member that serves
    # that API itself: fields no translation knows survive (cache_control marks, thinking blocks).
    # Decided per member by the pool: a fallback that does not serve it gets the translation.
    # The front door that set the body provides how its API's answers read as chat (ctx.native_api).
    native_request: NativeRequest | None = None
    native_api = ctx.native_api
    if ctx.native_body is not None and native_api is not None and pool.serves_natively(pool_name, ctx.api):
        own = ctx.native_body if ctx.target_model == ctx.native_body.get("model") else {**ctx.native_body,
                                                                                         "model": ctx.target_model}
        native_request = NativeRequest(ctx.api, "/" + ctx.api, own)
    if ctx.target_model != body.get("model"):
        body = {**body, "model": ctx.target_model}
    client_wants_usage = False
    if ctx.stream:
        options = dict(body.get("stream_options") or {})
        client_wants_usage = bool(options.get("include_usage"))
        # Ask for usage on every stream so metering never sees zero; strip it again below
        # when the client did not ask for it.
        options["include_usage"] = True
        body = {**body, "stream_options": options}
    headers = forwardable_headers(ctx.headers)
    if inject_trace is not None:
        inject_trace(headers)
    # the prompt's prefix blocks and the session: the pool sends the request where they are cached
    # keyed by tenant too: one tenant's session name or prompt never lands on another's member state
    affinity = key_for(body, ctx.session, tenant=ctx.principal.tenant) if pool.wants_affinity(pool_name) else None
    started = time.perf_counter()
    try:
        reply = await pool.send(
            pool_name,
            path,
            body,
            headers=headers,
            model=body.get("model", ctx.model),
            stream=ctx.stream,
            client_authorization=ctx.headers.get("Authorization"),
            affinity=affinity,
            session=ctx.session,
            tenant=ctx.principal.tenant,
            native=native_request,
            priority=ctx.priority,
        )
    finally:
        ctx.lane_seconds += time.perf_counter() - started
    ctx.attributes["tierlane.upstream.name"] = reply.upstream.name
    if reply.queued_s > 0:
        ctx.attributes["tierlane.upstream.queued_ms"] = round(reply.queued_s * 1000.0, 3)
    ctx.response_headers["x-tierlane-upstream"] = reply.upstream.name
    ctx.attributes["tierlane.upstream.attempts"] = reply.attempts
    native = reply.native
    ctx.attributes["tierlane.upstream.native"] = native
    if native:
        assert native_api is not None, "only a request sent natively gets a native answer"
        _went_native(ctx)
        if reply.response is None:
            return _whole_native(ctx, reply, native_api)
        return Answer(lane="upstream", chunks=_relay_native(ctx, reply, native_api))
    if reply.api == "messages":
        # a member without chat got the request as a Messages one (gateway/upstream/to_messages.py):
        # its answer is read into the chat answer the client and the completion hooks read
        ctx.attributes["tierlane.upstream.api"] = "messages"
        if reply.response is None:
            return _whole_translated(ctx, reply)
        return Answer(lane="upstream", chunks=_relay_translated(ctx, reply, client_wants_usage))
    if reply.response is None:
        return _whole(ctx, reply)
    return Answer(lane="upstream", chunks=_relay(ctx, reply, client_wants_usage, estimate))


def _went_native(ctx: RequestContext) -> None:
    """The client's own body went: nothing of the translation was dropped, and nothing trimmed."""
    ctx.response_headers.pop(DROPPED_HEADER, None)
    if ctx.attributes.pop(DROPPED_ATTRIBUTE, None) is not None:
        ctx.attributes["tierlane.dropped_fields.not_applied"] = "native upstream"
    if ctx.trim_saved:
        ctx.attributes["tierlane.trim.not_applied"] = "native upstream"
        ctx.attributes["tierlane.trim.tokens_saved"] = 0
        ctx.trim_saved = {}
        ctx.response_headers[TRIM_HEADER] = "none;native"


def _answered(ctx: RequestContext, reply: UpstreamReply, api: NativeApi) -> dict[str, Any]:
    """A whole answer in `api`'s shape, checked, its usage and first-token time taken."""
    if reply.status >= 400:
        raise _client_error(reply)
    if not isinstance(reply.body, dict):
        raise BadUpstreamResponse("the upstream answered with JSON that is not an object")
    ctx.usage = api.usage(reply.body.get("usage"))
    ctx.first_token_at = time.perf_counter()
    return reply.body


def _whole_native(ctx: RequestContext, reply: UpstreamReply, api: NativeApi) -> Answer:
    answer = _answered(ctx, reply, api)
    native = answer if ctx.client_model is None else {**answer, "model": ctx.client_model}
    return Answer(lane="upstream", body=api.chat(answer), native=native)


async def _relay_native(ctx: RequestContext, reply: UpstreamReply, api: NativeApi) -> AsyncGenerator[dict[str, Any], None]:
    """The upstream's own events, each with its chat chunk, until the API's last event."""
    assert reply.response is not None
    reader = api.stream()
    ok = blame = False
    waited = time.perf_counter()
    try:
        async for event in reply.stream_events():
            ctx.lane_seconds += time.perf_counter() - waited
            if event is DONE:
                ok = True
                return
            if not isinstance(event, dict):
                raise BadUpstreamResponse("the upstream sent a stream event that is not an object")
            chunk = reader.chunk(event)
            if reader.usage is not None:
                ctx.usage = reader.usage
            if ctx.first_token_at is None and chunk["choices"]:
                ctx.first_token_at = time.perf_counter()
            yield chunk
            if reader.ends(event):
                ok = True
                return
            waited = time.perf_counter()
    except (UpstreamError, TimeoutError, aiohttp.ClientError, OSError) as exc:
        blame = True
        raise _mid_stream(exc) from None
    finally:
        reply.release(ok=ok, blame=blame)


def _chat_usage(usage: Usage) -> dict[str, Any]:
    """A Messages answer's usage as chat's, cache reads named as OpenAI names them."""
    return {**usage.to_openai(), "prompt_tokens_details": {"cached_tokens": usage.cached_input_tokens}}


def _whole_translated(ctx: RequestContext, reply: UpstreamReply) -> Answer:
    """A Messages answer to a chat request, as the chat completion."""
    body = MESSAGES.chat(_answered(ctx, reply, MESSAGES))
    if ctx.usage is not None:
        body["usage"] = _chat_usage(ctx.usage)
    return Answer(lane="upstream", body=body, status=reply.status)


async def _relay_translated(ctx: RequestContext, reply: UpstreamReply,
                            client_wants_usage: bool) -> AsyncGenerator[dict[str, Any], None]:
    """A Messages stream to a chat request, as chat chunks; usage last where the client asked for it."""
    assert reply.response is not None
    reader = MESSAGES.stream()
    ok = blame = False
    last: dict[str, Any] = {}
    waited = time.perf_counter()
    try:
        async for event in reply.stream_events():
            ctx.lane_seconds += time.perf_counter() - waited
            if event is DONE:
                break
            if not isinstance(event, dict):
                raise BadUpstreamResponse("the upstream sent a stream event that is not an object")
            if event.get("type") == "error":  # Anthropic's mid-stream failure (overloaded_error, ...)
                error = event["error"] if isinstance(event.get("error"), dict) else {}
                raise UpstreamError(f"the upstream failed mid-stream: {error.get('message') or error.get('type')}")
            chunk = reader.chunk(event)
            chunk.pop("native", None)
            if reader.usage is not None:
                ctx.usage = reader.usage
            if chunk["choices"]:
                if ctx.first_token_at is None:
                    ctx.first_token_at = time.perf_counter()
                last = chunk
                yield chunk
            if reader.ends(event):
                break
            waited = time.perf_counter()
        else:
            return  # the stream broke off before its last event: no usage is made up
        ok = True
        if client_wants_usage and ctx.usage is not None:
            yield {"id": last.get("id"), "object": "chat.completion.chunk", "created": last.get("created"),
                   "model": last.get("model"), "choices": [], "usage": _chat_usage(ctx.usage)}
    except (UpstreamError, TimeoutError, aiohttp.ClientError, OSError) as exc:
        blame = True
        raise _mid_stream(exc) from None
    finally:
        reply.release(ok=ok, blame=blame)


def _whole(ctx: RequestContext, reply: UpstreamReply) -> Answer:
    body = reply.body
    if reply.status >= 400:
        raise _client_error(reply)
    if not isinstance(body, dict):
        raise BadUpstreamResponse("the upstream answered with JSON that is not an object")
    if ctx.operation != "embeddings":
        _check_choices(body, "message")
    ctx.usage = Usage.from_openai(body.get("usage"))  # any JSON value: garbage is no usage
    ctx.first_token_at = time.perf_counter()
    return Answer(lane="upstream", body=body, status=reply.status)


def _check_choices(obj: dict[str, Any], part: str) -> None:
    """Raise BadUpstreamResponse unless `choices` (when present) is a list of objects.

    Each choice's `index` must be an integer and its `message` (answers) or `delta` (stream
    chunks) an object, where given. Stream chunks are checked down to what the stream
    assembler joins: `text`, `delta.content` and tool call pieces are strings or null.
    """
    if "choices" not in obj:
        return
    choices = obj["choices"]
    if not isinstance(choices, list):
        raise BadUpstreamResponse(f"the upstream sent 'choices' that is {_kind(choices)}, not a list")
    for choice in choices:
        if not isinstance(choice, dict):
            raise BadUpstreamResponse(f"the upstream sent a choice that is {_kind(choice)}, not an object")
        _expect(choice, "index", int, "choice")
        _expect(choice, part, dict, "choice")
        if part != "delta":
            continue
        _expect(choice, "text", str, "choice")
        delta = choice.get("delta") or {}
        _expect(delta, "content", str, "delta")
        _expect(delta, "tool_calls", list, "delta")
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                raise BadUpstreamResponse(f"the upstream sent a tool call that is {_kind(call)}, not an object")
            _expect(call, "index", int, "tool call")
            _expect(call, "function", dict, "tool call")
            function = call.get("function") or {}
            _expect(function, "name", str, "tool call function")
            _expect(function, "arguments", str, "tool call function")


def _expect(obj: dict[str, Any], key: str, kind: type, what: str) -> None:
    """`obj[key]`, where present and not null, must be a `kind` (booleans are no integers)."""
    value = obj.get(key)
    if value is None or (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        return
    raise BadUpstreamResponse(f"the upstream sent a {what} whose {key!r} is {_kind(value)}, not {_kind(kind())}")


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), "null")


def _client_error(reply: UpstreamReply) -> GatewayError:
    """An upstream 4xx/5xx passed on with its own message, in our error shape."""
    err: dict[str, Any] = {}
    if isinstance(reply.body, dict) and isinstance(reply.body.get("error"), dict):
        err = reply.body["error"]
    message = err.get("message") or f"the upstream answered {reply.status}"
    status = reply.status if reply.status < 500 else 502
    return GatewayError(
        str(message),
        status=status,
        type=err.get("type") or ("invalid_request_error" if status < 500 else "upstream_error"),
        code=err.get("code") if isinstance(err.get("code"), str) else None,
        param=err.get("param") if isinstance(err.get("param"), str) else None,
    )


async def _relay(
    ctx: RequestContext, reply: UpstreamReply, client_wants_usage: bool, estimate: Estimate | None
) -> AsyncGenerator[dict[str, Any], None]:
    assert reply.response is not None
    # Kept only for upstreams that send no usage although asked (llama.cpp's server, some
    # proxies): the client that asked for usage then gets a local estimate, marked as such.
    texts: list[str] = []
    last: dict[str, Any] = {}
    max_bytes = reply.upstream.settings.max_response_bytes
    ok = False
    blame = False
    waited = time.perf_counter()
    try:
        async for event in iter_events(reply.response.content, max_bytes):
            ctx.lane_seconds += time.perf_counter() - waited
            if event is DONE:
                ok = True
                if client_wants_usage and ctx.usage is None and estimate is not None:
                    yield await _estimated_usage_chunk(ctx, estimate, texts, last)
                return
            if not isinstance(event, dict):
                raise BadUpstreamResponse("the upstream sent a stream event that is not an object")
            _check_choices(event, "delta")
            if event.get("usage"):
                ctx.usage = Usage.from_openai(event["usage"])
                if not event.get("choices") and not client_wants_usage:
                    waited = time.perf_counter()
                    continue
                if not client_wants_usage:
                    event = {k: v for k, v in event.items() if k != "usage"}
            if ctx.first_token_at is None and event.get("choices"):
                ctx.first_token_at = time.perf_counter()
            if client_wants_usage and ctx.usage is None:
                last = event
                for choice in event.get("choices") or ():
                    piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if isinstance(piece, str):
                        texts.append(piece)
            yield event
            waited = time.perf_counter()
    except (UpstreamError, TimeoutError, aiohttp.ClientError, OSError) as exc:
        blame = True
        raise _mid_stream(exc) from None
    finally:
        # A consumer that stops early (client gone) closes the connection without blaming the upstream.
        reply.release(ok=ok, blame=blame)


def _mid_stream(exc: BaseException) -> GatewayError:
    """What a stream's failure after its first byte is to the client (the upstream is blamed for it)."""
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout("the upstream stopped sending mid-stream")
    return UpstreamError("the upstream connection broke mid-stream", code="stream_cut")


async def _estimated_usage_chunk(
    ctx: RequestContext, estimate: Estimate, texts: list[str], last: dict[str, Any]
) -> dict[str, Any]:
    text = "".join(texts)
    answer = {"choices": [{"text": text}]} if ctx.operation == "completions" else {"choices": [{"message": {"content": text}}]}
    # the local tokenizer holds the GIL: a long prompt or answer is counted on a worker thread
    large = len(text) + sum(len(t) for t in prompt_texts(ctx.body)[0]) > INLINE_CHARS
    ctx.usage = await asyncio.to_thread(estimate, ctx.body, answer) if large else estimate(ctx.body, answer)
    usage = {**ctx.usage.to_openai(), "estimated": True}
    return {
        "id": last.get("id"),
        "object": last.get("object", "chat.completion.chunk"),
        "created": last.get("created"),
        "model": last.get("model"),
        "choices": [],
        "usage": usage,
    }
