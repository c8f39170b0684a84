"""GET /v1/usage: ledger totals for admins, as JSON or (with `Accept: text/csv`) CSV.

A global admin reads every tenant; a tenant admin (`admin_scope: tenant`) reads only its own
tenant's rows, and asking for another tenant is 403.

With `state.backend: redis` the totals are the whole fleet's (every replica), read from the shared
store at whole-UTC-hour granularity (`source: "fleet"`); when the store does not answer, this
replica's ledger answers instead (`source: "local"` and a `warning`). The source is also the
`x-usage-source` header (CSV has no other place for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from gateway.auth import require_admin, require_tenant_admin
from gateway.errors import NotFound
from gateway.keys import PRINCIPAL, REQUEST_ID, SERVICES
from telemetry.usage import report, to_csv

if TYPE_CHECKING:
    from gateway.services import Services
    from telemetry import Telemetry


def metered_telemetry(request: web.Request, services: Services | None, off: str) -> Telemetry:
    """The gateway's telemetry when it meters (usage and the dashboard read its ledger), else 404 saying `off`."""
    services = services or request.app.get(SERVICES)
    telemetry = services.telemetry if services is not None else None
    if telemetry is None or not telemetry.config.metering:
        raise NotFound(off)
    return telemetry


def add_routes(app: web.Application, services: Services | None = None) -> None:
    """`services` may be omitted: it is then looked up on the app when a request comes."""

    async def usage(request: web.Request) -> web.Response:
        principal = require_admin(request.get(PRINCIPAL), "GET /v1/usage")
        telemetry = metered_telemetry(request, services, "usage reporting is off: this gateway runs without metering")
        query = telemetry.usage_query(request.query)
        if not principal.global_admin:
            require_tenant_admin(principal, query.filters.get("tenant", principal.tenant), "GET /v1/usage")
            query = query.for_tenant(principal.tenant)
        rows, source, warning = await telemetry.fleet_usage(query)
        headers = {"x-request-id": request.get(REQUEST_ID, ""), "x-usage-source": source}
        if "text/csv" in request.headers.get("Accept", ""):
            return web.Response(text=to_csv(query, rows), content_type="text/csv", headers=headers)
        body = report(query, rows, source, warning)
        return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)

    app.router.add_get("/v1/usage", usage)
