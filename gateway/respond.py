"""Turning an Answer into the HTTP response: JSON, or SSE relayed chunk by chunk.

Lanes answer in the chat-completions shape; a `WireFormat` renders that in the API the client
called (OpenAI's own by default, or a front door's), while the completion hooks always see the
chat-shaped answer, so caching and metering never depend on the wire.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import orjson
from aiohttp import web

from gateway.assemble import StreamAssembler
from gateway.context import Answer, Outcome, RequestContext
from gateway.errors import GatewayError, as_gateway_error, render_unexpected
from gateway.keys import CONTEXT, PIPELINE
from gateway.pipeline.runner import Pipeline
from policies.errors import PolicyError

log = logging.getLogger(__name__)

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
DONE_FRAME = b"data: [DONE]\n\n"
_CLIENT_GONE = (ConnectionResetError, ConnectionError)


class StreamEncoder(Protocol):
    """Renders one answer's chat chunks as the SSE frames of an API (stateful, one per stream)."""

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The frames for one chat chunk (may be empty)."""
        ...

    async def end(self, response: dict[str, Any]) -> bytes:
        """The closing frames, given the whole answer assembled from the chunks."""
        ...

    def error(self, err: GatewayError) -> bytes:
        """The one frame that ends a stream that failed after it started."""
        ...


class WireFormat(Protocol):
    """How an API renders the pipeline's chat-shaped answers."""

    async def body(self, ctx: RequestContext, body: dict[str, Any]) -> dict[str, Any]:
        """The JSON answer for a whole (status 200) chat answer."""
        ...

    def encoder(self, ctx: RequestContext) -> StreamEncoder:
        ...


class _ChatEncoder:
    def chunk(self, chunk: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    async def end(self, response: dict[str, Any]) -> bytes:
        return DONE_FRAME

    def error(self, err: GatewayError) -> bytes:
        return err.sse_frame()


class OpenAIWire:
    """The OpenAI endpoints: answers go out as the lanes made them."""

    async def body(self, ctx: RequestContext, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def encoder(self, ctx: RequestContext) -> StreamEncoder:
        return _ChatEncoder()


OPENAI = OpenAIWire()


async def serve(request: web.Request, ctx: RequestContext, wire: WireFormat = OPENAI) -> web.StreamResponse:
    """Run ctx through the pipeline and answer in `wire`'s format.

    From here every way out (an answer, an error, a client gone, a bug) completes the request
    exactly once: one ledger row, and the budget reservation settled or released.
    """
    request[CONTEXT] = ctx
    pipeline = request.app[PIPELINE]
    try:
        answer = await pipeline.answer(ctx)
        return await deliver(request, ctx, answer, pipeline, wire)
    except (GatewayError, PolicyError) as exc:
        err = as_gateway_error(exc) or render_unexpected(exc)
        pipeline.complete(ctx, Outcome(status=err.status, response=None, complete=False, error_code=err.code or err.type))
        raise err from None
    except (asyncio.CancelledError, ConnectionError):
        pipeline.complete(ctx, Outcome(status=499, response=None, complete=False, error_code="client_closed_request"))
        raise
    except Exception as exc:
        err = render_unexpected(exc)
        pipeline.complete(ctx, Outcome(status=err.status, response=None, complete=False, error_code=err.code or err.type))
        raise


def lane_header(ctx: RequestContext) -> str:
    lane = ctx.lane if ctx.lane != "upstream" or not ctx.pool else f"upstream:{ctx.pool}"
    if ctx.lane == "upstream" and ctx.tier is not None:
        lane += f"; tier={ctx.tier}"  # e.g. `upstream:critical; tier=strong; score=0.612; reason=router_strong`
        if ctx.quality_probe is not None:  # routed at a region's threshold (lanes.upstream.tiers.max_quality_loss)
            lane += f"; region={ctx.quality_probe.region}"
    route = ctx.route
    check = ctx.edge_check
    if check is not None and check.confidence is not None:
        # e.g. `upstream:standard; escalated; confidence=0.412; ...` or `edge; confidence=0.931; ...`
        lane += f"; escalated; confidence={check.confidence:.3f}" if check.escalated else f"; confidence={check.confidence:.3f}"
    elif check is not None and check.escalated:  # escalated before any confidence, e.g. past its deadline
        lane += f"; escalated ({check.reason})"
    if route is None:
        return lane
    score = "" if route.score is None else f"; score={route.score:.3f}"
    return f"{lane}{score}; reason={route.reason}"


def answer_headers(ctx: RequestContext, extra: dict[str, str] | None = None) -> dict[str, str]:
    headers = {
        "x-request-id": ctx.request_id,
        "x-tierlane-lane": lane_header(ctx),
        "x-tierlane-overhead-ms": f"{ctx.overhead_ms():.3f}",
    }
    if ctx.cache_status != "off":
        headers["x-tierlane-cache"] = ctx.cache_status
    if ctx.target_model is not None:
        headers["x-tierlane-model"] = ctx.target_model  # what the lane was asked for (answers carry the client's name)
    headers.update(ctx.response_headers)
    if extra:
        headers.update(extra)
    return headers


def _finish_reasons(body: dict[str, Any]) -> list[str]:
    choices = body.get("choices")
    if not isinstance(choices, list):
        return []
    return [c["finish_reason"] for c in choices if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)]


async def deliver(
    request: web.Request, ctx: RequestContext, answer: Answer, pipeline: Pipeline, wire: WireFormat = OPENAI
) -> web.StreamResponse:
    if answer.chunks is None:
        shown, outcome = await whole(ctx, answer, wire)
        response = web.Response(
            body=orjson.dumps(shown),
            status=answer.status,
            content_type="application/json",
            headers=answer_headers(ctx, answer.headers),
        )
        pipeline.complete(ctx, outcome)
        return response
    return await _stream(request, ctx, answer, pipeline, wire.encoder(ctx))


async def whole(ctx: RequestContext, answer: Answer, wire: WireFormat = OPENAI) -> tuple[dict[str, Any], Outcome]:
    """A whole (not streamed) answer as `wire`'s API shows it, and the outcome to complete ctx with."""
    body = answer.body or {}
    if answer.native is not None:
        shown = answer.native
    else:
        shown = await wire.body(ctx, body) if answer.status == 200 and wire is not OPENAI else body
    return shown, Outcome(status=answer.status, response=body, complete=answer.status == 200,
                          finish_reasons=_finish_reasons(body))


async def _stream(
    request: web.Request, ctx: RequestContext, answer: Answer, pipeline: Pipeline, encoder: StreamEncoder
) -> web.StreamResponse:
    chunks = answer.chunks
    assert chunks is not None
    assembler = StreamAssembler()
    # The first chunk is awaited before any byte goes out, so a lane that fails at once
    # (upstream error, overload) still gets a proper HTTP status instead of a 200 stream.
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await chunks.aclose()
        raise
    response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **answer_headers(ctx, answer.headers)})
    outcome = Outcome(status=200, response=None, complete=False)
    telemetry = pipeline.services.telemetry
    # Budgets on streams are enforced by the tokens actually produced: charge_chunk raises
    # RateLimited once the caller passes a limit, which ends the stream with an error event.
    charge = telemetry.charge_chunk if telemetry is not None and ctx.lane != "cache" else None
    try:
        await response.prepare(request)
        if first is not None:
            assembler.add(first)
            if charge is not None:
                charge(ctx, first)
            await _write(response, encoder.chunk(first))
            async for chunk in chunks:
                assembler.add(chunk)
                if charge is not None:
                    charge(ctx, chunk)
                await _write(response, encoder.chunk(chunk))
        await response.write(await encoder.end(assembler.response()))
        outcome.complete = True
    except (GatewayError, PolicyError) as exc:
        err = as_gateway_error(exc) or render_unexpected(exc)
        outcome.status, outcome.error_code = err.status, err.code or err.type
        await _try_write(response, encoder.error(err))
    except asyncio.CancelledError:
        outcome.status, outcome.error_code = 499, "client_closed_request"
        raise
    except _CLIENT_GONE:
        # the client left mid-stream: a 499 in the ledger and a debug line, not an error (the
        # response goes back to aiohttp, whose end of it on a closed connection is quiet)
        outcome.status, outcome.error_code = 499, "client_closed_request"
        log.debug("client left during the stream of request %s", ctx.request_id)
    except Exception as exc:
        log.exception("stream failed for request %s", ctx.request_id)
        err = render_unexpected(exc)
        outcome.status, outcome.error_code = err.status, err.code or err.type
        await _try_write(response, encoder.error(err))
    finally:
        await chunks.aclose()
        outcome.response = assembler.response() if assembler.chunks else None
        outcome.finish_reasons = assembler.finish_reasons
        ctx.attributes["tierlane.stream.completed_at"] = time.perf_counter()
        pipeline.complete(ctx, outcome)
    return response


async def _write(response: web.StreamResponse, frames: bytes) -> None:
    if frames:
        await response.write(frames)


async def _try_write(response: web.StreamResponse, frame: bytes) -> None:
    try:
        await response.write(frame)
    except _CLIENT_GONE:
        pass
