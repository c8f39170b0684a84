"""Middlewares: request id, authentication, and the one place errors become OpenAI error bodies."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.auth import KeyTable
from gateway.errors import GatewayError, InvalidRequest, NotFound, PayloadTooLarge, as_gateway_error, render_unexpected
from gateway.keys import CONTEXT, ERROR_FORMATS, PRINCIPAL, RECEIVED_AT, REQUEST_ID, SERVICES, SETTINGS, ErrorFormat
from gateway.respond import lane_header
from policies.errors import PolicyError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Probes only: they tell nothing about tenants. /metrics is public only with telemetry.metrics_auth: none.
UNAUTHENTICATED = frozenset({"/healthz", "/readyz"})
METRICS_PATH = "/metrics"
# The dashboard's page holds no data (it reads /v1/dashboard with the key the operator types in),
# so a browser that sends no key gets it; a key that is sent must be an admin's.
KEY_OPTIONAL = frozenset({"/dashboard"})


def needs_key(request: web.Request) -> bool:
    """Whether the request must carry an API key (everything but the probes and, if so set, /metrics)."""
    if request.path in UNAUTHENTICATED:
        return False
    if request.path in KEY_OPTIONAL:
        return bool(request.headers.get("Authorization") or api_key_header(request))
    if request.path == METRICS_PATH:
        settings = request.app.get(SETTINGS)
        return settings is None or settings.telemetry.metrics_auth != "none"
    return True


def api_key_header(request: web.Request) -> str | None:
    """A key sent without `Authorization`: Azure's `api-key` or Anthropic's `x-api-key`."""
    return request.headers.get("api-key") or request.headers.get("x-api-key")


def error_format(request: web.Request) -> ErrorFormat | None:
    """The error shape of the API the request's path belongs to; None: OpenAI's."""
    formats = request.app.get(ERROR_FORMATS)
    if not formats:
        return None
    path = request.path
    for prefix, render in formats.items():
        if path == prefix or path.startswith(prefix + "/"):
            return render
    return None


def request_id(request: web.Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else "req_" + uuid.uuid4().hex


def error_response(
    err: GatewayError,
    rid: str,
    received: float,
    extra: dict[str, str] | None = None,
    render: ErrorFormat | None = None,
) -> web.Response:
    headers = {
        **err.headers(),
        "x-request-id": rid,
        "x-tierlane-overhead-ms": f"{(time.perf_counter() - received) * 1000:.3f}",
        "x-tierlane-lane": "none",
    }
    if extra:
        headers.update(extra)
    body = err.json_bytes() if render is None else render(err, rid)
    return web.Response(body=body, status=err.status, content_type="application/json", headers=headers)


def build_middleware(keys: KeyTable) -> Middleware:
    @web.middleware
    async def gateway_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        services = request.app.get(SERVICES)
        telemetry = services.telemetry if services is not None else None
        if telemetry is None:
            return await _handle(request, handler)
        with telemetry.server_span(request) as span:
            try:
                response = await _handle(request, handler)
            finally:
                ctx = request.get(CONTEXT)
                if ctx is not None:
                    span.bind(ctx)  # a client that left mid-answer is still this request's (status 499)
            span.set_status_code(response.status)
            return response

    async def _handle(request: web.Request, handler: Handler) -> web.StreamResponse:
        received = time.perf_counter()
        rid = request_id(request)
        request[REQUEST_ID] = rid
        request[RECEIVED_AT] = received
        # NOTE: every error of a front door's path (auth, 404, 405, 413 included) is rendered in
        # that API's own shape, so its SDK parses it into its own exception types.
        render = error_format(request)
        try:
            if needs_key(request):
                request[PRINCIPAL] = keys.resolve(request.headers.get("Authorization"), api_key_header(request))
            return await handler(request)
        except (GatewayError, PolicyError) as exc:
            err = as_gateway_error(exc) or render_unexpected(exc)
            ctx = request.get(CONTEXT)
            extra = {"x-tierlane-lane": lane_header(ctx)} if ctx is not None else None
            return error_response(err, rid, received, extra, render)
        except web.HTTPRequestEntityTooLarge:
            limit = request.app[SETTINGS].server.max_body_bytes
            err = PayloadTooLarge(f"the request body is larger than the limit of {limit} bytes")
            return error_response(err, rid, received, render=render)
        except web.HTTPNotFound:
            return error_response(NotFound(f"no route for {request.method} {request.path}"), rid, received, render=render)
        except web.HTTPMethodNotAllowed as exc:
            err = InvalidRequest(
                f"method {request.method} is not allowed on {request.path}", status=405, code="method_not_allowed"
            )
            return error_response(err, rid, received, {"Allow": ",".join(sorted(exc.allowed_methods))}, render)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            err = GatewayError(exc.reason or "request failed", status=exc.status, type="invalid_request_error")
            return error_response(err, rid, received, render=render)
        except ConnectionError:
            # The client left while its answer was written (the ledger row says 499): nothing failed on
            # the gateway's side. NOTE: returned, not raised: aiohttp logs a handler's exception as an
            # ERROR with its traceback, while writing this answer to the closed connection fails in
            # its own quiet path (a ConnectionError there ends the request without a log line).
            log.debug("client left during request %s", rid)
            return web.Response(status=499)
        except Exception as exc:
            log.exception("unhandled error in request %s", rid)
            return error_response(render_unexpected(exc), rid, received, render=render)

    return gateway_middleware
