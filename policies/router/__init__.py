"""The complexity router: a light, calibrated estimate of whether a prompt needs the strong lane."""

from policies.router.artifact import RouterArtifactError
from policies.router.model import Router
from policies.router.policy import LaneTarget, RoutePolicy, RouteRules

__all__ = ["LaneTarget", "RoutePolicy", "RouteRules", "Router", "RouterArtifactError"]
