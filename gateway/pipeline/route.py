"""Pipeline stage: the lane (and upstream tier) of `auto` requests; lane policy is enforced for all.

An edge model without a calibration of its own (`Cascade.calibrated`, gateway/edge_calibration.py)
takes no `auto` traffic, whatever the router or a policy rule would pick; requests that name it
(or force its lane with the route header) still reach it.

For `auto`, in order: capabilities (what the edge cannot do goes upstream), the edge decision
(the cascade's calibration, or the router where the cascade is off), then, where the tenant/app
has upstream tiers, the router's score picks the tier of whatever goes upstream (escalations
included): strong at or above the threshold of its target, cost below.

Agent sessions (`lanes.agents`, policies/router/agent_lanes.py), before all that: an agent's
background call goes to the cost tier (or the edge), and a session's main-loop turn to its
session's tier, computed from the conversation itself so that every replica picks the same one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.capabilities import EdgeCapabilities
from gateway.cascade import Cascade
from gateway.context import Answer, RequestContext, RouteDecision, request_prompt
from gateway.errors import PermissionDenied, UpstreamUnavailable
from gateway.lanes import AUTO, FORCEABLE, ROUTE_HEADER
from gateway.pipeline.base import TEXT_OPERATIONS
from gateway.pipeline.embed import ensure_embedding
from gateway.route_quality import QualityProbe
from policies.cache.scope import embedding_text
from policies.router.agent_lanes import (
    FirstScores,
    background_reason,
    fingerprint,
    first_user_message,
    has_tools,
    model_tier,
    session_tier,
    short_or_json,
)
from policies.router.features import Prompt, last_user_text
from policies.router.model import Router
from policies.router.policy import TIERS, LaneTarget, RoutePolicy, RouteRules
from policies.router.route_bound import Scope

if TYPE_CHECKING:
    from gateway.route_quality import RouteQuality
    from gateway.services import Services

log = logging.getLogger(__name__)

# Lane reasons after which the router's score picks the upstream tier, and the reason becomes
# `router_strong` / `router_cost` (the lane reason stays on the span as tierlane.route.lane_reason).
# Forced and capability reasons are kept: they say why the request could not stay local.
TIER_REASONS = frozenset({"calibration_upstream", "router_strong", "router_weak_lane_forbidden",
                          "policy_lane", "edge_unavailable", "calibration_history", "calibration_net_saving",
                          "edge_uncalibrated"})


class RouteStage:
    """Decides edge vs upstream from the router score and the tenant/app policy."""

    name = "route"
    operations = TEXT_OPERATIONS

    def __init__(
        self,
        *,
        router: Router,
        policy: RoutePolicy,
        embedder: Any,
        edge_available: bool | Callable[[], bool],
        upstream_available: bool,
        pool_names: list[str],
        edge_model: str | None,
        pool_model: Callable[[str | None], str | None],
        capabilities: EdgeCapabilities | None = None,
        cascade: Cascade | None = None,
        fallback_precision: str = "fp32",
        quality: RouteQuality | None = None,
    ) -> None:
        self.router = router
        self.policy = policy
        self.embedder = embedder
        self.edge_available = edge_available
        self.upstream_available = upstream_available
        self.pool_names = pool_names
        self.edge_model = edge_model
        self.pool_model = pool_model  # the model an upstream pool is asked for when the policy names none
        self.capabilities = capabilities  # None: no edge engine here
        self.cascade = cascade  # None: no calibrated edge decision, no escalation
        # NOTE: only used without a shared embedder; one thread owns the fallback model.
        self._executor: ThreadPoolExecutor | None = None
        self._fallback_encoder: Any = None
        # the configured embedder.precision: the cache may store the fallback's vector
        self.fallback_precision = fallback_precision
        self.quality = quality  # lanes.upstream.tiers.max_quality_loss: a threshold per region
        # lanes.agents.session_tiers: the router's score of each session's first user message (a saving only)
        self.first_scores = FirstScores()

    def available(self, lane: str) -> bool:
        if lane != "edge":
            return self.upstream_available
        edge = self.edge_available
        # NOTE: asked per request: an edge engine that is restarting after a failure is routed around
        return edge() if callable(edge) else edge

    def edge_calibrated(self) -> bool:
        """Whether `auto` traffic may go to the edge: its model has a calibration of its own.

        Asked per request: a background calibration (edge.calibrate_on_start) may finish at any time.
        Without a cascade (no edge engine, or a stage built without one) nothing is withheld."""
        return self.cascade is None or self.cascade.calibrated

    async def run(self, ctx: RequestContext) -> Answer | None:
        if ctx.operation == "embeddings":
            return None
        header = ctx.requested_route
        rules = self.policy.rules(ctx.principal.tenant, ctx.principal.app)
        if header in FORCEABLE and not rules.allow_force:
            raise PermissionDenied(
                f"tenant {ctx.principal.tenant!r} app {ctx.principal.app!r} may not choose a lane with {ROUTE_HEADER}",
                param=ROUTE_HEADER,
            )
        if not ctx.auto:
            if not rules.allows_model(ctx.model):
                raise PermissionDenied(
                    f"tenant {ctx.principal.tenant!r} app {ctx.principal.app!r} may not ask for model {ctx.model!r} by "
                    "name (lanes.models); send model 'auto' or one of its models", param="model")
            tier = self._named_tier(ctx, rules)
            if tier is not None and rules.tier_names == "auto" and header not in FORCEABLE:
                # a tier's model by name goes through the router like `auto` (lanes.tier_names: auto)
                ctx.attributes["tierlane.route.named_model"] = ctx.model
                ctx.model = AUTO
            else:
                await self._explicit(ctx, rules, forced=header in FORCEABLE)
                ctx.tier = tier if ctx.lane == "upstream" else None
                return None
        if header in FORCEABLE:
            lane, reason = self._reachable(header, "forced", rules)
            if lane == "edge":
                await self._check_pinned(ctx)
            score = await (self._tier_score(ctx, rules) if lane == "upstream" else self._free_score(ctx))
            self._apply(ctx, RouteDecision(lane, score, reason, rules.threshold), rules.target_for(lane), rules)
            return None
        if await self._agent_route(ctx, rules):
            return None
        usable = [lane for lane in rules.lanes if self.available(lane)]
        uncalibrated = "edge" in usable and not self.edge_calibrated()
        if uncalibrated:
            usable.remove("edge")
        if not usable:
            if uncalibrated:
                raise UpstreamUnavailable(
                    "the edge model has no calibration of its own, so it takes no 'auto' requests, and no other lane "
                    f"this tenant/app may use is running; name the edge model ({self.edge_model!r}) to use it, or "
                    "calibrate it (`tierlane edge calibrate`, or edge.calibrate_on_start)"
                )
            raise UpstreamUnavailable(
                f"no lane this tenant/app may use is running (allowed: {', '.join(rules.lanes)})"
            )
        if "edge" in usable and self.capabilities is not None:
            gaps = await self.capabilities.gaps(ctx.operation, ctx.body)
            if gaps:
                ctx.attributes["tierlane.route.capabilities"] = ",".join(sorted({g.capability for g in gaps}))
                if usable == ["edge"]:
                    raise gaps[0].error()
                usable = [lane for lane in usable if lane != "edge"]
                score = await self._tier_score(ctx, rules)
                self._apply(ctx, RouteDecision(usable[0], score, gaps[0].reason, rules.threshold),
                            rules.target_for(usable[0]), rules)
                return None
        if len(usable) == 1:
            lane = usable[0]
            if uncalibrated:
                reason = "edge_uncalibrated"
            elif len(rules.lanes) > 1:
                reason = "edge_unavailable" if lane == "upstream" else "no_upstream"
            else:
                reason = "policy_lane"
            score = await (self._tier_score(ctx, rules) if lane == "upstream" else self._free_score(ctx))
            self._apply(ctx, RouteDecision(lane, score, reason, rules.threshold), rules.target_for(lane), rules)
            return None
        prompt = request_prompt(ctx)
        embedding = await self._embedding(ctx, prompt)
        try:
            score = self.router.score(prompt, embedding)
        except ValueError as exc:
            log.error("router could not score the request: %s", exc)
            raise
        if self.cascade is not None and self.cascade.decides_edge(ctx):
            # NOTE: the edge decision is the calibration's: the measured chance that the
            # configured edge model answers this prompt right. The router was trained on
            # weak/strong upstream pairs, not on this model: its score picks the upstream tier
            # (where the policy has tiers; else it is kept for the record).
            prior = ctx.edge_prior = self.cascade.prior(last_user_text(prompt), embedding)
            threshold = self.cascade.prior_threshold(ctx)
            ctx.attributes["tierlane.edge.prior"] = round(prior, 6)
            lane = "edge" if prior >= threshold else "upstream"
            reason = f"calibration_{lane}"
            if lane == "edge":
                # what the cascade's verdicts so far say: close neighbours escalated, or the edge's
                # net saving is negative and the margin on the threshold holds this prior off
                gate = self.cascade.learned_gate(ctx, embedding, prior, threshold)
                if gate is not None:
                    ctx.attributes["tierlane.edge.margin"] = round(gate.margin, 6)
                    if not gate.try_edge:
                        lane, reason = "upstream", gate.reason
            decision = RouteDecision(lane, score, reason, threshold)
            self._apply(ctx, decision, rules.target_for(lane), rules)
            return None
        decision, target = RoutePolicy.decide_with(rules, score)
        self._apply(ctx, decision, target, rules)
        return None

    async def _agent_route(self, ctx: RequestContext, rules: RouteRules) -> bool:
        """`lanes.agents`: an agent's background call, or a session's main-loop turn on its session's
        tier (True: routed here)."""
        agents = rules.agents
        if ctx.operation != "chat" or not (agents.background.enabled or agents.session_tiers.enabled):
            return False
        model = client_model(ctx)
        if agents.background.enabled:
            why = background_reason(ctx.body, model, agents.background)
            if why is not None and await self._background(ctx, rules, why):
                return True
        if (agents.session_tiers.enabled and ctx.session is not None and has_tools(ctx.body)
                and rules.tiers is not None and rules.allows("upstream") and self.available("upstream")):
            return await self._session(ctx, rules, model)
        return False

    async def _background(self, ctx: RequestContext, rules: RouteRules, why: str) -> bool:
        """A background call: to the edge (lane: edge, where it runs, is allowed, the answer is short
        or a JSON object and the edge can serve it), else to the cost tier (or the one upstream)."""
        settings = rules.agents.background
        cost = rules.tiers["cost"] if rules.tiers is not None else rules.upstream
        ctx.attributes["tierlane.route.background"] = why
        if (settings.lane == "edge" and rules.allows("edge") and self.available("edge") and self.edge_calibrated()
                and self.capabilities is not None
                and short_or_json(ctx.body, settings) and not await self.capabilities.gaps(ctx.operation, ctx.body)):
            self._apply(ctx, RouteDecision("edge", None, "background", rules.threshold), rules.edge, rules, tier=cost)
            return True
        if rules.allows("upstream") and self.available("upstream"):
            self._apply(ctx, RouteDecision("upstream", None, "background", rules.threshold), cost, rules, tier=cost)
            return True
        return False  # nowhere to put it by policy: routed like any request

    async def _session(self, ctx: RequestContext, rules: RouteRules, model: str | None) -> bool:
        """A session's main-loop turn: the tier of its first user message (or of an operator rule on
        the model named), moved up to strong for good once the conversation shows a run signal.

        NOTE: the routing quality bound (lanes.upstream.tiers.max_quality_loss) moves per-request
        picks only: a session's tier is not re-picked per turn, so it is neither bounded nor probed."""
        assert rules.tiers is not None and ctx.session is not None
        settings = rules.agents.session_tiers
        base = model_tier(model, settings)
        score: float | None = None
        if base is None:
            score = await self._first_score(ctx)
            if score is None:
                return False  # no user message to key the session's tier on: routed per request
            tier_target = rules.tier_for(score)
            assert tier_target.tier is not None
            base = tier_target.tier
            ctx.attributes["tierlane.route.session_source"] = "first_message"
        else:
            ctx.attributes["tierlane.route.session_source"] = "model_tiers"
        tier, reason = session_tier(base, ctx.body, settings)
        ctx.attributes["tierlane.route.session_tier"] = base
        target = rules.tiers[tier]
        self._apply(ctx, RouteDecision("upstream", score, reason, rules.threshold), target, rules, tier=target)
        return True

    async def _first_score(self, ctx: RequestContext) -> float | None:
        """The router's score of the session's first user message (kept per session, LRU)."""
        first = first_user_message(ctx.body)
        if first is None:
            return None
        key = (ctx.principal.tenant, ctx.principal.app, str(ctx.session))
        digest = fingerprint(first["content"])
        score = self.first_scores.get(key, digest)
        if score is None:
            prompt: Prompt = [first]
            score = self.router.score(prompt, await self._embed_message(ctx, prompt))
            self.first_scores.put(key, digest, score)
        return score

    async def _embed_message(self, ctx: RequestContext, prompt: Prompt) -> np.ndarray:
        """The embedding of `prompt`'s user text (the request's own where that is the same text)."""
        text = embedding_text({"messages": prompt})
        if ctx.embedding is not None and text == embedding_text(ctx.body):
            return np.asarray(ctx.embedding)
        if self.embedder is not None and text:
            return np.asarray(await self.embedder.embed(text))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="route-embed")
        return np.asarray(await asyncio.get_running_loop().run_in_executor(
            self._executor, self._encode, last_user_text(prompt)))

    def _named_tier(self, ctx: RequestContext, rules: RouteRules) -> str | None:
        """The upstream tier whose model a request names explicitly (None: no tiers, or none matches)."""
        if rules.tiers is None or ctx.lane != "upstream" or ctx.target_model is None:
            return None
        for tier, target in rules.tiers.items():
            pool, model = self._upstream_target(ctx, target)
            if model == ctx.target_model and (pool is None or ctx.pool is None or pool == ctx.pool):
                return tier
        return None

    async def _explicit(self, ctx: RequestContext, rules: RouteRules, forced: bool) -> None:
        """An explicit model fixes the lane (set by the resolve stage); policy may still forbid it."""
        if ctx.lane in ("edge", "upstream") and not rules.allows(ctx.lane):
            raise PermissionDenied(
                f"tenant {ctx.principal.tenant!r} app {ctx.principal.app!r} may not use the {ctx.lane} lane "
                f"(model {ctx.model!r}); allowed: {', '.join(rules.lanes)}",
                param="model",
            )
        if ctx.lane == "edge":
            await self._check_pinned(ctx)
        score = await self._free_score(ctx)
        ctx.route = RouteDecision(ctx.lane, score, "forced" if forced else "explicit_model", rules.threshold)
        self._annotate(ctx, ctx.route, None)

    async def _check_pinned(self, ctx: RequestContext) -> None:
        if self.capabilities is not None:
            await self.capabilities.check_pinned(ctx.operation, ctx.body)

    def _reachable(self, lane: str, reason: str, rules: RouteRules) -> tuple[str, str]:
        if not rules.allows(lane):
            raise PermissionDenied(f"this tenant/app may not use the {lane} lane; allowed: {', '.join(rules.lanes)}",
                                   param=ROUTE_HEADER)
        if self.available(lane):
            return lane, reason
        other = "upstream" if lane == "edge" else "edge"
        if self.available(other) and rules.allows(other):
            return other, "edge_unavailable" if lane == "edge" else "no_upstream"
        raise UpstreamUnavailable(f"the {lane} lane is not running on this gateway")

    async def _tier_score(self, ctx: RequestContext, rules: RouteRules) -> float | None:
        """The router's score where it picks an upstream tier (computing the embedding), else a free one."""
        if rules.tiers is None:
            return await self._free_score(ctx)
        prompt = request_prompt(ctx)
        return self.router.score(prompt, await self._embedding(ctx, prompt))

    async def _free_score(self, ctx: RequestContext) -> float | None:
        """A score for the record when the embedding is already there; never computes one."""
        if ctx.embedding is None:
            return None
        try:
            return self.router.score(request_prompt(ctx), ctx.embedding)
        except ValueError:
            return None

    async def _embedding(self, ctx: RequestContext, prompt: Prompt) -> np.ndarray:
        if ctx.embedding is not None:
            return np.asarray(ctx.embedding)
        if self.embedder is not None and await ensure_embedding(ctx, self.embedder) is not None:
            return np.asarray(ctx.embedding)
        text = last_user_text(prompt)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="route-embed")
        vector = await asyncio.get_running_loop().run_in_executor(self._executor, self._encode, text)
        ctx.embedding = vector
        return np.asarray(vector)

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        self._fallback_encoder = None
        if executor is not None:
            # Off the loop: the worker may still be loading the fallback encoder.
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)

    def _encode(self, text: str) -> np.ndarray:
        from policies.embedding.embedder import load_encoder

        if self._fallback_encoder is None:
            self._fallback_encoder = load_encoder(precision=self.fallback_precision)
        return np.asarray(self._fallback_encoder.encode([text])[0], dtype=np.float32)

    def _apply(self, ctx: RequestContext, decision: RouteDecision, target: LaneTarget, rules: RouteRules,
               tier: LaneTarget | None = None) -> None:
        """`tier`: the upstream target the policy fixed (lanes.agents), not the router's pick."""
        tiered = rules.tiers is not None and decision.score is not None
        if tier is not None:
            if decision.lane == "upstream":
                target = tier
        elif decision.lane == "upstream" and tiered:
            assert decision.score is not None
            target = self._tier(ctx, rules, decision.score)
            if decision.reason in TIER_REASONS:
                ctx.attributes["tierlane.route.lane_reason"] = decision.reason
                decision = RouteDecision("upstream", decision.score, f"router_{target.tier}", decision.threshold)
        ctx.route = decision
        ctx.lane = decision.lane
        ctx.tier = None
        if rules.tiers is not None and ctx.auto:
            # the counterfactual "everything on the strong tier" that savings are also counted against
            ctx.strong_target = self._upstream_target(ctx, rules.tiers["strong"])
        if decision.lane == "edge":
            if (ctx.auto and decision.reason != "forced" and self.cascade is not None
                    and self.available("upstream") and rules.allows("upstream")):
                # where the cascade sends an edge answer that fails its check: the tier the router picks
                if tier is not None:
                    fallback = tier
                elif tiered and decision.score is not None:
                    fallback = self._tier(ctx, rules, decision.score)
                else:
                    fallback = rules.upstream
                ctx.fallback = self._upstream_target(ctx, fallback)
                ctx.fallback_tier = fallback.tier
                if fallback.tier is not None:
                    ctx.attributes["tierlane.route.fallback_tier"] = fallback.tier
            ctx.pool = None
            ctx.target_model = target.model or self.edge_model
        else:
            ctx.pool, ctx.target_model = self._upstream_target(ctx, target)
            ctx.tier = target.tier
        self._annotate(ctx, decision, target)

    def _tier(self, ctx: RequestContext, rules: RouteRules, score: float) -> LaneTarget:
        """The tier for `score`: at the rules' threshold, or under a quality bound at its region's
        (and the request carries a probe the shadow stage may judge it by)."""
        quality, bound = self.quality, rules.quality
        if quality is None or bound is None or rules.tiers is None or ctx.embedding is None or not ctx.auto:
            return rules.tier_for(score)
        region = quality.region_of(ctx.embedding)
        if region is None:
            return rules.tier_for(score)
        scope = Scope(ctx.principal.tenant, ctx.principal.app)
        bound = quality.params(bound)
        threshold = quality.bounds.threshold(scope, region, bound)
        ctx.quality_probe = QualityProbe(scope, region, bound, float(score), threshold,
                                         {tier: self._upstream_target(ctx, rules.tiers[tier]) for tier in TIERS})
        ctx.attributes["tierlane.route.region"] = region
        ctx.attributes["tierlane.route.region_threshold"] = round(threshold, 6)
        return rules.tier_for(score, threshold)

    def _upstream_target(self, ctx: RequestContext, target: LaneTarget) -> tuple[str | None, str | None]:
        pool: str | None
        if target.pool in self.pool_names:
            pool = target.pool
        elif ctx.pool in self.pool_names:
            pool = ctx.pool
        else:
            pool = self.pool_names[0] if self.pool_names else None
        return pool, target.model or self.pool_model(pool)

    @staticmethod
    def _annotate(ctx: RequestContext, decision: RouteDecision, target: LaneTarget | None) -> None:
        attrs = ctx.attributes
        attrs["tierlane.route.lane"] = decision.lane
        attrs["tierlane.route.reason"] = decision.reason
        if decision.score is not None:
            attrs["tierlane.route.score"] = round(decision.score, 6)
        if decision.threshold is not None:
            attrs["tierlane.route.threshold"] = round(decision.threshold, 6)
        if target is not None and target.precision:
            attrs["tierlane.route.precision"] = target.precision
        if target is not None and target.tier is not None and decision.lane == "upstream":
            attrs["tierlane.route.tier"] = target.tier


def client_model(ctx: RequestContext) -> str | None:
    """The model name the client asked for, before the settings' model_aliases and tier_names."""
    named = ctx.client_model or ctx.attributes.get("tierlane.model.alias_of") or ctx.attributes.get(
        "tierlane.route.named_model")
    return str(named) if named else ctx.model


def _no_model(pool: str | None) -> str | None:
    return None


def _engine_up(engine: Any) -> bool | Callable[[], bool]:
    if engine is None:
        return False
    return lambda: bool(getattr(engine, "available", True))


def build(services: Services) -> RouteStage | None:
    """The route stage, or None when the router is switched off in policy."""
    section = services.policy.section("router")
    if not section.get("enabled", True):
        return None
    router = services.router if isinstance(services.router, Router) else Router.load(section.get("artifact"))
    pool = services.pool
    has_upstreams = bool(pool is not None and pool.has_upstreams())
    edge_settings = getattr(getattr(services, "settings", None), "edge", None)
    return RouteStage(
        router=router,
        policy=RoutePolicy(services.policy, router),
        embedder=services.embedder,
        edge_available=_engine_up(services.engine),
        upstream_available=has_upstreams,
        pool_names=list(pool.pool_names()) if has_upstreams else [],
        edge_model=getattr(edge_settings, "model_name", None),
        pool_model=pool.default_model if has_upstreams else _no_model,
        capabilities=EdgeCapabilities(services.engine) if services.engine is not None else None,
        cascade=services.cascade,
        fallback_precision=getattr(getattr(getattr(services, "settings", None), "embedder", None), "precision", "fp32"),
        quality=getattr(services, "route_quality", None),
    )
