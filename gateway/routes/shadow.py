"""GET /v1/shadow: per-lane agreement of sampled cache/edge answers with the upstream's (global admin).

The figures pool every tenant's sampled traffic, so a tenant admin (`admin_scope: tenant`) is refused.
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from gateway.auth import require_global_admin
from gateway.keys import PRINCIPAL, REQUEST_ID, SETTINGS
from gateway.pipeline.shadow import AGREE, FILENAME, summarize
from telemetry.timefmt import iso_time, parse_time


def parse_since(raw: str | None) -> float:
    """Unix seconds, YYYY-MM-DD or an ISO 8601 datetime (UTC when naive); absent: the beginning."""
    if raw is None or not raw.strip():
        return 0.0
    return parse_time(raw, "since")


async def shadow_report(request: web.Request) -> web.Response:
    require_global_admin(request.get(PRINCIPAL), "GET /v1/shadow")
    since = parse_since(request.query.get("since"))
    path = request.app[SETTINGS].state_dir / FILENAME
    rows = await asyncio.to_thread(summarize, path, since)
    body = {"object": "shadow.report", "since": iso_time(since), "agree_above": AGREE, "data": rows}
    return web.Response(
        body=orjson.dumps(body), content_type="application/json", headers={"x-request-id": request.get(REQUEST_ID, "")}
    )


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/shadow", shadow_report)
