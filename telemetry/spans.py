"""Spans: SERVER per request, INTERNAL per pipeline stage, CLIENT `chat {model}` per model call.

Each is a small context manager; when tracing is off every call returns one shared no-op
object, so the gateway calls them unconditionally. The open SERVER span is kept in a
ContextVar so that stages and the meter hook can attach request facts to it without the
gateway passing it around.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from contextvars import ContextVar, Token
from typing import Any

import orjson
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from policies.errors import LimitExceeded, PolicyError
from telemetry import attributes as a
from telemetry.record import MeteredRequest

_PRIMITIVE = (str, bool, int, float)


def _error_type(exc: BaseException) -> tuple[str, int]:
    # NOTE: duck-typed, so telemetry needs no import of the gateway's error tree: its errors
    # carry an int `status` and a `code` or `type`.
    status = getattr(exc, "status", None)
    label = getattr(exc, "code", None) or getattr(exc, "type", None)
    if isinstance(status, int) and isinstance(label, str):
        return label, status
    if isinstance(exc, LimitExceeded):
        return exc.code or "rate_limit_exceeded", 429
    if isinstance(exc, PolicyError):
        return exc.code or "invalid_request_error", 400
    if isinstance(exc, ConnectionError | asyncio.CancelledError):
        return "client_closed_request", 499  # the client left: what the ledger records too
    return type(exc).__qualname__, 500


def request_attributes(ctx: MeteredRequest) -> dict[str, Any]:
    """The tierlane attributes every span of a request may carry (no prompt text)."""
    attrs: dict[str, Any] = {
        a.REQUEST_ID: ctx.request_id,
        a.TENANT: ctx.principal.tenant,
        a.APP: ctx.principal.app,
        a.LANE: ctx.lane,
        a.CACHE_STATUS: ctx.cache_status,
        a.API: ctx.api,
        a.PRIORITY: ctx.priority,
    }
    if ctx.cache_similarity is not None:
        attrs[a.CACHE_SIMILARITY] = float(ctx.cache_similarity)
    if ctx.route is not None:
        if ctx.route.score is not None:
            attrs[a.ROUTE_SCORE] = float(ctx.route.score)
        attrs[a.ROUTE_REASON] = ctx.route.reason
    for key, value in ctx.attributes.items():
        if isinstance(value, _PRIMITIVE):
            attrs[key] = value
    return attrs


class _Inert:
    """The span-handle methods as no-ops, for spans that record nothing from them."""

    __slots__ = ()

    def bind(self, ctx: MeteredRequest) -> None:
        return None

    def set_status_code(self, status: int) -> None:
        return None

    def set_response(self, response: Mapping[str, Any] | None) -> None:
        return None


class NoopSpan(_Inert):
    """Stands in for every span kind when tracing is off; all methods do nothing."""

    __slots__ = ()

    def __enter__(self) -> NoopSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Scoped:
    """Makes `span` current for the duration of the `with` block and ends it afterwards."""

    __slots__ = ("span", "_token")

    def __init__(self, span: Span) -> None:
        self.span = span
        self._token: object | None = None

    def __enter__(self) -> Any:
        self._token = otel_context.attach(trace.set_span_in_context(self.span))
        return self

    def _fail(self, exc: BaseException) -> int:
        kind, status = _error_type(exc)
        self.span.set_attribute(a.ERROR_TYPE, kind)
        if status >= 500:
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, kind))
        return status

    def _end(self) -> None:
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
        self.span.end()


class StageSpan(_Scoped, _Inert):
    """An INTERNAL span around one pipeline stage."""

    __slots__ = ()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self._fail(exc)
        self._end()


class ServerSpan(_Scoped):
    """The SERVER span of one HTTP request; copies the request's facts from its bound context at the end."""

    __slots__ = ("ctx", "status", "_registry", "_slot")

    def __init__(self, span: Span, registry: ContextVar[ServerSpan | None]) -> None:
        super().__init__(span)
        self.ctx: MeteredRequest | None = None
        self.status: int | None = None
        self._registry = registry
        self._slot: Token[ServerSpan | None] | None = None

    def __enter__(self) -> ServerSpan:
        super().__enter__()
        self._slot = self._registry.set(self)
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.status = self._fail(exc)
        if self.status is not None:
            self.span.set_attribute("http.response.status_code", self.status)
            if self.status >= 500:
                self.span.set_status(Status(StatusCode.ERROR))
        if self.ctx is not None:
            self.span.set_attributes(request_attributes(self.ctx))
        if self._slot is not None:
            self._registry.reset(self._slot)
        self._end()

    def bind(self, ctx: MeteredRequest) -> None:
        self.ctx = ctx

    def set_status_code(self, status: int) -> None:
        self.status = status

    def set_response(self, response: Mapping[str, Any] | None) -> None:
        return None


class ModelSpan(_Scoped):
    """The CLIENT span `chat {model}` around a lane's model call, with GenAI attributes filled at the end."""

    __slots__ = ("ctx", "response", "_record_content")

    def __init__(self, span: Span, ctx: MeteredRequest, record_content: bool) -> None:
        super().__init__(span)
        self.ctx = ctx
        self.response: Mapping[str, Any] | None = None
        self._record_content = record_content

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self._fail(exc)
        self.span.set_attributes(self._closing_attributes())
        self._end()

    def bind(self, ctx: MeteredRequest) -> None:
        self.ctx = ctx

    def set_status_code(self, status: int) -> None:
        return None

    def set_response(self, response: Mapping[str, Any] | None) -> None:
        """The whole answer (assembled for streams): response model, id, finish reasons."""
        self.response = response

    def _closing_attributes(self) -> dict[str, Any]:
        ctx = self.ctx
        attrs = request_attributes(ctx)
        response = self.response or {}
        model = response.get("model") or ctx.attributes.get(a.GEN_AI_RESPONSE_MODEL)
        if model:
            attrs[a.GEN_AI_RESPONSE_MODEL] = str(model)
        if response.get("id"):
            attrs[a.GEN_AI_RESPONSE_ID] = str(response["id"])
        reasons = [str(c["finish_reason"]) for c in response.get("choices") or () if c.get("finish_reason")]
        if reasons:
            attrs[a.GEN_AI_FINISH_REASONS] = reasons
        if ctx.usage is not None:
            attrs[a.GEN_AI_INPUT_TOKENS] = ctx.usage.input_tokens
            attrs[a.GEN_AI_OUTPUT_TOKENS] = ctx.usage.output_tokens
            attrs[a.GEN_AI_CACHE_READ_TOKENS] = ctx.usage.cached_input_tokens
            attrs[a.GEN_AI_CACHE_CREATION_TOKENS] = ctx.usage.cache_write_tokens + ctx.usage.cache_write_1h_tokens
            attrs[a.USAGE_ESTIMATED] = ctx.usage.estimated
        if self._record_content and response.get("choices"):
            outputs = [c.get("message") or {"role": "assistant", "content": c.get("text")} for c in response["choices"]]
            attrs[a.GEN_AI_OUTPUT_MESSAGES] = orjson.dumps(outputs).decode()
        return attrs


class Spans:
    """Opens the gateway's spans on one tracer, or hands out no-ops when there is none."""

    def __init__(self, tracer: Tracer | None, *, record_content: bool = False, upstream_provider: str = "openai") -> None:
        self._tracer = tracer
        self._record_content = record_content
        self._upstream_provider = upstream_provider
        self._noop = NoopSpan()
        self._server: ContextVar[ServerSpan | None] = ContextVar("tierlane_server_span", default=None)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def server_span(self, request: Any) -> ServerSpan | NoopSpan:
        """Around one aiohttp request; joins the caller's trace when it sent a `traceparent`."""
        if self._tracer is None:
            return self._noop
        resource = getattr(getattr(request.match_info, "route", None), "resource", None)
        route = getattr(resource, "canonical", None)
        route = route if isinstance(route, str) else None
        method = request.method
        attrs: dict[str, Any] = {"http.request.method": method, "url.path": request.path, "url.scheme": request.scheme}
        if route:
            attrs["http.route"] = route
        span = self._tracer.start_span(
            f"{method} {route}" if route else method,
            context=propagate.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes=attrs,
        )
        return ServerSpan(span, self._server)

    def stage_span(self, ctx: MeteredRequest, name: str) -> StageSpan | NoopSpan:
        if self._tracer is None:
            return self._noop
        self._bind(ctx)
        span = self._tracer.start_span(f"tierlane.{name}")
        return StageSpan(span)

    def model_span(self, ctx: MeteredRequest) -> ModelSpan | NoopSpan:
        """A CLIENT span named `{operation} {model}`, e.g. `chat gpt-4o-mini`."""
        if self._tracer is None:
            return self._noop
        self._bind(ctx)
        operation = a.OPERATION_NAMES.get(ctx.operation, ctx.operation)
        model = ctx.target_model or ctx.model
        body = ctx.body
        attrs: dict[str, Any] = {
            a.GEN_AI_OPERATION: operation,
            a.GEN_AI_PROVIDER: "llama.cpp" if ctx.lane == "edge" else self._upstream_provider,
            a.GEN_AI_REQUEST_MODEL: model,
            a.GEN_AI_REQUEST_STREAM: ctx.stream,
        }
        for key, attr in (
            ("max_tokens", a.GEN_AI_REQUEST_MAX_TOKENS),
            ("max_completion_tokens", a.GEN_AI_REQUEST_MAX_TOKENS),
            ("temperature", a.GEN_AI_REQUEST_TEMPERATURE),
            ("top_p", a.GEN_AI_REQUEST_TOP_P),
        ):
            value = body.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attrs[attr] = value
        if self._record_content:
            prompt = body.get("messages") if "messages" in body else body.get("prompt")
            attrs[a.GEN_AI_INPUT_MESSAGES] = orjson.dumps(prompt, default=str).decode()
        span = self._tracer.start_span(f"{operation} {model}", kind=SpanKind.CLIENT, attributes=attrs)
        return ModelSpan(span, ctx, self._record_content)

    def annotate(self, ctx: MeteredRequest, attributes: Mapping[str, Any]) -> None:
        """Put the request's cost facts on its SERVER span (if still open) and on the current span."""
        if self._tracer is None:
            return
        current = trace.get_current_span()
        if current.is_recording():
            current.set_attributes(attributes)
        server = self._server.get()
        if server is not None and server.span is not current and server.span.is_recording():
            server.span.set_attributes(attributes)

    def inject(self, headers: dict[str, str]) -> None:
        """Add `traceparent` for the current span to outgoing upstream headers."""
        if self._tracer is not None:
            propagate.inject(headers)

    def _bind(self, ctx: MeteredRequest) -> None:
        server = self._server.get()
        if server is not None and server.ctx is None:
            server.ctx = ctx
