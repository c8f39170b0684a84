"""Which lane a model name goes to: `auto` (the router decides), the edge model, or an upstream pool."""

from __future__ import annotations

import time
from typing import Any

from gateway.context import RequestContext
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.settings import Settings
from gateway.upstream.pool import UpstreamPool

AUTO = "auto"
ROUTE_HEADER = "x-tierlane-route"
ROUTE_VALUES = ("auto", "edge", "upstream")


class ModelResolver:
    """Sets ctx.lane, ctx.pool and ctx.target_model from the model name and the route header."""

    def __init__(self, settings: Settings, pool: UpstreamPool, edge_enabled: bool) -> None:
        self.pool = pool
        self.edge_enabled = edge_enabled
        self.edge_name = settings.edge.model_name
        self.edge_names = frozenset([self.edge_name, *settings.edge.aliases]) if edge_enabled else frozenset()
        self._created = int(time.time())

    def _default_pool(self) -> str | None:
        names = self.pool.pool_names()
        return names[0] if names else None

    def resolve(self, ctx: RequestContext) -> None:
        requested = (ctx.header(ROUTE_HEADER) or "").strip().lower() or None
        if requested is not None and requested not in ROUTE_VALUES:
            raise InvalidRequest(
                f"header {ROUTE_HEADER} must be one of {', '.join(ROUTE_VALUES)}", param=ROUTE_HEADER
            )
        if ctx.operation == "embeddings":
            self._to_upstream(ctx, ctx.model)
            return
        if ctx.model == AUTO or requested == AUTO:
            ctx.attributes["route.requested"] = AUTO
            if self.pool.has_upstreams() and self._default_pool():
                ctx.lane, ctx.pool = "upstream", self._default_pool()
            elif self.edge_enabled:
                ctx.lane, ctx.target_model = "edge", self.edge_name
            else:
                raise ModelNotFound("model 'auto' needs an upstream or the edge lane; neither is configured", param="model")
            return
        if requested in ("edge", "upstream"):
            ctx.attributes["route.requested"] = requested
        if ctx.model in self.edge_names and requested != "upstream":
            ctx.lane, ctx.target_model = "edge", self.edge_name
            return
        self._to_upstream(ctx, ctx.model)

    def _to_upstream(self, ctx: RequestContext, model: str) -> None:
        pool = self.pool.pool_for_model(model)
        if pool is None:
            raise ModelNotFound(f"the model '{model}' does not exist or is not served here", param="model")
        ctx.lane, ctx.pool, ctx.target_model = "upstream", pool, model

    def listing(self) -> list[dict[str, Any]]:
        names: list[str] = []
        if self.edge_enabled or self.pool.has_upstreams():
            names.append(AUTO)
        if self.edge_enabled:
            names.append(self.edge_name)
        names.extend(self.pool.model_names())
        return [{"id": n, "object": "model", "created": self._created, "owned_by": "tierlane"} for n in names]
