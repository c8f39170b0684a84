"""The learned templates for admins: GET /v1/edge/templates and DELETE /v1/edge/templates/{name}.

GET lists, per tenant/app and template, the pairs kept and the state (`collecting` while the
policy enables it, `stopped` when only its pairs remain). DELETE forgets a template's pairs: of
one tenant (`?tenant=`, and `&app=` for one app), or of every tenant (a global admin only). A tenant
admin (`admin_scope: tenant`) sees and forgets only its own tenant's.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.auth import require_admin, require_global_admin, require_tenant_admin
from gateway.errors import InvalidRequest
from gateway.keys import PRINCIPAL, SERVICES, SETTINGS
from policies.learn.config import NAME
from policies.learn.pairs import FILENAME, forget_in, summarize_in
from policies.learn.service import STOPPED

if TYPE_CHECKING:
    from policies.learn.service import Learning


def _json(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def _learning(request: web.Request) -> Learning | None:
    services = request.app.get(SERVICES)
    return services.learn if services is not None else None


async def list_templates(request: web.Request) -> web.Response:
    principal = require_admin(request.get(PRINCIPAL), "listing the learned templates")
    tenant = request.query.get("tenant", "").strip() or None
    if not principal.global_admin:
        tenant = tenant or principal.tenant
    if tenant is not None:
        require_tenant_admin(principal, tenant, "listing the learned templates")
    learning = _learning(request)
    if learning is not None:
        data = await learning.templates(tenant)
    else:  # no tenant/app learns anything now: what an earlier policy collected, if anything
        path = request.app[SETTINGS].state_dir / FILENAME
        data = [{"tenant": p.tenant, "app": p.app, "template": p.template, "state": STOPPED, "pairs": p.pairs,
                 "bytes": p.bytes, "oldest": p.oldest, "newest": p.newest, "max_pairs": None, "version": None}
                for p in await asyncio.to_thread(summarize_in, path, tenant)]  # fmt: skip
    return _json({"object": "list", "data": data})


async def forget_template(request: web.Request) -> web.Response:
    principal = require_admin(request.get(PRINCIPAL), "forgetting a learned template")
    name = request.match_info["name"]
    if not NAME.match(name):
        raise InvalidRequest(f"{name!r} is no template name", param="name")
    tenant = request.query.get("tenant", "").strip() or None
    app = request.query.get("app", "").strip() or None
    if tenant is None:
        if app is not None:
            raise InvalidRequest("name the tenant of the app: ?tenant=T&app=A", param="tenant")
        require_global_admin(principal, "forgetting a template of every tenant (add ?tenant=NAME)")
    else:
        require_tenant_admin(principal, tenant, "forgetting a learned template")
    learning = _learning(request)
    if learning is not None:
        deleted = await learning.forget(name, tenant, app)
    else:
        deleted = await asyncio.to_thread(forget_in, request.app[SETTINGS].state_dir / FILENAME, name, tenant, app)
    return _json({"object": "edge.template.forget", "template": name, "tenant": tenant, "app": app, "deleted": deleted})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/edge/templates", list_templates)
    app.router.add_delete("/v1/edge/templates/{name}", forget_template)
