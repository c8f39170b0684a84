"""Pipeline stage: answer from the semantic cache (exact, then verified semantic match) before routing."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.context import Answer, RequestContext, Usage
from gateway.pipeline.base import TEXT_OPERATIONS
from gateway.pipeline.embed import ensure_embedding
from policies.cache.backend import CacheBackend
from policies.cache.replay import fresh_body, replay_chunks
from policies.cache.scope import build_key, semantic_skip, wants
from policies.cache.service import CacheHit

if TYPE_CHECKING:
    from gateway.services import Services

logger = logging.getLogger(__name__)


def bound_scope(tenant: str, app: str) -> str:
    """The scope `cache.max_error_rate` is kept for: one tenant's app."""
    return f"{tenant}/{app}"


@dataclass(slots=True)
class CacheLookupStage:
    """Sets ctx.cache_status/key/similarity; on a hit answers with the stored completion."""

    cache: CacheBackend
    embedder: Any = None
    name: str = "cache_lookup"
    operations = TEXT_OPERATIONS

    async def run(self, ctx: RequestContext) -> Answer | None:
        route = ctx.requested_route
        config = self.cache.config_for(tenant=ctx.principal.tenant, app=ctx.principal.app, model=ctx.model, route=route)
        if not config.enabled or ctx.operation not in config.operations or ctx.operation != "chat":
            ctx.cache_status = "off"
            return None
        key, why = build_key(ctx.body, tenant=ctx.principal.tenant, model=ctx.model, route=route, rules=config.rules)
        if key is None:
            ctx.cache_status = "bypass"
            ctx.attributes["tierlane.cache.bypass_reason"] = why
            return None
        ctx.cache_key = key
        if wants(ctx.headers, "no-cache"):
            ctx.cache_status = "bypass"
            ctx.attributes["tierlane.cache.bypass_reason"] = "no-cache"
            return None
        max_tokens = ctx.request.output_limit if ctx.request is not None else None
        scope = bound_scope(ctx.principal.tenant, ctx.principal.app)
        # Exact match first: a repeat is answered without computing an embedding at all.
        hit = await self.cache.lookup(key, None, config, max_output_tokens=max_tokens, bound_scope=scope)
        refused: list[CacheHit] | None = [] if config.bound is not None else None
        if hit is None and config.semantic:
            # NOTE: embedded only where a semantic match can run: not for a request with tools nor a
            # last turn past max_text_chars (matched exactly, stored without a vector either way).
            if skip := semantic_skip(key, config.max_text_chars):
                ctx.attributes["tierlane.cache.exact_only"] = skip
            elif await ensure_embedding(ctx, self.embedder, optional=True) is not None:
                hit = await self.cache.lookup(key, ctx.embedding, config, max_output_tokens=max_tokens, exact=False,
                                              bound_scope=scope, refused=refused)  # fmt: skip
            elif self.embedder is not None:
                ctx.attributes["tierlane.cache.exact_only"] = "embedder_full"
        if config.bound is not None:
            self.cache.bounds.count_lookup(scope, config.bound, hit=hit is not None, exact=hit is not None and hit.exact)
        if hit is None:
            ctx.cache_status = "miss"
            if refused:
                ctx.cache_candidate = refused[0]
                ctx.attributes["tierlane.cache.refused_score"] = refused[0].score
            return None
        ctx.cache_status = "hit"
        ctx.attributes["tierlane.cache.entry_id"] = hit.entry_id
        if hit.score is not None:
            ctx.attributes["tierlane.cache.score"] = hit.score  # what the error bound's threshold applies to
        ctx.cache_similarity = hit.similarity
        ctx.lane = "cache"
        ctx.usage = Usage.from_openai(hit.usage)
        ctx.attributes["tierlane.cache.exact"] = hit.exact
        body = fresh_body(hit.response, hit.usage)
        ctx.target_model = body.get("model")
        headers = {
            "x-tierlane-cache": "hit",
            "x-tierlane-cache-similarity": f"{hit.similarity:.4f}",
            "x-tierlane-cache-key": hit.exact_key,
        }
        if ctx.stream:
            include_usage = ctx.request is not None and ctx.request.include_usage
            return Answer(lane="cache", chunks=replay_chunks(body, include_usage=include_usage), headers=headers)
        return Answer(lane="cache", body=body, headers=headers)

    async def close(self) -> None:
        return None  # the cache component closes itself, after the pipeline


def build(services: Services) -> CacheLookupStage | None:
    return CacheLookupStage(services.cache, services.embedder) if services.cache is not None else None
