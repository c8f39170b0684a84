"""The policy document: one YAML per concern in `policies/defaults/`, overridable by the operator.

Each concern (cache, router, trim, pricing, budgets, lanes) owns one top-level section and
parses it into its own typed config. Per-tenant/app differences live in the section's
`overrides:` list and are resolved with `Policy.resolve`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _matches(match: Mapping[str, Any], attrs: Mapping[str, str | None]) -> bool:
    for key, want in match.items():
        have = attrs.get(key)
        wanted = want if isinstance(want, list) else [want]
        if have not in wanted and "*" not in wanted:
            return False
    return True


@dataclass(slots=True)
class Policy:
    """All policy sections, merged from the shipped defaults and the operator's file."""

    sections: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path | None = None, extra: Mapping[str, Any] | None = None) -> Policy:
        merged: dict[str, Any] = {}
        defaults = resources.files("policies") / "defaults"
        for entry in sorted(defaults.iterdir(), key=lambda p: p.name):
            if entry.name.endswith(".yaml"):
                merged = _deep_merge(merged, yaml.safe_load(entry.read_text("utf-8")) or {})
        if path is not None:
            with open(path, encoding="utf-8") as fh:
                merged = _deep_merge(merged, yaml.safe_load(fh) or {})
        if extra:
            merged = _deep_merge(merged, extra)
        return cls(sections={k: v or {} for k, v in merged.items()})

    def section(self, name: str) -> dict[str, Any]:
        return self.sections.get(name, {})

    def resolve(self, name: str, **attrs: str | None) -> dict[str, Any]:
        """The section with every matching `overrides` entry merged in, in file order.

        An override looks like `{match: {tenant: acme, app: [a, b]}, set: {...}}`.
        """
        section = self.section(name)
        resolved = {k: v for k, v in section.items() if k != "overrides"}
        for rule in section.get("overrides") or []:
            if _matches(rule.get("match") or {}, attrs):
                resolved = _deep_merge(resolved, rule.get("set") or {})
        return resolved
