"""The edge lane: OpenAI chat/completions bodies in, the embedded engine's answer out (JSON or chunks)."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from typing import Any, NoReturn

from edge_engine import EdgeEngine, Generation, GenerationEvent, Priority, SamplingParams, TokenInfo
from edge_engine.errors import ContextTooLong, EngineBusy, EngineError, InvalidInput
from gateway.capabilities import EdgeCapabilities
from gateway.cascade import Decision, EdgeAttempt, Escalate
from gateway.context import Answer, RequestContext, Usage
from gateway.errors import ContextLengthExceeded, GatewayError, InvalidRequest, Overloaded
from gateway.protocol import WireRequest
from policies.domain import EdgeCheck


def gateway_error(exc: EngineError) -> GatewayError:
    """The one place engine errors become HTTP errors."""
    if isinstance(exc, ContextTooLong):
        return ContextLengthExceeded(exc.message, param=exc.param)
    if isinstance(exc, InvalidInput):
        return InvalidRequest(exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, EngineBusy):
        return Overloaded(exc.message, retry_after=exc.retry_after)
    # a failed step: the engine recovered, this answer is lost; the client may retry
    return GatewayError(exc.message, status=500, type="server_error", code="edge_engine_failure", retry_after=exc.retry_after)


def sampling_from_request(wire: WireRequest) -> SamplingParams:
    """The sampling fields the engine supports, from the request as validated on the wire."""
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
        top_logprobs=_top_logprobs(wire),
    )


def _top_logprobs(wire: WireRequest) -> int:
    """Alternatives per token asked for: chat's `top_logprobs` (with `logprobs`), completions' `logprobs`."""
    value = getattr(wire, "logprobs", None)
    if isinstance(value, bool):
        return int(getattr(wire, "top_logprobs", None) or 0) if value else 0
    return int(value or 0)


async def _grammar(engine: EdgeEngine, response_format: dict[str, Any] | None) -> str | None:
    """The request's grammar from the engine's bounded, cached compiler (the capability check's too)."""
    if not response_format:
        return None
    try:
        return await engine.compile_grammar(response_format)
    except InvalidInput as exc:
        raise InvalidRequest(exc.message, param=exc.param or "response_format", code=exc.code or "unsupported_on_edge") from None


def prefix_scope(ctx: RequestContext) -> str:
    """Whose KV cells a request may reuse: its tenant's only (see edge_engine.events.Sequence.scope)."""
    return ctx.principal.tenant


_CAPABILITIES: weakref.WeakKeyDictionary[EdgeEngine, EdgeCapabilities] = weakref.WeakKeyDictionary()


def capabilities(engine: EdgeEngine) -> EdgeCapabilities:
    """What this engine can serve (built once per engine)."""
    found = _CAPABILITIES.get(engine)
    if found is None:
        found = _CAPABILITIES[engine] = EdgeCapabilities(engine)
    return found


async def answer(engine: EdgeEngine, ctx: RequestContext, attempt: EdgeAttempt | None = None) -> Answer:
    """Runs the request on the engine; errors before the first token raise here, not in the stream.

    With an `attempt` (the cascade's, for requests it judges) the attempt decides at each engine
    event: a failed check raises Escalate before anything is sent, and the client sees only the
    upstream's answer.
    """
    try:
        return await _answer(engine, ctx, attempt if attempt is not None else EdgeAttempt(None, stream=ctx.stream))
    except EngineError as exc:
        raise gateway_error(exc) from None


async def _answer(engine: EdgeEngine, ctx: RequestContext, attempt: EdgeAttempt) -> Answer:
    body = ctx.body
    assert ctx.request is not None, "the route handler validates the request first"
    # NOTE: the route stage already sent `auto` traffic that needs more upstream; this refuses
    # what reaches the edge anyway (pinned, or routing off) instead of answering it differently.
    await capabilities(engine).check_pinned(ctx.operation, ctx.body)
    params = sampling_from_request(ctx.request)
    params.grammar = await _grammar(engine, getattr(ctx.request, "response_format", None))
    plan = attempt.plan(params, engine.settings.default_max_tokens)
    chat = ctx.operation == "chat"
    priority = Priority.BATCH if (ctx.header("x-tierlane-priority") or "").lower() == "batch" else Priority.INTERACTIVE
    started = time.perf_counter()
    generation = await engine.submit(
        messages=body.get("messages") if chat else None,
        prompt=None if chat else body.get("prompt"),
        params=plan.params,
        priority=priority,
        scope=prefix_scope(ctx),
    )
    deadline_at: float | None = None
    if plan.deadline_tokens:
        budget = plan.deadline_s(engine.expected_seconds(generation.prompt_tokens, plan.deadline_tokens))
        deadline_at = None if budget is None else started + budget
    held: list[GenerationEvent] = []
    tokens: list[TokenInfo] = []
    try:
        # Errors before the first token raise here, not in the stream. Events are held until the
        # attempt releases them (a stream) or the answer ends; the attempt may escalate before.
        while True:
            event = await _next(generation, deadline_at)
            if event is None:
                _escalate(ctx, generation, started, attempt.on_deadline().check,
                          held[-1].completion_tokens if held else 0)
            held.append(event)
            tokens.extend(event.tokens)
            if ctx.first_token_at is None:
                ctx.first_token_at = time.perf_counter()
            decision = attempt.on_event(event, tokens)
            if decision.check is not None:
                deadline_at = None  # the deadline bounds the wait for the check
                if decision.action == "escalate":
                    _escalate(ctx, generation, started, decision.check, event.completion_tokens)
                ctx.edge_check = decision.check
            if event.finish_reason is not None or decision.action == "release":
                break
    except BaseException:
        generation.cancel()
        ctx.lane_seconds = time.perf_counter() - started  # the lane worked on it (metered as such)
        raise
    last = held[-1]
    if last.finish_reason is not None:
        _apply_end(ctx, generation, started, attempt.on_end(tokens, last.finish_reason), last.completion_tokens)
    shape = _Shape(chat=chat, model=engine.model_name, created=int(time.time()), logprobs=_logprobs_wanted(ctx))
    if not ctx.stream:
        _finish(ctx, last, started)
        return Answer(lane="edge", body=shape.body("".join(e.text for e in held), tokens, last))
    return Answer(lane="edge", chunks=_stream(generation, held, tokens, shape, ctx, started, attempt))


async def _next(generation: Generation, deadline_at: float | None) -> GenerationEvent | None:
    """The next event; None when the attempt is past its deadline first."""
    if deadline_at is None:
        return await generation.__anext__()
    try:
        async with asyncio.timeout(max(0.0, deadline_at - time.perf_counter())):  # no task per token, as wait_for made
            return await generation.__anext__()
    except TimeoutError:
        return None


def _escalate(ctx: RequestContext, generation: Generation, started: float, check: EdgeCheck | None,
              output_tokens: int) -> NoReturn:
    """Stops the attempt and raises Escalate with its check, metered with what the edge spent on it."""
    assert check is not None and check.escalated
    generation.cancel()
    ctx.lane_seconds = time.perf_counter() - started
    ctx.edge_check = replace(check, edge_input_tokens=generation.prompt_tokens, edge_output_tokens=output_tokens)
    raise Escalate(ctx.edge_check) from None


def _apply_end(ctx: RequestContext, generation: Generation, started: float, decision: Decision,
               output_tokens: int) -> None:
    """Applies the attempt's decision on a whole answer: its check recorded, or the request escalated."""
    if decision.action == "escalate":
        _escalate(ctx, generation, started, decision.check, output_tokens)
    if decision.check is not None:
        ctx.edge_check = decision.check


def _logprobs_wanted(ctx: RequestContext) -> int | None:
    """None: no logprobs; else how many alternatives per token (0: the chosen token's only)."""
    wire = ctx.request
    if ctx.operation == "chat":
        if not getattr(wire, "logprobs", None):
            return None
        return int(getattr(wire, "top_logprobs", None) or 0)
    value = getattr(wire, "logprobs", None)
    return None if value is None else int(value)


async def _stream(
    generation: Generation,
    held: list[GenerationEvent],
    tokens: list[TokenInfo],
    shape: _Shape,
    ctx: RequestContext,
    started: float,
    attempt: EdgeAttempt,
) -> AsyncGenerator[dict[str, Any], None]:
    include_usage = bool(ctx.request.include_usage)
    try:
        if shape.chat:
            yield shape.chunk({"role": "assistant", "content": ""}, None)
        for event in held:
            yield shape.event_chunk(event)
        event = held[-1]
        ended = event.finish_reason is not None  # judged before the first byte
        while event.finish_reason is None:
            try:
                event = await generation.__anext__()
            except EngineError as exc:
                raise gateway_error(exc) from None
            tokens.extend(event.tokens)
            decision = attempt.on_event(event, tokens)  # released: nothing is escalated any more
            if decision.check is not None:
                ctx.edge_check = decision.check
            yield shape.event_chunk(event)
        if not ended:
            decision = attempt.on_end(tokens, event.finish_reason)
            if decision.check is not None:
                ctx.edge_check = decision.check
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


def client_finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as OpenAI's: a degeneration stop cut the answer short ("length")."""
    return "length" if reason in ("loop", "low_confidence") else reason


def _token_text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


class _Shape:
    """Builds OpenAI objects for one answer (ids and timestamps shared by all its chunks)."""

    def __init__(self, *, chat: bool, model: str, created: int, logprobs: int | None = None) -> None:
        self.chat = chat
        self.model = model
        self.created = created
        self.logprobs = logprobs  # None: not asked for
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self._offset = 0  # completions' text_offset runs over the whole answer

    def delta(self, text: str) -> dict[str, Any]:
        return {"content": text} if text else {}

    def event_chunk(self, event: GenerationEvent) -> dict[str, Any]:
        chunk = self.chunk(self.delta(event.text), client_finish_reason(event.finish_reason))
        if self.logprobs is not None and event.tokens:
            chunk["choices"][0]["logprobs"] = self.logprob_block(event.tokens)
        return chunk

    def chunk(self, delta: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        if self.chat:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": choices}
        choices = [] if delta is None else [{"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": finish}]
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": choices}

    def logprob_block(self, tokens: Sequence[TokenInfo]) -> dict[str, Any]:
        """OpenAI's `logprobs` object for these tokens: chat's `content` list, or completions' arrays."""
        k = self.logprobs or 0
        if self.chat:
            return {"content": [self._chat_entry(t, k) for t in tokens], "refusal": None}
        texts = [_token_text(t.piece) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{_token_text(p): lp for p, lp in t.top[:k]} for t in tokens] if k else None,
            "text_offset": offsets,
        }

    @staticmethod
    def _chat_entry(token: TokenInfo, k: int) -> dict[str, Any]:
        return {
            "token": _token_text(token.piece),
            "logprob": token.logprob,
            "bytes": list(token.piece),
            "top_logprobs": [{"token": _token_text(p), "logprob": lp, "bytes": list(p)} for p, lp in token.top[:k]],
        }

    def body(self, text: str, tokens: Sequence[TokenInfo], last: GenerationEvent) -> dict[str, Any]:
        usage: dict[str, Any] = dict(_usage(last).to_openai())
        usage["prompt_tokens_details"] = {"cached_tokens": last.cached_tokens}
        logprobs = self.logprob_block(tokens) if self.logprobs is not None else None
        finish = client_finish_reason(last.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish}
            return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model, "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": [choice], "usage": usage}
