"""Turns a router score into a lane for one tenant/app, from the `router` and `lanes` policy sections."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from policies.domain import RouteDecision
from policies.policy import Policy
from policies.router.agent_lanes import AgentRules, parse_agents
from policies.router.calibration import TARGET_MODES
from policies.router.model import Router
from policies.router.route_bound import QualityBound

LANES = ("edge", "upstream")
# Upstream tiers for `auto`: the router sends what it scores as needing the strong model to
# `strong`, the rest to `cost`. Fixed names: they are metric labels and a ledger column.
TIERS = ("cost", "strong")
# `lanes.upstream.tiers` keys of the routing quality bound (policies/router/route_bound.py) beside the tiers
QUALITY_KEYS = {"max_quality_loss": "max_quality_loss", "quality_sample_rate": "sample_rate",
                "quality_confidence": "confidence", "quality_loosen_after": "loosen_after"}


@dataclass(slots=True, frozen=True)
class LaneTarget:
    """Where a lane sends a request: upstream pool (None for edge), model name and precision tier."""

    lane: str
    pool: str | None
    model: str | None
    precision: str | None
    tier: str | None = None  # "cost" | "strong" when the tenant/app has upstream tiers


@dataclass(slots=True, frozen=True)
class RouteRules:
    """The resolved rules for one tenant/app."""

    threshold: float
    target: str  # e.g. "min_strong_quality=0.95", for the span
    allow_force: bool
    lanes: tuple[str, ...]
    edge: LaneTarget
    upstream: LaneTarget
    tiers: dict[str, LaneTarget] | None = None  # both of TIERS, or None: one upstream tier (`upstream`)
    models: tuple[str, ...] | None = None  # `lanes.models`: the model names (globs) it may name; None: any
    tier_names: str = "direct"  # `lanes.tier_names`: a named tier model is served directly, or routed as `auto`
    quality: QualityBound | None = None  # `lanes.upstream.tiers.max_quality_loss`: the routing quality bound; None: off
    agents: AgentRules = AgentRules()  # `lanes.agents`: background calls and session tiers (policies/router/agent_lanes.py)

    def allows(self, lane: str) -> bool:
        return lane in self.lanes

    def allows_model(self, model: str) -> bool:
        """Whether this tenant/app may name `model` (after aliases); `auto` is always allowed."""
        return self.models is None or any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    def target_for(self, lane: str) -> LaneTarget:
        return self.edge if lane == "edge" else self.upstream

    def tier_for(self, score: float, threshold: float | None = None) -> LaneTarget:
        """The upstream tier for a router score: strong when it reaches the threshold (the rules' own, or
        a region's under the quality bound), else cost.

        Only with tiers; a tenant/app without them has the one upstream target."""
        if self.tiers is None:
            return self.upstream
        return self.tiers["strong" if score >= (self.threshold if threshold is None else threshold) else "cost"]


def _target(section: dict[str, Any]) -> tuple[str, float]:
    target = section.get("target") or {}
    if not isinstance(target, dict):
        raise ValueError("router.target must be a mapping {mode, value}")
    mode = str(target.get("mode", "threshold"))
    if mode not in TARGET_MODES:
        raise ValueError(f"router.target.mode {mode!r} is not one of {', '.join(TARGET_MODES)}")
    try:
        value = float(target.get("value", 0.5))
    except (TypeError, ValueError):
        raise ValueError(f"router.target.value must be a number, got {target.get('value')!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"router.target.value must be in [0, 1], got {value}")
    return mode, value


def _tiers(upstream: dict[str, Any]) -> dict[str, LaneTarget] | None:
    """`lanes.upstream.tiers`: {cost: {pool, model}, strong: {pool, model}}, or None (one tier)."""
    raw = upstream.get("tiers")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not set(TIERS) <= set(raw) or set(raw) - set(TIERS) - set(QUALITY_KEYS):
        raise ValueError(f"lanes.upstream.tiers must name exactly the tiers {', '.join(TIERS)} (or be null), and may set "
                         f"{', '.join(QUALITY_KEYS)}")
    pools = upstream.get("pools") or {}
    out: dict[str, LaneTarget] = {}
    for tier in TIERS:
        entry = raw[tier]
        if not isinstance(entry, dict):
            raise ValueError(f"lanes.upstream.tiers.{tier} must be a mapping {{pool, model}}")
        unknown = set(entry) - {"pool", "model"}
        if unknown:
            raise ValueError(f"lanes.upstream.tiers.{tier} has unknown key(s) {sorted(unknown)}; keys are pool, model")
        pool = str(entry.get("pool") or "")
        pool_cfg = pools.get(pool)
        if pool_cfg is None:
            raise ValueError(f"lanes.upstream.tiers.{tier}.pool {pool!r} is not listed under lanes.upstream.pools")
        model = entry.get("model") or pool_cfg.get("model")
        out[tier] = LaneTarget("upstream", pool, None if model is None else str(model), pool_cfg.get("precision"), tier)
    return out


def _quality(upstream: dict[str, Any], start: float) -> QualityBound | None:
    """The routing quality bound of `lanes.upstream.tiers` (None: max_quality_loss unset)."""
    raw = upstream.get("tiers")
    if not isinstance(raw, dict) or raw.get("max_quality_loss") is None:
        return None
    try:
        values: dict[str, Any] = {field: raw[key] for key, field in QUALITY_KEYS.items() if raw.get(key) is not None}
        for name in ("max_quality_loss", "sample_rate", "confidence"):
            if name in values:
                values[name] = float(values[name])
        if "loosen_after" in values:
            values["loosen_after"] = int(values["loosen_after"])
        return QualityBound(start=start, **values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"lanes.upstream.tiers: {exc}") from None


def lanes_sections(policy: Policy) -> list[dict[str, Any]]:
    """The `lanes` section as the base and as each override sets it (merged one level deep)."""
    base = {k: v for k, v in policy.section("lanes").items() if k != "overrides"}
    out = [base]
    for rule in policy.section("lanes").get("overrides") or []:
        merged = dict(base)
        for key, value in (rule.get("set") or {}).items():
            merged[key] = {**(merged.get(key) or {}), **value} if isinstance(value, dict) else value
        out.append(merged)
    return out


def tier_targets(policy: Policy) -> list[LaneTarget]:
    """Every upstream tier target the policy names (base and overrides), each once."""
    seen: dict[LaneTarget, None] = {}
    for lanes in lanes_sections(policy):
        for target in (_tiers(lanes.get("upstream") or {}) or {}).values():
            seen[target] = None
    return list(seen)


# Resolved rules kept per (tenant, app); past this many, further pairs are resolved per request.
MAX_KEPT_RULES = 10_000


class RoutePolicy:
    """Per-tenant/app thresholds, lane permissions and lane targets; `decide` applies them to a score."""

    def __init__(self, policy: Policy, router: Router | None) -> None:
        self.policy = policy
        self.router = router
        # NOTE: keyed by (mode, value) from the policy file, so it stays as small as the policy.
        self._thresholds: dict[tuple[str, float], float] = {}
        # Rules per (tenant, app), resolved once: the policy does not change while it is in use.
        self._rules: dict[tuple[str | None, str | None], RouteRules] = {}
        self.validate()

    def validate(self) -> None:
        """Check the base sections and every override now, so bad policy fails at start-up."""
        router_sec = {k: v for k, v in self.policy.section("router").items() if k != "overrides"}
        lanes = lanes_sections(self.policy)
        self._build(router_sec, lanes[0])
        for rule in self.policy.section("router").get("overrides") or []:
            self._build({**router_sec, **(rule.get("set") or {})}, lanes[0])
        for merged in lanes[1:]:
            self._build(router_sec, merged)

    def rules(self, tenant: str | None, app: str | None) -> RouteRules:
        """The rules that apply to this tenant and app (resolved on first use, then kept)."""
        key = (tenant, app)
        found = self._rules.get(key)
        if found is None:
            found = self._build(
                self.policy.resolve("router", tenant=tenant, app=app),
                self.policy.resolve("lanes", tenant=tenant, app=app),
            )
            if len(self._rules) < MAX_KEPT_RULES:  # bounded: tenant and app names come from the keys
                self._rules[key] = found
        return found

    def _threshold(self, mode: str, value: float) -> float:
        key = (mode, value)
        if key not in self._thresholds:
            if mode != "threshold" and self.router is None:
                raise ValueError(f"router target mode {mode!r} needs a router model")
            self._thresholds[key] = value if self.router is None else self.router.threshold_for(mode, value)
        return self._thresholds[key]

    def _build(self, router_sec: dict[str, Any], lanes_sec: dict[str, Any]) -> RouteRules:
        mode, value = _target(router_sec)
        lanes = LANES if router_sec.get("lanes") is None else tuple(router_sec["lanes"])
        if not lanes:
            raise ValueError("router.lanes must name at least one lane")
        unknown = [lane for lane in lanes if lane not in LANES]
        if unknown:
            raise ValueError(f"router.lanes lists unknown lane(s) {unknown}; lanes are {', '.join(LANES)}")
        edge = lanes_sec.get("edge") or {}
        upstream = lanes_sec.get("upstream") or {}
        pool = str(upstream.get("pool") or "standard")
        pool_cfg = (upstream.get("pools") or {}).get(pool)
        if pool_cfg is None:
            raise ValueError(f"lanes.upstream.pool {pool!r} is not listed under lanes.upstream.pools")
        models = lanes_sec.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise ValueError("lanes.models must be a list of model names (globs allowed) or null")
        tier_names = str(lanes_sec.get("tier_names") or "direct")
        if tier_names not in ("direct", "auto"):
            raise ValueError(f"lanes.tier_names must be direct or auto, got {tier_names!r}")
        threshold = self._threshold(mode, value)
        return RouteRules(
            agents=parse_agents(lanes_sec.get("agents")),
            quality=_quality(upstream, threshold),
            models=None if models is None else tuple(models),
            tier_names=tier_names,
            threshold=threshold,
            target=f"{mode}={value:g}",
            allow_force=bool(router_sec.get("allow_force", True)),
            lanes=lanes,
            edge=LaneTarget("edge", None, edge.get("model"), edge.get("precision")),
            upstream=LaneTarget("upstream", pool, pool_cfg.get("model"), pool_cfg.get("precision")),
            tiers=_tiers(upstream),
        )

    def decide(self, score: float, tenant: str | None, app: str | None) -> tuple[RouteDecision, LaneTarget]:
        """The lane for a router score: upstream when score >= threshold (if this tenant/app may use it)."""
        rules = self.rules(tenant, app)
        return self.decide_with(rules, score)

    @staticmethod
    def decide_with(rules: RouteRules, score: float) -> tuple[RouteDecision, LaneTarget]:
        lane = "upstream" if score >= rules.threshold else "edge"
        reason = "router_strong" if lane == "upstream" else "router_weak"
        if not rules.allows(lane):
            lane = rules.lanes[0]
            reason = f"{reason}_lane_forbidden"
        decision = RouteDecision(lane=lane, score=score, reason=reason, threshold=rules.threshold)
        return decision, rules.target_for(lane)
