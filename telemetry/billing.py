"""What one request cost, and what it saved against the lane it would otherwise have gone to.

Prices are per token, per request and per second of upstream time (policies/pricing.py), in any
combination. Besides the split by reason (cache, edge, trim), every bill states two
counterfactuals: the cost had the request gone to the strong tier (`cost_strong`; without upstream
tiers, the same as the next) and had it gone to the model the client named (`cost_named`: a
priced model it asked for, else `default_upstream_model`). Both are of the untrimmed request; an
escalated edge attempt is part of the cost, so it is netted out of both savings.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.domain import Usage
from policies.pricing import PER_MILLION, Pricing, TokenPrice
from policies.trim.config import MASKING
from telemetry import attributes as a
from telemetry.record import MeteredRequest


@dataclass(slots=True, frozen=True)
class Bill:
    """Cost and counterfactual savings of one request, in USD.

    `saved_cache` and `saved_edge` are the counterfactual upstream price of the tokens minus
    what the lane cost; `saved_trim` is the removed input tokens at the counterfactual input
    price. Their sum is exactly (counterfactual cost of the untrimmed request) - cost.
    """

    cost: float
    saved_cache: float
    saved_edge: float
    saved_trim: float
    counterfactual_model: str
    trimmed_tokens: int
    # observation masking (trim.agent_context), priced apart from `saved` since its tokens would
    # have been cache reads: masked tokens at the cached price less the cache rewrite a step
    # caused; in shadow mode what it would have saved, on the same terms
    saved_mask: float = 0.0
    masked_tokens: int = 0
    mask_write_tokens: int = 0
    cost_strong: float = 0.0  # the same request on the strong tier
    cost_named: float = 0.0  # the same request on the model the client named
    strong_model: str | None = None
    named_model: str | None = None

    @property
    def saved_vs_strong(self) -> float:
        return self.cost_strong - self.cost

    @property
    def saved_vs_named(self) -> float:
        return self.cost_named - self.cost

    @property
    def saved(self) -> float:
        return self.saved_cache + self.saved_edge + self.saved_trim

    def saved_by_reason(self) -> dict[str, float]:
        return {"cache": self.saved_cache, "edge": self.saved_edge, "trim": self.saved_trim}


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _non_negative(usage: Usage) -> Usage:
    """`usage` with every count at least 0 (a Usage built by hand is not validated on the way in)."""
    counts = (usage.input_tokens, usage.output_tokens, usage.cached_input_tokens, usage.cache_write_tokens,
              usage.cache_write_1h_tokens)
    if min(counts) >= 0:
        return usage
    return Usage(
        input_tokens=max(0, usage.input_tokens),
        output_tokens=max(0, usage.output_tokens),
        cached_input_tokens=max(0, usage.cached_input_tokens),
        estimated=usage.estimated,
        cache_write_tokens=max(0, usage.cache_write_tokens),
        cache_write_1h_tokens=max(0, usage.cache_write_1h_tokens),
    )


def _money(amount: float) -> float:
    """A cost as stored: never negative (NaN, which no comparison admits, becomes 0 too)."""
    return amount if amount > 0.0 else 0.0


def _escalated_usage(ctx: MeteredRequest) -> Usage:
    check = ctx.edge_check
    if check is None or not check.escalated:
        return Usage()
    return Usage(input_tokens=max(0, check.edge_input_tokens), output_tokens=max(0, check.edge_output_tokens))


def _seconds(value: float) -> float:
    return value if value > 0.0 else 0.0


def compute_bill(ctx: MeteredRequest, usage: Usage, pricing: Pricing) -> Bill:
    """Price `usage` on the lane that answered ctx, split the savings by reason, and price the
    two counterfactuals (strong tier, named model).

    The cost is never negative: negative token counts price as 0 and the cost is clamped at 0,
    so no row can pay a budget back. Savings may be negative (a cache hit can cost more than
    the tokens it avoided). A batch-priority request is priced, and its savings counted, at the
    batch tariff.
    """
    usage = _non_negative(usage)
    pricing = pricing.for_priority(ctx.priority)  # batch work: the upstream prices less pricing.batch_discount
    trimmed = sum(max(0, n) for name, n in ctx.trim_saved.items() if name != MASKING)
    untrimmed = Usage(input_tokens=usage.input_tokens + trimmed, output_tokens=usage.output_tokens,
                      cached_input_tokens=usage.cached_input_tokens, cache_write_tokens=usage.cache_write_tokens,
                      cache_write_1h_tokens=usage.cache_write_1h_tokens)
    named_model = pricing.counterfactual_model(ctx.model)
    strong_pool, strong_model = ctx.strong_target if ctx.strong_target is not None else (None, named_model)
    strong_price = pricing.upstream(strong_model, strong_pool)
    named_price = pricing.upstream(named_model)
    if ctx.lane == "upstream":
        model = ctx.target_model or ctx.model
        price = pricing.upstream(model, ctx.pool)
        escalated = ctx.edge_check is not None and ctx.edge_check.escalated
        edge_seconds = _seconds(ctx.edge_seconds) if escalated else 0.0
        seconds = _seconds(ctx.lane_seconds - edge_seconds)  # the upstream's own time
        # An answer the edge drafted and the cascade escalated: its tokens (and time) were spent
        # for nothing the client got, so they are a cost of this request and a negative edge saving.
        wasted = _money(pricing.edge.charge(_escalated_usage(ctx), edge_seconds, cache_discount=False)) if escalated else 0.0
        served = _money(price.charge(usage, seconds))

        def had_gone_to(other: TokenPrice) -> float:
            if other is price:  # the same upstream: its cost, untrimmed, without the edge's attempt
                return _money(price.charge(untrimmed, seconds))
            taken = other.estimated_seconds(usage) if other.tokens_per_second else seconds
            return _money(other.charge(untrimmed, taken, cache_discount=False))

        masked, rewritten = _count(ctx.attributes.get(a.MASKED_TOKENS)), _count(ctx.attributes.get(a.MASK_WRITE_TOKENS))
        return Bill(
            cost=served + wasted,
            saved_cache=0.0,
            saved_edge=-wasted,
            saved_trim=price.input_cost(trimmed),
            saved_mask=(masked * price.cached_input - rewritten * max(0.0, price.cache_write - price.cached_input))
            / PER_MILLION,
            masked_tokens=masked,
            mask_write_tokens=rewritten,
            counterfactual_model=model,
            trimmed_tokens=trimmed,
            cost_strong=had_gone_to(strong_price),
            cost_named=had_gone_to(named_price),
            strong_model=strong_model,
            named_model=named_model,
        )
    counterfactual = named_model
    reference = named_price
    # The counterfactual upstream is not assumed to have served any of it from its own prompt cache.
    avoided = reference.charge(usage, reference.estimated_seconds(usage), cache_discount=False)
    if ctx.lane == "cache":
        cost = _money(pricing.cache_per_request)
        saved_cache, saved_edge = avoided - cost, 0.0
    else:
        cost = _money(pricing.edge.charge(usage, _seconds(ctx.lane_seconds), cache_discount=False))
        saved_cache, saved_edge = 0.0, avoided - cost
    return Bill(
        cost=cost,
        saved_cache=saved_cache,
        saved_edge=saved_edge,
        saved_trim=reference.input_cost(trimmed),
        counterfactual_model=counterfactual,
        trimmed_tokens=trimmed,
        cost_strong=_money(strong_price.charge(untrimmed, strong_price.estimated_seconds(usage), cache_discount=False)),
        cost_named=_money(named_price.charge(untrimmed, named_price.estimated_seconds(usage), cache_discount=False)),
        strong_model=strong_model,
        named_model=named_model,
    )
