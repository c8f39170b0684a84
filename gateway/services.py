"""The long-lived components one gateway runs with, built once by `create_app`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge_engine.engine import EdgeEngine
    from gateway.apis.response_store import ResponseStore
    from gateway.cascade import Cascade
    from gateway.route_quality import RouteQuality
    from gateway.settings import Settings
    from gateway.upstream.pool import UpstreamPool
    from policies.cache.backend import CacheBackend
    from policies.embedding.embedder import Embedder
    from policies.learn.service import Learning
    from policies.policy import Policy
    from policies.router.model import Router
    from telemetry.core import Telemetry


@dataclass(slots=True, kw_only=True)
class Services:
    """Components are None when switched off; stages check for what they need."""

    settings: Settings
    policy: Policy
    pool: UpstreamPool
    engine: EdgeEngine | None = None  # the local GGUF lane
    embedder: Embedder | None = None  # micro-batched sentence embeddings, shared by cache and router
    cache: CacheBackend | None = None  # SemanticCache (embedded) or SharedCache (state.backend: redis)
    router: Router | None = None  # the complexity router (loaded by the route stage when None)
    telemetry: Telemetry | None = None  # tracer, meters, ledger, budgets
    cascade: Cascade | None = None  # the edge lane's calibrated decision and confidence check
    responses: ResponseStore | None = None  # stored responses of the Responses API
    route_quality: RouteQuality | None = None  # lanes.upstream.tiers.max_quality_loss: regions and learnt thresholds
    learn: Learning | None = None  # policy `learn`: the templates named to learn and their (input, answer) pairs
    # seconds each part took to start (pool, then every component), in order: /readyz reports them
    startup_s: dict[str, float] = field(default_factory=dict)
    # what an operator must fix for the figures to be right (logged at start, shown on the dashboard)
    warnings: list[str] = field(default_factory=list)
