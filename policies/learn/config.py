"""The `learn` policy section: which tasks of which tenant/app are learned, and how much is kept.

Opt-in: the shipped section names no template, so nothing is collected anywhere until an operator
names one (usually in an `overrides` rule matching one tenant/app). `templates` is a mapping by
name, so an override adds templates to those of the section, or switches one off with
`enabled: false`, instead of replacing the list.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import orjson
from pydantic import Field, field_validator, model_validator

from policies.learn.templates import AppTemplates, Template
from policies.policy import Policy
from policies.sections import OverrideRule, StrictSection, parse_section

_MATCH_KEYS = frozenset({"tenant", "app"})
# A name travels in a header, a metric label, a file and a command line: short and plain.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CACHED_APPS = 10_000  # resolved tenant/apps kept; the names come from API keys, not from requests


class LearnPolicyError(ValueError):
    """The learn section of the policy is malformed; raised at start-up."""


class TemplateSpec(StrictSection):
    """One template as written: how a request is recognised as this task, and its own bounds.

    A template with neither a prefix nor `all_requests` is matched only by the header
    `x-tierlane-template: NAME`; every enabled template is matched by that header too.
    """

    enabled: bool = True
    prefix: str | None = Field(None, min_length=1, description="the system prompt or first user message starts with it")
    prefix_sha256: str | None = Field(None, description="sha256 (hex) of the UTF-8 of the fixed prefix, for a prefix "
                                      "the policy file should not hold; with prefix_chars")  # fmt: skip
    prefix_chars: int | None = Field(None, ge=1, le=1_000_000, description="the hashed prefix's length in characters")
    all_requests: bool = Field(False, description="every request of the tenant/app is this task (an app with one task)")
    max_pairs: int | None = Field(None, ge=1, le=1_000_000, description="pairs kept of this template (null: the section's)")
    retention_days: float | None = Field(None, gt=0, le=3650, description="days a pair is kept (null: the section's)")

    @model_validator(mode="after")
    def _one_prefix(self) -> TemplateSpec:
        if self.prefix is not None and self.prefix_sha256 is not None:
            raise ValueError("name the fixed prefix once: prefix or prefix_sha256, not both")
        if (self.prefix_sha256 is None) != (self.prefix_chars is None):
            raise ValueError("prefix_sha256 and prefix_chars go together (the digest of that many leading characters)")
        if self.prefix_sha256 is not None and not _HEX64.match(self.prefix_sha256):
            raise ValueError("prefix_sha256 must be 64 lowercase hex digits")
        return self


class LearnSection(StrictSection):
    """The section as written; the shipped defaults are in policies/defaults/learn.yaml (a test keeps them equal)."""

    enabled: bool = True
    max_pairs: int = Field(5000, ge=1, le=1_000_000)
    retention_days: float = Field(30.0, gt=0, le=3650)
    tenant_quota_bytes: int | None = Field(268_435_456, ge=0)
    max_pair_bytes: int = Field(262_144, ge=1024, le=16_777_216)
    min_pairs: int = Field(200, ge=2, le=1_000_000, description="fewest pairs `tierlane edge learn` trains an adapter from")
    max_disagreement: float = Field(0.02, gt=0, lt=1, description="the bound on a served template's disagreement with "
                                    "the upstream: its upper confidence bound must stay under this for the edge to answer")
    threshold_disagreement: float = Field(0.01, gt=0, lt=1, description="the held-out disagreement an adapter's confidence "
                                          "threshold is set at (below max_disagreement, so the online bound can pass)")
    confidence: float = Field(0.95, ge=0.5, lt=1, description="the one-sided confidence of the disagreement's upper bound")
    shadow_rate: float = Field(1.0, ge=0, le=1, description="share of a shadow template's upstream answers the edge also "
                               "answers (batch priority, off the request's path) to measure agreement")
    recheck_rate: float = Field(0.1, ge=0, le=1, description="share of a serving template's local answers re-asked "
                                "upstream to hold the bound online (each an upstream call, metered as judging)")
    min_observations: int = Field(50, ge=1, le=1_000_000, description="fewest judged answers before a template serves")
    window: int = Field(500, ge=10, le=100_000, description="the latest judged answers the bound is measured over")
    templates: dict[str, TemplateSpec] = Field(default_factory=dict)
    overrides: list[OverrideRule] = Field(default_factory=list)

    @field_validator("templates")
    @classmethod
    def _names(cls, value: dict[str, TemplateSpec]) -> dict[str, TemplateSpec]:
        for name in value:
            if not NAME.match(name):
                raise ValueError(f"template name {name!r}: letters, digits, '.', '_' and '-', at most 64, "
                                 "starting with a letter or digit")  # fmt: skip
        return value


def prefix_digest(prefix: str) -> tuple[str, int]:
    """(prefix_sha256, prefix_chars) of a fixed prefix, as a template names it without holding the text."""
    return hashlib.sha256(prefix.encode("utf-8")).hexdigest(), len(prefix)


def _template(name: str, spec: TemplateSpec, section: LearnSection) -> Template:
    definition = orjson.dumps([spec.prefix, spec.prefix_sha256, spec.prefix_chars, spec.all_requests])
    return Template(
        name=name,
        prefix=spec.prefix,
        prefix_sha256=spec.prefix_sha256,
        prefix_chars=spec.prefix_chars,
        all_requests=spec.all_requests,
        max_pairs=spec.max_pairs or section.max_pairs,
        retention_s=(spec.retention_days or section.retention_days) * 86400.0,
        version=hashlib.sha256(definition).hexdigest()[:16],
    )


@dataclass(frozen=True, slots=True)
class AppLearning:
    """What one tenant/app learns: its enabled templates (matcher) and the bounds of its pairs."""

    templates: AppTemplates
    max_pair_bytes: int
    tenant_quota_bytes: int | None


class LearnPolicy:
    """The learn rules of each tenant/app, parsed and checked once, resolved once per tenant/app."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.section = parse_section(LearnSection, policy.section("learn"), "learn", _MATCH_KEYS, LearnPolicyError)
        self._apps: dict[tuple[str, str], AppLearning] = {}
        self._quotas: dict[str, int | None] = {}

    @property
    def any_template(self) -> bool:
        """Whether any tenant/app could have a template (else the gateway need not collect at all)."""
        if not self.section.enabled:
            return False
        if any(spec.enabled for spec in self.section.templates.values()):
            return True
        return any((rule.set.get("templates") or {}) for rule in self.section.overrides)

    def for_app(self, tenant: str, app: str) -> AppLearning:
        """The templates enabled for tenant/app (none unless the policy names one for it)."""
        key = (tenant, app)
        found = self._apps.get(key)
        if found is None:
            found = self._resolve(tenant, app)
            if len(self._apps) < _CACHED_APPS:
                self._apps[key] = found
        return found

    def seen(self) -> list[tuple[str, str]]:
        """The tenant/apps resolved since start (with or without templates)."""
        return list(self._apps)

    def named(self) -> list[tuple[str, str]]:
        """The tenant/apps an override names by exact names (no `*`) and gives templates."""
        out: list[tuple[str, str]] = []
        for rule in self.section.overrides:
            tenants, apps = rule.match.get("tenant"), rule.match.get("app")
            if not (rule.set.get("templates") or {}) or tenants is None or apps is None:
                continue
            for tenant in tenants if isinstance(tenants, list) else [tenants]:
                for app in apps if isinstance(apps, list) else [apps]:
                    if isinstance(tenant, str) and isinstance(app, str) and "*" not in (tenant, app):
                        out.append((tenant, app))
        return out

    def tenant_quota(self, tenant: str) -> int | None:
        """The bytes of pairs the tenant keeps at most (None: no bound): the section's, or an override matching
        the tenant alone (a rule that also names an app does not change a quota shared by the tenant's apps)."""
        if tenant in self._quotas:
            return self._quotas[tenant]
        merged = self.policy.resolve("learn", tenant=tenant, app=None)
        value = merged.get("tenant_quota_bytes", self.section.tenant_quota_bytes)
        found = None if value is None else int(value)
        if len(self._quotas) < _CACHED_APPS:
            self._quotas[tenant] = found
        return found

    def section_for(self, tenant: str, app: str) -> LearnSection:
        """The section as it applies to tenant/app (its overrides merged), e.g. for the trainer's min_pairs."""
        merged = self.policy.resolve("learn", tenant=tenant, app=app)
        return LearnSection.model_validate({k: v for k, v in merged.items() if k != "overrides"})

    def _resolve(self, tenant: str, app: str) -> AppLearning:
        section = self.section_for(tenant, app)
        templates = [] if not section.enabled else [
            _template(name, spec, section) for name, spec in sorted(section.templates.items()) if spec.enabled
        ]
        return AppLearning(AppTemplates(templates), section.max_pair_bytes, self.tenant_quota(tenant))
