"""What one request cost, and what it saved against the lane it would otherwise have gone to."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.context import RequestContext, Usage
from policies.pricing import Pricing


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


def compute_bill(ctx: RequestContext, usage: Usage, pricing: Pricing) -> Bill:
    """Price `usage` on the lane that answered ctx and split the savings by reason."""
    trimmed = sum(max(0, n) for n in ctx.trim_saved.values())
    if ctx.lane == "upstream":
        model = ctx.target_model or ctx.model
        price = pricing.upstream(model)
        return Bill(
            cost=price.cost(usage),
            saved_cache=0.0,
            saved_edge=0.0,
            saved_trim=price.input_cost(trimmed),
            counterfactual_model=model,
            trimmed_tokens=trimmed,
        )
    counterfactual = pricing.counterfactual_model(ctx.model)
    reference = pricing.upstream(counterfactual)
    # The counterfactual upstream is not assumed to have served any of it from its own prompt cache.
    avoided = reference.cost(usage, cache_discount=False)
    if ctx.lane == "cache":
        cost = pricing.cache_per_request
        saved_cache, saved_edge = avoided - cost, 0.0
    else:
        cost = pricing.edge.cost(usage, cache_discount=False)
        saved_cache, saved_edge = 0.0, avoided - cost
    return Bill(
        cost=cost,
        saved_cache=saved_cache,
        saved_edge=saved_edge,
        saved_trim=reference.input_cost(trimmed),
        counterfactual_model=counterfactual,
        trimmed_tokens=trimmed,
    )
