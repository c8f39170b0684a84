"""Admin purge of the semantic cache: DELETE /v1/cache?tenant=... and DELETE /v1/cache/{key}.

A tenant admin (`admin_scope: tenant`) purges only its own tenant; purging one entry by key
needs a global admin, since a key or entry id does not say whose entry it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from gateway.auth import require_admin, require_global_admin, require_tenant_admin
from gateway.context import Principal
from gateway.errors import GatewayError, InvalidRequest, NotFound
from gateway.keys import PRINCIPAL, SERVICES
from policies.cache.backend import CacheUnavailable

if TYPE_CHECKING:
    from gateway.services import Services
    from policies.cache.backend import CacheBackend


def _admin_cache(request: web.Request, services: Services | None) -> tuple[Principal, CacheBackend]:
    principal = require_admin(request.get(PRINCIPAL), "purging the cache")
    services = services or request.app.get(SERVICES)
    if services is None or services.cache is None:
        raise NotFound("the semantic cache is switched off on this gateway")
    cache: CacheBackend = services.cache
    return principal, cache


def _unavailable() -> GatewayError:
    # state.backend: redis and the store is down or slow: nothing was purged, so say so (a lookup would miss meanwhile).
    return GatewayError("the shared cache store is unavailable; nothing was purged, try again shortly", status=503, retry_after=1.0)


def _json(payload: dict[str, object]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def add_routes(app: web.Application, services: Services | None = None) -> None:
    """Register the purge endpoints (admin only); `services` defaults to the app's, looked up per request."""

    async def purge_tenant(request: web.Request) -> web.Response:
        principal, cache = _admin_cache(request, services)
        tenant = request.query.get("tenant", "").strip()
        if not tenant:
            raise InvalidRequest("say which tenant's entries to purge: DELETE /v1/cache?tenant=NAME", param="tenant")
        require_tenant_admin(principal, tenant, "purging the cache")
        try:
            deleted = await cache.purge_tenant(tenant)
        except CacheUnavailable:
            raise _unavailable() from None
        return _json({"object": "cache.purge", "tenant": tenant, "deleted": deleted})

    async def purge_key(request: web.Request) -> web.Response:
        principal, cache = _admin_cache(request, services)
        require_global_admin(principal, "purging a cache entry by key")
        key = request.match_info["key"].strip().lower()
        if not (key.isdigit() or (len(key) == 64 and all(c in "0123456789abcdef" for c in key))):
            raise InvalidRequest(
                "the key is the 64-hex x-tierlane-cache-key of a hit, or an entry id", param="key"
            )
        try:
            deleted = await cache.purge_key(key)
        except CacheUnavailable:
            raise _unavailable() from None
        if not deleted:
            raise NotFound(f"no cache entry with key {key}")
        return _json({"object": "cache.purge", "key": key, "deleted": deleted})

    app.router.add_delete("/v1/cache", purge_tenant)
    app.router.add_delete("/v1/cache/{key}", purge_key)
