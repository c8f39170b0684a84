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


class LearnSection(StrictSection):
    """What the gate learns from the cascade's verdicts while running (policies/edge_feedback.py)."""

    enabled: bool = True
    memory: int = Field(512, ge=1, le=65536)  # recent tried prompts remembered per tenant/app
    neighbours: int = Field(5, ge=0, le=64)  # nearest remembered prompts that vote (0: no vote)
    min_neighbours: int = Field(3, ge=1, le=64)  # close neighbours needed before the vote counts
    similarity: float = Field(0.85, ge=0.0, le=1.0)  # cosine at or above which a neighbour is close
    escalated_share: float = Field(0.6, ge=0.0, le=1.0)  # share of escalated neighbours that keeps a prompt off the edge
    window: int = Field(50, ge=1, le=100000)  # requests reaching the gate whose net saving the margin follows
    step: float = Field(0.05, ge=0.0, le=1.0)  # margin added to the prior threshold per verdict while it is negative
    explore_every: int = Field(20, ge=0, le=100000)  # 1 in N held off by the margin still tries, while not negative (0: none)


class CascadeSection(StrictSection):
    """The section as written; the shipped defaults are in policies/defaults/cascade.yaml."""

    enabled: bool = True
    edge_decision: Literal["calibration", "router"] = "calibration"
    calibration: str | None = None
    prior: CascadeTarget = Field(default_factory=lambda: CascadeTarget(mode="min_local_recall", value=0.95))
    target: CascadeTarget = Field(default_factory=CascadeTarget)
    hold_tokens: int = Field(12, ge=0, le=512)
    # an edge attempt not judged by this time is escalated (reason `deadline`): deadline_min_s +
    # deadline_slack x what its prompt and the tokens before the check take on the engine alone
    deadline_slack: float = Field(4.0, ge=0.0, le=1000.0)  # 0: no deadline
    deadline_min_s: float = Field(5.0, ge=0.0, le=3600.0)
    low_confidence_run: int = Field(8, ge=0, le=4096)
    low_confidence_logprob: float = Field(-4.0, le=0.0)
    learn: LearnSection = Field(default_factory=LearnSection)
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
