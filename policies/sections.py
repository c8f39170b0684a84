"""Parsing a policy section into a strict model: dotted paths in errors, overrides checked at load.

Shared by every section that has a pydantic model (cache, trim): a typo, a wrong type or a
bad override fails at start-up naming the key, e.g.
`cache.overrides[0].set.verify.numbres: extra fields not permitted`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from policies.policy import Policy

_M = TypeVar("_M", bound=BaseModel)


class StrictSection(BaseModel):
    """Base of every policy section model."""

    # NOTE: strict, as the hand-written parsers were: "yes" is not a boolean and "5" not a number.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class OverrideRule(StrictSection):
    """One `overrides` rule: `set` is merged over the section where every `match` key agrees."""

    match: dict[str, Any] = Field(default_factory=dict, description="tenant, app, model, ...: a name or a list")
    set: dict[str, Any] = Field(default_factory=dict, description="keys of the section itself")

    @field_validator("match")
    @classmethod
    def _names(cls, value: dict[str, Any]) -> dict[str, Any]:
        return match_names(value)


def match_names(match: dict[str, Any]) -> dict[str, Any]:
    for key, want in match.items():
        names = want if isinstance(want, list) else [want]
        if not all(name is None or isinstance(name, str) for name in names):
            raise ValueError(f"{key} must be a name or a list of names (\"*\": any), got {want!r}")
    return match


def problems(exc: ValidationError, where: str, model: type[BaseModel]) -> str:
    """One clause per error, each naming the dotted path of the key at fault."""
    out = []
    for error in exc.errors():
        path = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        if error["type"] == "extra_forbidden":
            owner: Any = model
            for part in error["loc"][:-1]:  # walk to the model that refused the key
                if isinstance(part, int):
                    owner = next(iter(get_args(owner)), None)  # list[Model] -> Model
                elif isinstance(owner, type) and issubclass(owner, BaseModel) and part in owner.model_fields:
                    owner = owner.model_fields[part].annotation
                else:
                    owner = None
            known = sorted(owner.model_fields) if isinstance(owner, type) and issubclass(owner, BaseModel) else []
            out.append(f"{path}: extra fields not permitted" + (f" (known: {', '.join(known)})" if known else ""))
        else:
            message = error["msg"].removeprefix("Value error, ")
            got = repr(error["input"])
            got = got if len(got) <= 60 else got[:57] + "..."
            out.append(f"{path}: {message} (got {got})" if error["loc"] else f"{path}: {message}")
    return "; ".join(out)


def validate_section(model: type[_M], data: Any, where: str, error: type[ValueError]) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(problems(exc, where, model)) from None


def parse_section(
    model: type[_M], section: Mapping[str, Any], name: str, match_keys: frozenset[str], error: type[ValueError]
) -> _M:
    """The section parsed; each `overrides` rule's `match` checked and its `set` parsed merged over it."""
    if not isinstance(section, Mapping):
        raise error(f"{name}: must be a mapping, got {type(section).__name__}")
    parsed = validate_section(model, dict(section), name, error)
    base = {k: v for k, v in section.items() if k != "overrides"}
    for index, rule in enumerate(section.get("overrides") or []):
        at = f"{name}.overrides[{index}]"
        unknown = sorted(set(rule.get("match") or {}) - match_keys)
        if unknown:
            raise error(f"{at}.match.{unknown[0]}: extra fields not permitted (known: {', '.join(sorted(match_keys))})")
        if "overrides" in (rule.get("set") or {}):
            raise error(f"{at}.set.overrides: an override cannot carry overrides")
        alone = Policy(sections={name: {**base, "overrides": [{"match": {}, "set": rule.get("set") or {}}]}})
        validate_section(model, alone.resolve(name), f"{at}.set", error)
    return parsed
