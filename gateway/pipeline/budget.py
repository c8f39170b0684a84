"""Budget stage: rate limits and spend budgets are checked and counted before any upstream work."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.context import Answer, RequestContext
from gateway.pipeline.base import ALL_OPERATIONS

if TYPE_CHECKING:
    from gateway.services import Services
    from telemetry import Telemetry


class BudgetStage:
    """Raises RateLimited / BudgetExceeded (429 with Retry-After) when the caller is over a limit.

    With `state.backend: redis` the check is one round trip to the shared store (bounded by
    `state.op_timeout_ms`); a store failure with `on_store_error: deny` is a 503.
    """

    name = "budget"
    operations = ALL_OPERATIONS  # embeddings are budgeted and metered like any other call

    def __init__(self, telemetry: Telemetry) -> None:
        self._telemetry = telemetry

    async def run(self, ctx: RequestContext) -> Answer | None:
        await self._telemetry.admit_async(ctx)
        return None

    async def close(self) -> None:
        return None


def build(services: Services) -> BudgetStage | None:
    """None when there is no telemetry or its budgets are off (metering off switches them off too)."""
    telemetry = services.telemetry
    if telemetry is None or not telemetry.budgets.enabled:
        return None
    return BudgetStage(telemetry)
