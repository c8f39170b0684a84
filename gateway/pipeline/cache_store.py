"""Completion hook: admit complete, successful answers into the semantic cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.context import Outcome, RequestContext
from policies.cache.backend import CacheBackend
from policies.cache.scope import CacheKey, wants

if TYPE_CHECKING:
    from gateway.services import Services

logger = logging.getLogger(__name__)


def admissible(ctx: RequestContext, outcome: Outcome) -> bool:
    """Only whole answers that ended with `stop`, and never when the client said no-store."""
    if not isinstance(ctx.cache_key, CacheKey) or ctx.cache_status not in ("miss", "bypass"):
        return False
    if wants(ctx.headers, "no-store"):
        return False
    if ctx.lane == "edge" and ctx.edge_check is not None and not ctx.edge_check.passed:
        return False  # a local answer below the confidence threshold is never served again
    if outcome.status != 200 or not outcome.complete or outcome.response is None:
        return False
    if not outcome.finish_reasons or any(reason != "stop" for reason in outcome.finish_reasons):
        return False
    choices = outcome.response.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(isinstance((c.get("message") or {}).get("content"), str) for c in choices if isinstance(c, dict))


@dataclass(slots=True)
class CacheStoreHook:
    """Stores the answer under the key the lookup computed, so both use the same scope."""

    cache: CacheBackend
    name: str = "cache_store"

    async def on_complete(self, ctx: RequestContext, outcome: Outcome) -> None:
        try:
            if not admissible(ctx, outcome):
                return
            assert outcome.response is not None
            key: CacheKey = ctx.cache_key
            usage: dict[str, Any] | None = outcome.response.get("usage") or (
                ctx.usage.to_openai() if ctx.usage is not None else None
            )
            config = self.cache.config_for(
                tenant=ctx.principal.tenant, app=ctx.principal.app, model=ctx.model, route=ctx.requested_route
            )
            await self.cache.store(key, ctx.embedding, outcome.response, usage, config)
        except Exception:  # admission is best effort: the client already has its answer
            logger.exception("cache admission failed for request %s", ctx.request_id)

    async def close(self) -> None:
        return None  # the cache component closes itself, after the pipeline


def build(services: Services) -> CacheStoreHook | None:
    return CacheStoreHook(services.cache) if services.cache is not None else None
