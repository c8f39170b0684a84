"""What one request cost, and what it saved against the lane it would otherwise have gone to."""

from __future__ import annotations

from dataclasses import dataclass

from policies.domain import Usage
from policies.pricing import Pricing
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

    @property
    def saved(self) -> float:
        return self.saved_cache + self.saved_edge + self.saved_trim

    def saved_by_reason(self) -> dict[str, float]:
        return {"cache": self.saved_cache, "edge": self.saved_edge, "trim": self.saved_trim}


def _non_negative(usage: Usage) -> Usage:
    """`usage` with every count at least 0 (a Usage built by hand is not validated on the way in)."""
    counts = (usage.input_tokens, usage.output_tokens, usage.cached_input_tokens)
    if min(counts) >= 0:
        return usage
    return Usage(
        input_tokens=max(0, usage.input_tokens),
        output_tokens=max(0, usage.output_tokens),
        cached_input_tokens=max(0, usage.cached_input_tokens),
        estimated=usage.estimated,
    )


def _money(amount: float) -> float:
    """A cost as stored: never negative (NaN, which no comparison admits, becomes 0 too)."""
    return amount if amount > 0.0 else 0.0


def _escalated_usage(ctx: MeteredRequest) -> Usage:
    check = ctx.edge_check
    if check is None or not check.escalated:
        return Usage()
    return Usage(input_tokens=max(0, check.edge_input_tokens), output_tokens=max(0, check.edge_output_tokens))


def compute_bill(ctx: MeteredRequest, usage: Usage, pricing: Pricing) -> Bill:
    """Price `usage` on the lane that answered ctx and split the savings by reason.

    The cost is never negative: negative token counts price as 0 and the cost is clamped at 0,
    so no row can pay a budget back. Savings may be negative (a cache hit can cost more than
    the tokens it avoided).
    """
    usage = _non_negative(usage)
    trimmed = sum(max(0, n) for n in ctx.trim_saved.values())
    if ctx.lane == "upstream":
        model = ctx.target_model or ctx.model
        price = pricing.upstream(model)
        # An answer the edge drafted and the cascade escalated: its tokens were spent for
        # nothing the client got, so they are a cost of this request and a negative edge saving.
        wasted = _money(pricing.edge.cost(_escalated_usage(ctx), cache_discount=False))
        return Bill(
            cost=_money(price.cost(usage)) + wasted,
            saved_cache=0.0,
            saved_edge=-wasted,
            saved_trim=price.input_cost(trimmed),
            counterfactual_model=model,
            trimmed_tokens=trimmed,
        )
    counterfactual = pricing.counterfactual_model(ctx.model)
    reference = pricing.upstream(counterfactual)
    # The counterfactual upstream is not assumed to have served any of it from its own prompt cache.
    avoided = reference.cost(usage, cache_discount=False)
    if ctx.lane == "cache":
        cost = _money(pricing.cache_per_request)
        saved_cache, saved_edge = avoided - cost, 0.0
    else:
        cost = _money(pricing.edge.cost(usage, cache_discount=False))
        saved_cache, saved_edge = 0.0, avoided - cost
    return Bill(
        cost=cost,
        saved_cache=saved_cache,
        saved_edge=saved_edge,
        saved_trim=reference.input_cost(trimmed),
        counterfactual_model=counterfactual,
        trimmed_tokens=trimmed,
    )
