"""One exception tree for every failure, rendered as an OpenAI-style error body."""

from __future__ import annotations

import math
from typing import Any

import orjson

from policies.errors import BudgetExceeded as PolicyBudgetExceeded
from policies.errors import LimitExceeded, PolicyError, StoreUnavailable

# The longest Retry-After the gateway ever states (or honours from an upstream): one day.
MAX_RETRY_AFTER_S = 86_400


class GatewayError(Exception):
    """A failure that the client sees as `{"error": {message, type, param, code}}`."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        if code is not None:
            self.code = code
        self.param = param
        self.retry_after = retry_after

    def payload(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """`Retry-After` in whole seconds (1 to MAX_RETRY_AFTER_S); none when it is not a finite number.

        Never raises, whatever `retry_after` holds: it is rendered while answering a failure.
        """
        try:
            seconds = float(self.retry_after)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            return {}
        if not math.isfinite(seconds):
            return {}
        return {"Retry-After": str(int(round(min(float(MAX_RETRY_AFTER_S), max(1.0, seconds)))))}

    def json_bytes(self) -> bytes:
        return orjson.dumps(self.payload())

    def sse_frame(self) -> bytes:
        """The same payload as one SSE event, for failures after a stream has started."""
        return b"data: " + self.json_bytes() + b"\n\n"


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class BudgetExceeded(RateLimited):
    code = "budget_exceeded"


class UpstreamBusy(RateLimited):
    """Flow control: the request's class may not wait for a busy member (its queue is full), or waited too long."""

    code = "upstream_busy"


class BudgetStoreUnavailable(GatewayError):
    """The shared budget store failed and `state.on_store_error` is deny: nothing is admitted unchecked."""

    status = 503
    type = "server_error"
    code = "budget_store_unavailable"


class UpstreamError(GatewayError):
    """The upstream answered with an error or garbage."""

    status = 502
    type = "upstream_error"
    code = "bad_gateway"


class BadUpstreamResponse(UpstreamError):
    """The upstream's answer is not what the OpenAI API promises: malformed JSON, wrong shape."""

    code = "bad_upstream_response"


class UpstreamUnavailable(GatewayError):
    """No healthy upstream could take the request."""

    status = 503
    type = "upstream_error"
    code = "upstream_unavailable"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "upstream_error"
    code = "upstream_timeout"


class Overloaded(GatewayError):
    """A local resource (edge queue, KV cache) is full; the caller should retry later."""

    status = 503
    type = "server_error"
    code = "overloaded"


def from_policy(exc: PolicyError) -> GatewayError:
    """The one place a policy's or telemetry's error becomes an HTTP error."""
    if isinstance(exc, PolicyBudgetExceeded):
        return BudgetExceeded(exc.message, retry_after=exc.retry_after, param=exc.param)
    if isinstance(exc, LimitExceeded):
        return RateLimited(exc.message, retry_after=exc.retry_after, code=exc.code, param=exc.param)
    if isinstance(exc, StoreUnavailable):
        return BudgetStoreUnavailable(exc.message, retry_after=exc.retry_after)
    return InvalidRequest(exc.message, param=exc.param, code=exc.code)


def as_gateway_error(exc: BaseException) -> GatewayError | None:
    """`exc` as the error the client sees, or None when it is not one the gateway knows."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, PolicyError):
        return from_policy(exc)
    return None


def render_unexpected(exc: BaseException) -> GatewayError:
    """Turn anything else into a sanitised 500 that leaks no internals."""
    return GatewayError("internal error in the gateway; see its logs for the request id")


def known_error_codes() -> frozenset[str]:
    """The codes and types of the gateway's own error tree: the only error labels metrics carry."""
    codes: set[str] = set()
    pending: list[type[GatewayError]] = [GatewayError]
    while pending:
        cls = pending.pop()
        codes.update(c for c in (cls.code, cls.type) if c)
        pending.extend(cls.__subclasses__())
    return frozenset(codes)
