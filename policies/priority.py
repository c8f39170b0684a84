"""The `priority` policy section: which class a tenant/app's requests are served in when the upstream is busy.

A request's class is the one it asks for (the `x-tierlane-priority` header), else the section's
`default`, never more urgent than the section's `max`: a tenant whose max is `standard` asking for
`interactive` gets `standard` (and so does its default). A class already set before the pipeline (the Batch API sets
`batch` on every line) is never raised. Flow control (gateway/upstream/flow.py) serves the classes
in order when a member is at its concurrency budget.
"""

from __future__ import annotations

from pydantic import Field

from policies.domain import PRIORITIES, Priority
from policies.errors import InvalidInput
from policies.policy import Policy
from policies.sections import OverrideRule, StrictSection, parse_section

HEADER = "x-tierlane-priority"
_MATCH_KEYS = frozenset({"tenant", "app"})
_RANK: dict[str, int] = {name: rank for rank, name in enumerate(PRIORITIES)}  # lower: more urgent


class PriorityPolicyError(ValueError):
    """The priority section of the policy is malformed; raised at start-up."""


class PrioritySection(StrictSection):
    """The section as written; the shipped defaults are in policies/defaults/priority.yaml."""

    # NOTE: a default more urgent than the max is lowered to it like a header's ask, so an override
    # may set `max` alone
    default: Priority = Field("interactive", description="the class of a request that asks for none")
    max: Priority = Field("interactive", description="the most urgent class the tenant/app gets, whatever it asks for")
    overrides: list[OverrideRule] = Field(default_factory=list)


def less_urgent(a: Priority, b: Priority) -> Priority:
    """The less urgent of two classes."""
    return a if _RANK[a] >= _RANK[b] else b


def asked(value: str | None) -> Priority | None:
    """The class a header value names (case and spaces ignored), None when absent; InvalidInput for any other."""
    name = (value or "").strip().lower()
    if not name:
        return None
    for known in PRIORITIES:
        if name == known:
            return known
    raise InvalidInput(f"header {HEADER} must be one of {', '.join(PRIORITIES)}", param=HEADER, code="invalid_priority")


class PriorityPolicy:
    """The classes each tenant/app may use, parsed and checked once."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.section = parse_section(PrioritySection, policy.section("priority"), "priority", _MATCH_KEYS,
                                     PriorityPolicyError)
        self._rules: dict[tuple[str, str], PrioritySection] = {}

    def rules(self, tenant: str, app: str) -> PrioritySection:
        key = (tenant, app)
        found = self._rules.get(key)
        if found is None:
            merged = self.policy.resolve("priority", tenant=tenant, app=app)
            found = PrioritySection.model_validate({k: v for k, v in merged.items() if k != "overrides"})
            if len(self._rules) < 10_000:  # bounded: tenant/app names come from keys, not requests
                self._rules[key] = found
        return found

    def resolve(self, tenant: str, app: str, header: str | None, current: Priority) -> Priority:
        """The request's class: asked for (else the default), bounded by the max, never more urgent than `current`
        (a class a front door set before the pipeline)."""
        rules = self.rules(tenant, app)
        wanted = asked(header) or rules.default
        return less_urgent(less_urgent(wanted, rules.max), current)
