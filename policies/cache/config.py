"""The cache policy section, parsed into a typed config (one per tenant/app/model/route)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.cache.scope import ScopeRules
from policies.cache.verify import VerifyConfig


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """The resolved `cache` policy for one request."""

    enabled: bool
    operations: frozenset[str]
    exact: bool
    semantic: bool
    threshold: float
    candidates: int
    ttl_s: float
    max_entries: int
    max_text_chars: int
    rules: ScopeRules
    verify: VerifyConfig

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> CacheConfig:
        threshold = float(section.get("threshold", 0.86))
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"cache.threshold must be a cosine similarity in [-1, 1], got {threshold}")
        candidates = int(section.get("candidates", 4))
        if candidates < 1:
            raise ValueError("cache.candidates must be at least 1")
        max_entries = int(section.get("max_entries", 100_000))
        if max_entries < 1:
            raise ValueError("cache.max_entries must be at least 1")
        return cls(
            enabled=bool(section.get("enabled", True)),
            operations=frozenset(section.get("operations") or ("chat",)),
            exact=bool(section.get("exact", True)),
            semantic=bool(section.get("semantic", True)),
            threshold=threshold,
            candidates=candidates,
            ttl_s=float(section.get("ttl_s", 86_400)),
            max_entries=max_entries,
            max_text_chars=int(section.get("max_text_chars", 4000)),
            rules=ScopeRules(
                max_temperature=float(section.get("max_temperature", 0.7)),
                neutral_params=frozenset(str(p) for p in section.get("neutral_params") or ()),
                share_across_tenants=bool(section.get("share_across_tenants", False)),
            ),
            verify=VerifyConfig.from_policy(section.get("verify") or {}),
        )
