"""The routing quality bound as one gateway runs it: the regions, the learnt thresholds and their log.

Built (gateway/components.py) when some tenant/app sets `lanes.upstream.tiers.max_quality_loss`.
The route stage asks it for a region's threshold; the shadow stage records judgements through
its log (policies/router/route_bound_log.py: a file with `state.backend: embedded`, the shared stream
with `redis`); the meter counts each tiered request and what it saved; the dashboard reads
`stats()`. The algorithm is policies/router/route_bound.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from policies.router.policy import lanes_sections
from policies.router.regions import Regions
from policies.router.route_bound import QualityBound, RegionStats, RouteBounds, Scope
from policies.router.route_bound_log import BoundLog, LocalBoundLog, SharedBoundLog

if TYPE_CHECKING:
    from gateway.settings import Settings
    from policies.policy import Policy

log = logging.getLogger(__name__)

Target = tuple[str | None, str | None]  # (pool, model)


@dataclass(slots=True, frozen=True)
class QualityProbe:
    """Where one tiered request stands under the bound: what the shadow stage needs to judge it."""

    scope: Scope  # tenant and app, apart
    region: int
    params: QualityBound
    score: float  # the router's score
    threshold: float  # the region's threshold it was routed at
    targets: dict[str, Target]  # (pool, model) of each tier, to re-ask the other one


class RouteQuality:
    """Regions + the log that holds the bounds; one per gateway."""

    def __init__(self, regions: Regions, log_: BoundLog) -> None:
        self.regions = regions
        self.log = log_
        self._digest = regions.digest  # hashed once, not per request
        # the policy's bounds tied to these regions; as many as the policy has bounds (rules are cached per tenant/app)
        self._params: dict[QualityBound, QualityBound] = {}
        self._mismatch_logged = False

    @property
    def bounds(self) -> RouteBounds:
        return self.log.bounds

    def params(self, bound: QualityBound) -> QualityBound:
        """The policy's bound, tied to these regions (a state learnt under other centroids starts again)."""
        tied = self._params.get(bound)
        if tied is None:
            tied = bound if bound.regions == self._digest else replace(bound, regions=self._digest)
            if len(self._params) < 1024:
                self._params[bound] = tied
        return tied

    def region_of(self, embedding: Any) -> int | None:
        try:
            return self.regions.of(embedding)
        except ValueError as exc:  # an embedder of another size: no region, the router decides
            if not self._mismatch_logged:
                self._mismatch_logged = True
                log.error("routing quality bound off: %s", exc)
            return None

    async def record(self, probe: QualityProbe, *, disagree: bool) -> None:
        await self.log.record(probe.scope, probe.region, probe.params, probe.score, disagree=disagree)

    def stats(self) -> list[RegionStats]:
        return self.bounds.stats()

    async def close(self) -> None:
        await self.log.close()


def quality_on(policy: Policy) -> bool:
    """Whether any tenant/app sets `lanes.upstream.tiers.max_quality_loss`."""
    for lanes in lanes_sections(policy):
        tiers = (lanes.get("upstream") or {}).get("tiers")
        if isinstance(tiers, dict) and tiers.get("max_quality_loss") is not None:
            return True
    return False


async def open_route_quality(settings: Settings, policy: Policy) -> RouteQuality:
    regions = Regions.load()
    state = settings.state
    log_: BoundLog
    if state.backend == "redis":
        log_ = SharedBoundLog.connect(
            state.url, key_prefix=state.key_prefix, connect_timeout_s=state.connect_timeout_ms / 1000.0,
            op_timeout_s=state.op_timeout_ms / 1000.0, stream_max_len=state.cache_stream_max_len,
        )  # fmt: skip
    else:
        log_ = LocalBoundLog(settings.state_dir)
    await log_.start()
    return RouteQuality(regions, log_)
