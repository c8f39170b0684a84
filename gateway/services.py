"""The long-lived components one gateway runs with, built once by `create_app`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.settings import Settings
    from gateway.upstream.pool import UpstreamPool
    from policies.policy import Policy


@dataclass(slots=True, kw_only=True)
class Services:
    """Components are None when switched off; stages check for what they need."""

    settings: Settings
    policy: Policy
    pool: UpstreamPool
    engine: Any = None  # edge_engine.EdgeEngine: the local GGUF lane
    embedder: Any = None  # policies.embedder.Embedder: micro-batched sentence embeddings
    cache: Any = None  # policies.cache: the semantic cache
    router: Any = None  # policies.router: the complexity router
    telemetry: Any = None  # telemetry: tracer, meters, ledger
