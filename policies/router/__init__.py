"""Routing: the complexity router (a light, calibrated estimate of whether a prompt needs the strong
lane), its regions, the quality bound on what the cost tier loses (route_bound, kept by
route_bound_log), the answer-agreement judge that feeds the bound, and the tiers' price check."""

from policies.router.artifact import RouterArtifactError
from policies.router.model import Router
from policies.router.policy import LaneTarget, RoutePolicy, RouteRules

__all__ = ["LaneTarget", "RoutePolicy", "RouteRules", "Router", "RouterArtifactError"]
