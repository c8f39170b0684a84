"""Upstream tiers whose model has no price: the saving of routing between them cannot be shown.

With `lanes.upstream.tiers`, the money saved by sending a request to the cost tier is the strong
tier's price less the cost tier's. A tier model missing from `pricing.models` (and its pool from
`pricing.pools`) is priced as `pricing.unknown_model` (a fallback, the default upstream model's
price unless set), so both tiers may cost the same and every cost-tier answer records
`saved_vs_strong = 0`: the operator sees no saving where there is one. The gateway says so at
start (a warning in the log) and on the dashboard, naming the model and the setting to add.
"""

from __future__ import annotations

from policies.policy import Policy
from policies.pricing import Pricing
from policies.router.policy import tier_targets


def unpriced_tier_warnings(policy: Policy) -> list[str]:
    """One sentence per tier target (tier, pool, model) that pricing does not price itself."""
    pricing = Pricing.from_policy(policy)
    out = []
    for target in tier_targets(policy):
        if target.pool in pricing.pools or (target.model is not None and target.model in pricing.models):
            continue
        model = target.model or f"the default model of pool {target.pool}"
        out.append(
            f"upstream tier {target.tier!r} (pool {target.pool}, model {model!r}) has no price: it is priced as "
            f"pricing.unknown_model, so savings against the strong tier read 0 where they are not; add "
            f"pricing.models.{target.model or '<model>'}: {{input: <USD per 1M>, output: <USD per 1M>}} "
            f"(or pricing.pools.{target.pool})"
        )
    return out
