"""The edge lane: OpenAI chat/completions bodies in, the embedded engine's answer out (JSON or chunks)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from edge_engine import EdgeEngine, Generation, GenerationEvent, Priority, SamplingParams
from edge_engine.errors import ContextTooLong, EngineBusy, EngineError, InvalidInput
from gateway.context import Answer, RequestContext, Usage
from gateway.errors import ContextLengthExceeded, GatewayError, InvalidRequest, Overloaded
from gateway.protocol import WireRequest


def gateway_error(exc: EngineError) -> GatewayError:
    """The one place engine errors become HTTP errors."""
    if isinstance(exc, ContextTooLong):
        return ContextLengthExceeded(exc.message, param=exc.param)
    if isinstance(exc, InvalidInput):
        return InvalidRequest(exc.message, param=exc.param)
    if isinstance(exc, EngineBusy):
        return Overloaded(exc.message, retry_after=exc.retry_after)
    # a failed step: the engine recovered, this answer is lost; the client may retry
    return GatewayError(exc.message, status=500, type="server_error", code="edge_engine_failure", retry_after=exc.retry_after)


def sampling_from_request(wire: WireRequest) -> SamplingParams:
    """The sampling fields the engine supports, from the request as validated on the wire."""
    if wire.n is not None and wire.n != 1:  # type: ignore[union-attr]
        raise InvalidRequest("the edge model returns one choice per request", param="n")
    stop = wire.stop  # type: ignore[union-attr]
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise InvalidRequest("stop must be a non-empty string or a list of them", param="stop")
    return SamplingParams(
        max_tokens=wire.output_limit,  # type: ignore[union-attr]
        temperature=1.0 if wire.temperature is None else wire.temperature,  # type: ignore[union-attr]
        top_p=1.0 if wire.top_p is None else wire.top_p,  # type: ignore[union-attr]
        top_k=wire.top_k or 0,  # type: ignore[union-attr]
        repeat_penalty=wire.repeat_penalty or 1.0,  # type: ignore[union-attr]
        presence_penalty=wire.presence_penalty or 0.0,  # type: ignore[union-attr]
        frequency_penalty=wire.frequency_penalty or 0.0,  # type: ignore[union-attr]
        seed=wire.seed,  # type: ignore[union-attr]
        stop=stops,
    )


def prefix_scope(ctx: RequestContext) -> str:
    """Whose KV cells a request may reuse: its tenant's only (see edge_engine.events.Sequence.scope)."""
    return ctx.principal.tenant


async def answer(engine: EdgeEngine, ctx: RequestContext) -> Answer:
    """Runs the request on the engine; errors before the first token raise here, not in the stream."""
    try:
        return await _answer(engine, ctx)
    except EngineError as exc:
        raise gateway_error(exc) from None


async def _answer(engine: EdgeEngine, ctx: RequestContext) -> Answer:
    body = ctx.body
    assert ctx.request is not None, "the route handler validates the request first"
    params = sampling_from_request(ctx.request)
    chat = ctx.operation == "chat"
    priority = Priority.BATCH if (ctx.header("x-tierlane-priority") or "").lower() == "batch" else Priority.INTERACTIVE
    started = time.perf_counter()
    generation = await engine.submit(
        messages=body.get("messages") if chat else None,
        prompt=None if chat else body.get("prompt"),
        params=params,
        priority=priority,
        scope=prefix_scope(ctx),
    )
    try:
        first = await generation.__anext__()
    except BaseException:
        generation.cancel()
        ctx.lane_seconds = time.perf_counter() - started  # the lane worked on it (metered as such)
        raise
    ctx.first_token_at = time.perf_counter()
    shape = _Shape(chat=chat, model=engine.model_name, created=int(time.time()))
    if not ctx.stream:
        text = [first.text]
        last = first
        async for event in generation:
            text.append(event.text)
            last = event
        _finish(ctx, last, started)
        return Answer(lane="edge", body=shape.body("".join(text), last))
    return Answer(lane="edge", chunks=_stream(generation, first, shape, ctx, started, ctx.request.include_usage))


async def _stream(
    generation: Generation,
    first: GenerationEvent,
    shape: _Shape,
    ctx: RequestContext,
    started: float,
    include_usage: bool,
) -> AsyncGenerator[dict[str, Any], None]:
    try:
        if shape.chat:
            yield shape.chunk({"role": "assistant", "content": ""}, None)
        event = first
        while True:
            yield shape.chunk(shape.delta(event.text), event.finish_reason)
            if event.finish_reason is not None:
                break
            try:
                event = await generation.__anext__()
            except EngineError as exc:
                raise gateway_error(exc) from None
        _finish(ctx, event, started)
        if include_usage:
            yield {**shape.chunk(None, None), "choices": [], "usage": _usage(event).to_openai()}
    finally:
        # NOTE: a client disconnect closes this generator; cancelling frees the slot and its KV cells.
        generation.cancel()
        ctx.lane_seconds = time.perf_counter() - started


def _usage(event: GenerationEvent) -> Usage:
    return Usage(input_tokens=event.prompt_tokens, output_tokens=event.completion_tokens, cached_input_tokens=event.cached_tokens)


def _finish(ctx: RequestContext, last: GenerationEvent, started: float) -> None:
    ctx.usage = _usage(last)
    ctx.lane_seconds = time.perf_counter() - started


class _Shape:
    """Builds OpenAI objects for one answer (ids and timestamps shared by all its chunks)."""

    def __init__(self, *, chat: bool, model: str, created: int) -> None:
        self.chat = chat
        self.model = model
        self.created = created
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]

    def delta(self, text: str) -> dict[str, Any]:
        return {"content": text} if text else {}

    def chunk(self, delta: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        if self.chat:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": choices}
        choices = [] if delta is None else [{"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": finish}]
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": choices}

    def body(self, text: str, last: GenerationEvent) -> dict[str, Any]:
        usage: dict[str, Any] = dict(_usage(last).to_openai())
        usage["prompt_tokens_details"] = {"cached_tokens": last.cached_tokens}
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": last.finish_reason}
            return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model, "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": [choice], "usage": usage}
