"""The edge lane: OpenAI chat/completions bodies in, the embedded engine's answer out (JSON or chunks)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from edge_engine import EdgeEngine, Generation, GenerationEvent, Priority, SamplingParams
from gateway.context import Answer, RequestContext, Usage
from gateway.errors import InvalidRequest


def sampling_from_body(body: dict[str, Any]) -> SamplingParams:
    """Reads the OpenAI sampling fields the engine supports."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise InvalidRequest("stop must be a non-empty string or a list of them", param="stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return SamplingParams(
        max_tokens=None if max_tokens is None else int(max_tokens),
        temperature=float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0),
        top_p=float(body.get("top_p") if body.get("top_p") is not None else 1.0),
        top_k=int(body.get("top_k") or 0),
        repeat_penalty=float(body.get("repeat_penalty") or 1.0),
        presence_penalty=float(body.get("presence_penalty") or 0.0),
        frequency_penalty=float(body.get("frequency_penalty") or 0.0),
        seed=body.get("seed"),
        stop=stops,
    )


async def answer(engine: EdgeEngine, ctx: RequestContext) -> Answer:
    """Runs the request on the engine; errors before the first token raise here, not in the stream."""
    body = ctx.body
    if int(body.get("n") or 1) != 1:
        raise InvalidRequest("the edge model returns one choice per request", param="n")
    chat = ctx.operation == "chat"
    priority = Priority.BATCH if (ctx.header("x-tierlane-priority") or "").lower() == "batch" else Priority.INTERACTIVE
    started = time.perf_counter()
    generation = await engine.submit(
        messages=body.get("messages") if chat else None,
        prompt=None if chat else body.get("prompt"),
        params=sampling_from_body(body),
        priority=priority,
    )
    try:
        first = await generation.__anext__()
    except BaseException:
        generation.cancel()
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
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return Answer(lane="edge", chunks=_stream(generation, first, shape, ctx, started, include_usage))


async def _stream(
    generation: Generation,
    first: GenerationEvent,
    shape: _Shape,
    ctx: RequestContext,
    started: float,
    include_usage: bool,
) -> AsyncIterator[dict[str, Any]]:
    try:
        if shape.chat:
            yield shape.chunk({"role": "assistant", "content": ""}, None)
        event = first
        while True:
            yield shape.chunk(shape.delta(event.text), event.finish_reason)
            if event.finish_reason is not None:
                break
            event = await generation.__anext__()
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
        usage = _usage(last).to_openai()
        usage["prompt_tokens_details"] = {"cached_tokens": last.cached_tokens}
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": last.finish_reason}
            return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model, "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": [choice], "usage": usage}
