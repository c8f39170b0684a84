"""What policies and telemetry raise: their own errors, mapped to HTTP by the gateway in one function.

`param` names the request field at fault; `retry_after` says when a refused caller may try again.
"""

from __future__ import annotations


class PolicyError(Exception):
    """A request a policy refuses or cannot read."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidInput(PolicyError):
    """The request (or a report's query) is malformed: the caller must change it."""


class LimitExceeded(PolicyError):
    """A rate limit or budget refuses the request, or stops a running stream."""

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        code: str = "rate_limit_exceeded",
        param: str | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after = retry_after


class BudgetExceeded(LimitExceeded):
    """A daily or monthly spend budget is used up."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message, retry_after=retry_after, code="budget_exceeded")


class StoreUnavailable(PolicyError):
    """The shared budget store cannot be reached in time and `state.on_store_error` is `deny` (a 503)."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message, code="budget_store_unavailable")
        self.retry_after = retry_after
