"""Pipeline stage, always first: validate the route header, resolve the model name to a lane and the priority class.

An explicit model fixes the lane here (the edge model, or the upstream pool that serves it).
`auto` gets the default upstream pool (else the edge) and that pool's model; when the router
is on, the route stage decides it again. An unknown model or a bad route or priority header ends
the request here, before budgets are counted or the cache is asked. The class (policies/priority.py)
is the one the `x-tierlane-priority` header asks for, else the tenant/app's default, bounded by its
max; a class a front door set before (the Batch API's `batch`) is never raised.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

from gateway.context import Answer, RequestContext
from gateway.errors import InvalidRequest, ModelNotFound, UpstreamUnavailable
from gateway.lanes import AUTO, ROUTE_HEADER, ROUTE_VALUES, RouteRequest
from gateway.pipeline.base import ALL_OPERATIONS
from gateway.upstream.pool import UpstreamPool
from policies.errors import InvalidInput
from policies.priority import HEADER as PRIORITY_HEADER
from policies.priority import PriorityPolicy

if TYPE_CHECKING:
    from gateway.services import Services


class ModelCatalog:
    """The model names this gateway serves and the lane each one goes to; GET /v1/models lists them."""

    def __init__(
        self,
        pool: UpstreamPool,
        edge_name: str | None,
        edge_aliases: Iterable[str] = (),
        model_aliases: Mapping[str, str] | None = None,
        edge_calibrated: Callable[[], bool] = lambda: True,
    ) -> None:
        self.pool = pool
        # whether the edge model has a calibration of its own (gateway/edge_calibration.py): without
        # one it takes no `auto` requests, here where no router decides, as in the route stage
        self.edge_calibrated = edge_calibrated
        self.edge_name = edge_name  # None when the edge lane is off
        self.edge_names = frozenset([edge_name, *edge_aliases]) if edge_name is not None else frozenset()
        aliases = dict(model_aliases or {})
        self._exact = {k: v for k, v in aliases.items() if not any(c in k for c in "*?[")}
        self._globs = [(k, v) for k, v in aliases.items() if k not in self._exact]
        self._created = int(time.time())

    @classmethod
    def from_services(cls, services: Services) -> ModelCatalog:
        aliases = services.settings.model_aliases
        if services.engine is None:
            return cls(services.pool, None, model_aliases=aliases)
        edge = services.settings.edge
        cascade = services.cascade
        return cls(services.pool, edge.model_name, edge.aliases, aliases,
                   edge_calibrated=lambda: cascade is None or cascade.calibrated)

    def alias(self, model: str) -> str | None:
        """What the settings' model_aliases map `model` to, or None.

        Exact names first, then the globs in their order; a glob never renames a model the
        gateway serves by name (the edge's names, or a model an upstream lists).
        """
        if model in self._exact:
            return self._exact[model]
        if not self._globs or model in self.edge_names or model in self.pool.model_names():
            return None
        for pattern, target in self._globs:
            if fnmatch.fnmatchcase(model, pattern):
                return target
        return None

    def default_pool(self) -> str | None:
        names = self.pool.pool_names()
        return names[0] if names else None

    def pool_model(self, pool: str | None) -> str | None:
        """The model `auto` asks a pool for: the first its upstreams name (None when they name none)."""
        return self.pool.default_model(pool)

    def upstream_for(self, model: str) -> tuple[str, str | None]:
        """The pool serving `model` and the model to ask it for; ModelNotFound when none serves it."""
        pool = self.pool.pool_for_model(model)
        if pool is None:
            raise ModelNotFound(not_served(model, self.listing_names()), param="model")
        return pool, self.pool_model(pool) if model == AUTO else model

    def listing_names(self) -> list[str]:
        return [entry["id"] for entry in self.listing()]

    def listing(self) -> list[dict[str, Any]]:
        names: list[str] = []
        if self.edge_name is not None or self.pool.has_upstreams():
            names.append(AUTO)
        if self.edge_name is not None:
            names.append(self.edge_name)
        names.extend(self.pool.model_names())
        return [{"id": n, "object": "model", "created": self._created, "owned_by": "tierlane"} for n in names]


def not_served(model: str, served: list[str]) -> str:
    """The 404 for a model name nothing serves: what is served, and the settings that would serve it."""
    shown = ", ".join(served[:8]) + (", ..." if len(served) > 8 else "") if served else "none"
    return (f"the model '{model}' is not served here (served: {shown}). Map the name your client sends onto one of "
            f"them with model_aliases (e.g. model_aliases: {{\"{_glob_of(model)}\": auto}} in the config file, or "
            f"TIERLANE_MODEL_ALIASES='{_glob_of(model)}=auto'), or add an upstream that serves it (upstreams[].models, "
            "TIERLANE_UPSTREAM_URL and TIERLANE_UPSTREAM_MODELS)")


def _glob_of(model: str) -> str:
    """`claude-opus-5-5` -> `claude-*`: the family glob an alias for this name would use."""
    head = model.split("-", 1)[0]
    return f"{head}-*" if head and head != model else model


def requested_route(ctx: RequestContext) -> RouteRequest | None:
    """The lane the client asked for with the route header, or None; InvalidRequest for any other value."""
    value = (ctx.header(ROUTE_HEADER) or "").strip().lower()
    if not value:
        return None
    if value not in ROUTE_VALUES:
        raise InvalidRequest(f"header {ROUTE_HEADER} must be one of {', '.join(ROUTE_VALUES)}", param=ROUTE_HEADER)
    return cast(RouteRequest, value)


class ResolveStage:
    """Sets ctx.requested_route, ctx.priority, ctx.lane, ctx.pool and ctx.target_model."""

    name = "resolve"
    operations = ALL_OPERATIONS

    def __init__(self, catalog: ModelCatalog, priorities: PriorityPolicy | None = None) -> None:
        self.catalog = catalog
        self.priorities = priorities

    async def run(self, ctx: RequestContext) -> Answer | None:
        ctx.requested_route = requested_route(ctx)
        if self.priorities is not None:
            tenant, app = ctx.principal.tenant, ctx.principal.app
            try:
                ctx.priority = self.priorities.resolve(tenant, app, ctx.header(PRIORITY_HEADER), ctx.priority)
            except InvalidInput:
                ctx.priority = self.priorities.resolve(tenant, app, None, ctx.priority)  # the refusal's row: its class
                raise
        catalog = self.catalog
        alias = catalog.alias(ctx.model)
        if alias is not None and alias != ctx.model:
            # NOTE: the aliased name is the model from here on (cache key, routing, the ledger);
            # the client's own name stays on the span.
            ctx.attributes["tierlane.model.alias_of"] = ctx.model
            ctx.model = alias
        if ctx.operation != "embeddings" and ctx.auto:
            pool = catalog.default_pool()
            if pool is not None:
                ctx.lane, ctx.pool, ctx.target_model = "upstream", pool, catalog.pool_model(pool)
            elif catalog.edge_name is not None:
                if not catalog.edge_calibrated():
                    raise UpstreamUnavailable(
                        "model 'auto' has no upstream, and the edge model has no calibration of its own, so it takes "
                        f"no 'auto' requests; name the edge model ({catalog.edge_name!r}) to use it, or calibrate it "
                        "(`tierlane edge calibrate`, or edge.calibrate_on_start)", param="model")
                ctx.lane, ctx.pool, ctx.target_model = "edge", None, catalog.edge_name
            else:
                raise ModelNotFound(
                    "model 'auto' needs an upstream or the edge lane; neither is configured", param="model"
                )
        elif ctx.operation != "embeddings" and ctx.model in catalog.edge_names and ctx.requested_route != "upstream":
            ctx.lane, ctx.pool, ctx.target_model = "edge", None, catalog.edge_name
        else:
            ctx.pool, ctx.target_model = catalog.upstream_for(ctx.model)
            ctx.lane = "upstream"
        return None

    async def close(self) -> None:
        return None


def build(services: Services) -> ResolveStage:
    return ResolveStage(ModelCatalog.from_services(services), PriorityPolicy(services.policy))
