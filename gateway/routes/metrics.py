"""GET /metrics: Prometheus exposition of the gateway's bounded-label metrics.

The series carry per-tenant and per-app cost and traffic, so by default (`telemetry.metrics_auth:
admin`) only a global admin key reads them; `none` makes them public (a scrape network you trust).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from gateway.auth import require_global_admin
from gateway.errors import NotFound
from gateway.keys import PRINCIPAL, SERVICES, SETTINGS
from telemetry.prometheus import CONTENT_TYPE

if TYPE_CHECKING:
    from gateway.services import Services


def add_routes(app: web.Application, services: Services | None = None) -> None:
    """`services` may be omitted: it is then looked up on the app when a request comes."""

    async def metrics(request: web.Request) -> web.Response:
        settings = request.app.get(SETTINGS)
        if settings is None or settings.telemetry.metrics_auth == "admin":
            require_global_admin(request.get(PRINCIPAL), "GET /metrics")
        found = services or request.app.get(SERVICES)
        telemetry = found.telemetry if found is not None else None
        if telemetry is None or telemetry.prometheus is None:
            raise NotFound("metrics are off: telemetry.metrics is false")
        return web.Response(body=telemetry.render_metrics(), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/metrics", metrics)
