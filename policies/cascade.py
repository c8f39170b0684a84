"""The `cascade` policy section: when an edge answer is kept, and when it is escalated upstream."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from policies.policy import Policy
from policies.sections import OverrideRule, StrictSection, parse_section

_MATCH_KEYS = frozenset({"tenant", "app"})


class CascadePolicyError(ValueError):
    """The cascade section of the policy is malformed; raised at start-up."""


TargetMode = Literal["min_local_accuracy", "max_escalation_share", "min_local_recall", "threshold"]


class CascadeTarget(StrictSection):
    """A target met on the calibration split (or, mode `threshold`, the score threshold itself)."""

    mode: TargetMode = "min_local_accuracy"
    value: float = Field(0.90, ge=0.0, le=1.0)


class CascadeSection(StrictSection):
    """The section as written; the shipped defaults are in policies/defaults/cascade.yaml."""

    enabled: bool = True
    edge_decision: Literal["calibration", "router"] = "calibration"
    calibration: str | None = None
    prior: CascadeTarget = Field(default_factory=lambda: CascadeTarget(mode="min_local_recall", value=0.95))
    target: CascadeTarget = Field(default_factory=CascadeTarget)
    hold_tokens: int = Field(12, ge=0, le=512)
    low_confidence_run: int = Field(8, ge=0, le=4096)
    low_confidence_logprob: float = Field(-4.0, le=0.0)
    overrides: list[OverrideRule] = Field(default_factory=list)


class CascadePolicy:
    """The cascade rules of each tenant/app, parsed and checked once."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.section = parse_section(CascadeSection, policy.section("cascade"), "cascade", _MATCH_KEYS,
                                     CascadePolicyError)
        self._rules: dict[tuple[str, str], CascadeSection] = {}

    def rules(self, tenant: str, app: str) -> CascadeSection:
        key = (tenant, app)
        found = self._rules.get(key)
        if found is None:
            merged = self.policy.resolve("cascade", tenant=tenant, app=app)
            found = CascadeSection.model_validate({k: v for k, v in merged.items() if k != "overrides"})
            if len(self._rules) < 10_000:  # bounded: tenant/app names come from keys, not requests
                self._rules[key] = found
        return found
