"""GET /dashboard: the operators' page; GET /v1/dashboard: the figures it shows (JSON, or CSV).

Both need an admin key, like GET /v1/usage: a global admin sees every tenant (and may pick one with
`tenant=`); a tenant admin (`admin_scope: tenant`) sees only its own tenant, and asking for
another is 403; any other key is 403. The page is one HTML document with its script and styles
inlined (gateway/dashboard/, shipped in the package): no CDN, no build step, works offline. It
reads GET /v1/dashboard with the same query parameters and polls it to stay current.

GET /v1/dashboard parameters (all optional):
- `from`, `to`: unix seconds, YYYY-MM-DD (local midnight in `tz`; a `to` date includes that day)
  or ISO 8601 datetimes (in `tz` unless they name an offset). Default: the last 7 local days up to now.
- `tz`: IANA zone name, `UTC` (the default) or a fixed offset `+05:30`; the series is bucketed in it.
- `bucket`: `auto` (default: hours up to 2 days, days up to 92, then months), `hour`, `day`, `month`.
- `tenant`: one tenant's figures only (a tenant admin always gets its own).
- `format=csv` (or `Accept: text/csv`): every figure of the report as CSV (section, group, metric, value).
The ledger figures are computed in SQL over the ledger's rollups (telemetry/dashboard.py); with
`state.backend: redis` the headline and breakdown usage totals are the fleet's (`source`), as on
GET /v1/usage. Shadow agreement comes from the shadow store, engine figures from the running
edge engine (global admins only: the engine serves every tenant).
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.auth import require_admin, require_tenant_admin
from gateway.batches.service import BATCHES
from gateway.keys import PRINCIPAL, REQUEST_ID, SERVICES, SETTINGS
from gateway.pipeline.shadow import AGREE
from gateway.pipeline.shadow import FILENAME as SHADOW_FILENAME
from gateway.routes.usage import metered_telemetry
from policies.cache.error_bound import ScopeStats
from telemetry.dashboard import DashboardQuery, report, to_csv

if TYPE_CHECKING:
    from edge_engine.engine import EdgeEngine
    from gateway.route_quality import RouteQuality
    from gateway.services import Services

ASSETS = Path(__file__).resolve().parents[1] / "dashboard"
# The page runs only its own inlined script and talks only to this gateway.
CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
ENGINE_FIELDS = (
    "model", "available", "decode_tokens_per_s", "prefill_tokens_per_s", "queue_depth", "active_sequences",
    "slots", "kv_cells_used", "kv_cells_reserved", "kv_cells_total", "spec_acceptance_rate", "requests_total",
    "rejected_total", "restarts_total", "ttft_p50_s", "ttft_p99_s",
)  # fmt: skip


@functools.cache
def page() -> bytes:
    """index.html with dashboard.css and dashboard.js inlined (read once)."""
    html = (ASSETS / "index.html").read_text(encoding="utf-8")
    css = (ASSETS / "dashboard.css").read_text(encoding="utf-8")
    js = (ASSETS / "dashboard.js").read_text(encoding="utf-8")
    return html.replace("/*STYLE*/", css).replace("/*SCRIPT*/", js).encode("utf-8")


def shadow_summary(path: Path, query: DashboardQuery) -> list[dict[str, Any]]:
    """Per lane over the query's range and tenant: sampled answers, mean similarity, share above AGREE. Blocking."""
    if not path.exists():
        return []
    sql = ("SELECT lane, COUNT(*) AS n, AVG(similarity) AS mean, AVG(similarity > ?) AS agree "
           "FROM shadow WHERE ts >= ? AND ts < ?")  # fmt: skip
    params: list[Any] = [AGREE, query.start, query.end]
    if query.tenant is not None:
        sql += " AND tenant = ?"
        params.append(query.tenant)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        rows = conn.execute(sql + " GROUP BY lane ORDER BY lane", params).fetchall()
    except sqlite3.OperationalError:  # no table yet
        return []
    finally:
        conn.close()
    return [
        {"lane": lane, "count": int(n), "mean_similarity": round(float(mean), 4), "agreement": round(float(agree), 4), "agree_above": AGREE}
        for lane, n, mean, agree in rows
    ]


def cache_bound(stats: list[ScopeStats], tenant: str | None) -> list[dict[str, Any]]:
    """The cache's error bound now (cache.max_error_rate), per tenant/app; one tenant's alone when `tenant` is set."""
    out = []
    for st in sorted(stats, key=lambda s: s.scope):
        scope_tenant, _, app = st.scope.partition("/")
        if tenant is not None and scope_tenant != tenant:
            continue
        out.append({"tenant": scope_tenant, "app": app, "kind": st.kind, "threshold": round(st.threshold, 4),
                    "max_error_rate": st.max_error_rate, "served_error": None if st.error is None else round(st.error, 4),
                    "upper_bound": round(st.upper, 4), "judged": st.observed, "judged_wrong": st.observed_wrong,
                    "hit_rate": None if st.hit_rate is None else round(st.hit_rate, 4), "lookups": st.lookups})  # fmt: skip
    return out


def route_bound(quality: RouteQuality, tenant: str | None) -> list[dict[str, Any]]:
    """The routing quality bound per tenant/app and region (lanes.upstream.tiers.max_quality_loss)."""
    out = []
    for st in sorted(quality.stats(), key=lambda s: (s.scope, s.region)):
        scope_tenant, app = st.scope.tenant, st.scope.app
        if tenant is not None and scope_tenant != tenant:
            continue
        share = st.strong_share
        out.append({"tenant": scope_tenant, "app": app, "region": st.region, "label": quality.regions.label(st.region),
                    "threshold": round(st.threshold, 4), "router_threshold": round(st.start, 4),
                    "max_quality_loss": st.max_quality_loss, "disagreement": None if st.loss is None else round(st.loss, 4),
                    "upper_bound": round(st.upper, 4), "judged": st.observed, "disagreed": st.disagreed,
                    "judge_failed": st.judge_failed, "tightened": st.tightened, "loosened": st.loosened,
                    "requests": st.requests_cost + st.requests_strong, "strong_share": None if share is None else round(share, 4),
                    "saved_usd": round(st.saved_usd, 6), "judge_usd": round(st.judge_usd, 6)})  # fmt: skip
    return out


def engine_stats(engine: EdgeEngine | None) -> dict[str, Any] | None:
    if engine is None:
        return None
    try:
        stats = engine.stats()
    except Exception as exc:  # noqa: BLE001 - a restarting engine must not break the page
        return {"available": False, "error": str(exc)}
    return {name: stats.get(name) for name in ENGINE_FIELDS}


def add_routes(app: web.Application, services: Services | None = None) -> None:
    """`services` may be omitted: it is then looked up on the app when a request comes."""

    async def dashboard_page(request: web.Request) -> web.Response:
        # NOTE: without a key the page is served and asks for one (it carries no figures); with
        # one it must be an admin's. In open mode every caller is the open admin.
        principal = request.get(PRINCIPAL)
        if principal is not None:
            require_admin(principal, "GET /dashboard")
        headers = {"Cache-Control": "no-store", "Content-Security-Policy": CSP, "x-request-id": request.get(REQUEST_ID, "")}
        return web.Response(body=page(), content_type="text/html", charset="utf-8", headers=headers)

    async def dashboard_data(request: web.Request) -> web.Response:
        principal = require_admin(request.get(PRINCIPAL), "GET /v1/dashboard")
        telemetry = metered_telemetry(request, services, "the dashboard needs metering: this gateway runs without it")
        query = DashboardQuery.parse(request.query, now=time.time())
        if not principal.global_admin:
            require_tenant_admin(principal, query.tenant or principal.tenant, "GET /v1/dashboard")
            query = query.for_tenant(principal.tenant)
        body = await report(telemetry, query)
        body["scope"] = "global" if principal.global_admin else "tenant"
        settings = request.app.get(SETTINGS)
        if settings is not None:
            body["quality"]["shadow"] = await asyncio.to_thread(shadow_summary, settings.state_dir / SHADOW_FILENAME, query)
        found = services or request.app.get(SERVICES)
        if found is not None and found.cache is not None:
            body["quality"]["cache_bound"] = cache_bound(found.cache.bounds.stats(), query.tenant)
        if found is not None and found.route_quality is not None:
            body["quality"]["route_bound"] = route_bound(found.route_quality, query.tenant)
        if principal.global_admin and found is not None:
            body["edge_engine"] = engine_stats(found.engine)
        batches = request.app.get(BATCHES)
        if batches is not None:  # jobs kept, and the lines of those not yet ended (the Batch API)
            body["batches"] = await batches.jobs.totals(query.tenant)
        if found is not None and found.learn is not None:  # learned templates: pairs, adapter, gate, local share
            body["learned"] = await found.learn.templates(query.tenant)
        body["warnings"] = list(found.warnings) if found is not None else []
        headers = {"x-request-id": request.get(REQUEST_ID, ""), "x-usage-source": body["source"], "Cache-Control": "no-store"}
        if request.query.get("format") == "csv" or "text/csv" in request.headers.get("Accept", ""):
            name = f"tierlane-dashboard-{body['from_local'][:10]}-{body['to_local'][:10]}.csv"
            headers["Content-Disposition"] = f'attachment; filename="{name}"'
            return web.Response(text=to_csv(body), content_type="text/csv", headers=headers)
        return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)

    app.router.add_get("/dashboard", dashboard_page)
    app.router.add_get("/v1/dashboard", dashboard_data)
