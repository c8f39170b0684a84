"""API keys → (tenant, app): keys are stored as SHA-256 digests and compared in constant time.

Also the admin checks of the admin endpoints: an `admin` key with `admin_scope: global` (the
default) administers every tenant; with `admin_scope: tenant` only its own.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from gateway.context import Principal
from gateway.errors import AuthenticationFailed, PermissionDenied
from gateway.settings import AuthSettings

OPEN_PRINCIPAL = Principal(tenant="default", app="default", key_id="open", admin=True)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return "tl-" + secrets.token_urlsafe(32)


class KeyTable:
    """Resolves the bearer key of a request to its principal."""

    def __init__(self, settings: AuthSettings) -> None:
        self.open = settings.mode == "open"
        # NOTE: the table is keyed by the digest, so a lookup's timing depends only on the
        # SHA-256 of the presented key, which tells an attacker nothing about stored keys;
        # the final equality is still checked with compare_digest.
        self._by_digest = {
            k.sha256: Principal(
                tenant=k.tenant, app=k.app, key_id=k.sha256[:12], admin=k.admin, admin_scope=k.admin_scope
            )
            for k in settings.keys
        }

    def resolve(self, authorization: str | None, api_key_header: str | None = None) -> Principal:
        if self.open:
            return OPEN_PRINCIPAL
        key = _bearer(authorization) or (api_key_header or "").strip()
        if not key:
            raise AuthenticationFailed(
                "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')", code="missing_api_key"
            )
        digest = hash_key(key)
        principal = self._by_digest.get(digest)
        if principal is None or not hmac.compare_digest(principal.key_id, digest[:12]):
            raise AuthenticationFailed("invalid API key")
        return principal


def require_admin(principal: Principal | None, action: str) -> Principal:
    """The caller, if it holds an admin key of any scope; else PermissionDenied naming `action`."""
    if principal is None or not principal.admin:
        raise PermissionDenied(f"{action} needs an admin API key")
    return principal


def require_global_admin(principal: Principal | None, action: str) -> Principal:
    """The caller, if it administers every tenant; else PermissionDenied naming `action`."""
    principal = require_admin(principal, action)
    if not principal.global_admin:
        raise PermissionDenied(
            f"{action} needs a global admin API key; this key administers tenant {principal.tenant!r} only"
        )
    return principal


def require_tenant_admin(principal: Principal | None, tenant: str, action: str) -> Principal:
    """The caller, if it administers `tenant` (a global admin, or that tenant's own admin)."""
    principal = require_admin(principal, action)
    if not principal.administers(tenant):
        raise PermissionDenied(
            f"{action} for tenant {tenant!r} needs a global admin API key; "
            f"this key administers tenant {principal.tenant!r} only"
        )
    return principal


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None
