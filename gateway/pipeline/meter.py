"""Meter hook: usage, cost and savings of a finished request into the ledger, metrics and spans."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gateway.context import Outcome, RequestContext

if TYPE_CHECKING:
    from gateway.cascade import Cascade
    from gateway.route_quality import RouteQuality
    from gateway.services import Services
    from telemetry import Telemetry

log = logging.getLogger(__name__)


class MeterHook:
    """Runs after the client has its answer; never raises."""

    name = "meter"

    def __init__(self, telemetry: Telemetry, cascade: Cascade | None = None, quality: RouteQuality | None = None) -> None:
        self._telemetry = telemetry
        self._cascade = cascade  # learns from each edge attempt's verdict and saving
        self._quality = quality  # counts each tiered request and its saving in its region (the dashboard)

    async def on_complete(self, ctx: RequestContext, outcome: Outcome) -> None:
        try:
            bill = await self._telemetry.meter(ctx, outcome)
        except Exception:
            log.exception("metering failed for request %s", ctx.request_id)
            return
        if self._cascade is not None and bill is not None:
            try:
                self._cascade.observe(ctx, bill.saved_edge)
            except Exception:
                log.exception("the cascade could not learn from request %s", ctx.request_id)
        probe = ctx.quality_probe
        if self._quality is not None and probe is not None and bill is not None and ctx.lane == "upstream" and ctx.tier:
            self._quality.bounds.count(probe.scope, probe.region, probe.params, ctx.tier, bill.saved_vs_strong)

    async def close(self) -> None:
        return None  # the telemetry component closes itself, after the pipeline


def build(services: Services) -> MeterHook | None:
    telemetry = services.telemetry
    if telemetry is None or not telemetry.config.metering:
        return None
    return MeterHook(telemetry, services.cascade, services.route_quality)
