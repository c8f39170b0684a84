"""The trim policy section parsed into typed, validated settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

LOSSLESS_PASSES: tuple[str, ...] = ("whitespace", "boilerplate", "duplicates")
BUDGETED_PASSES: tuple[str, ...] = ("tool_output", "history")
PASSES: tuple[str, ...] = LOSSLESS_PASSES + BUDGETED_PASSES


class TrimPolicyError(ValueError):
    """The trim section of the policy is malformed; raised at start-up, not per request."""


def _take(d: Mapping[str, Any], where: str, allowed: set[str]) -> dict[str, Any]:
    if d is None:
        return {}
    if not isinstance(d, Mapping):
        raise TrimPolicyError(f"trim policy: `{where}` must be a mapping, got {type(d).__name__}")
    unknown = set(d) - allowed
    if unknown:
        raise TrimPolicyError(
            f"trim policy: unknown key(s) {sorted(unknown)} in `{where}`; allowed: {sorted(allowed)}"
        )
    return dict(d)


def _bool(d: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise TrimPolicyError(f"trim policy: `{where}.{key}` must be true or false, got {value!r}")
    return value


def _int(d: Mapping[str, Any], key: str, default: int | None, where: str, minimum: int = 0) -> int | None:
    value = d.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TrimPolicyError(
            f"trim policy: `{where}.{key}` must be an integer >= {minimum}, got {value!r}"
        )
    return value


def _str_list(d: Mapping[str, Any], key: str, where: str) -> frozenset[str]:
    value = d.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TrimPolicyError(f"trim policy: `{where}.{key}` must be a list of strings, got {value!r}")
    return frozenset(value)


@dataclass(slots=True, frozen=True)
class ToolOutputPolicy:
    """Long tool/function results are cut to a head and a tail around a marker."""

    enabled: bool = True
    max_tokens: int = 2048
    head_tokens: int = 1024
    tail_tokens: int = 768


@dataclass(slots=True, frozen=True)
class HistoryPolicy:
    """A token budget for the whole prompt, met by dropping the oldest middle turns."""

    enabled: bool = True
    max_tokens: int | None = None
    marker: bool = False


@dataclass(slots=True, frozen=True)
class TrimPolicy:
    """Which passes run and with what limits, for one resolved tenant/app/model."""

    enabled: bool = True
    whitespace: bool = True
    duplicates: bool = True
    boilerplate: bool = True
    boilerplate_min_repeats: int = 3
    boilerplate_min_paragraph_chars: int = 200
    tool_output: ToolOutputPolicy = field(default_factory=ToolOutputPolicy)
    history: HistoryPolicy = field(default_factory=HistoryPolicy)
    pin_roles: frozenset[str] = frozenset()
    pin_names: frozenset[str] = frozenset()
    message_overhead_tokens: int = 4
    image_part_tokens: int = 85

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> TrimPolicy:
        top = _take(
            d or {},
            "trim",
            {"enabled", "whitespace", "duplicates", "boilerplate", "tool_output", "history",
             "pin", "message_overhead_tokens", "image_part_tokens", "overrides"},
        )
        ws = _take(top.get("whitespace"), "trim.whitespace", {"enabled"})
        dup = _take(top.get("duplicates"), "trim.duplicates", {"enabled"})
        bp = _take(top.get("boilerplate"), "trim.boilerplate",
                   {"enabled", "min_repeats", "min_paragraph_chars"})
        to = _take(top.get("tool_output"), "trim.tool_output",
                   {"enabled", "max_tokens", "head_tokens", "tail_tokens"})
        hi = _take(top.get("history"), "trim.history", {"enabled", "max_tokens", "marker"})
        pin = _take(top.get("pin"), "trim.pin", {"roles", "names"})

        tool = ToolOutputPolicy(
            enabled=_bool(to, "enabled", True, "trim.tool_output"),
            max_tokens=_int(to, "max_tokens", 2048, "trim.tool_output", 64) or 0,
            head_tokens=_int(to, "head_tokens", 1024, "trim.tool_output", 0) or 0,
            tail_tokens=_int(to, "tail_tokens", 768, "trim.tool_output", 0) or 0,
        )
        # The marker needs room, or a second trim would cut the already-cut output again.
        if tool.head_tokens + tool.tail_tokens + 32 > tool.max_tokens:
            raise TrimPolicyError(
                "trim policy: `trim.tool_output.head_tokens + tail_tokens` must leave at least "
                f"32 tokens under max_tokens ({tool.head_tokens} + {tool.tail_tokens} vs {tool.max_tokens})"
            )
        history = HistoryPolicy(
            enabled=_bool(hi, "enabled", True, "trim.history"),
            max_tokens=_int(hi, "max_tokens", None, "trim.history", 1),
            marker=_bool(hi, "marker", False, "trim.history"),
        )
        return cls(
            enabled=_bool(top, "enabled", True, "trim"),
            whitespace=_bool(ws, "enabled", True, "trim.whitespace"),
            duplicates=_bool(dup, "enabled", True, "trim.duplicates"),
            boilerplate=_bool(bp, "enabled", True, "trim.boilerplate"),
            boilerplate_min_repeats=_int(bp, "min_repeats", 3, "trim.boilerplate", 2) or 3,
            boilerplate_min_paragraph_chars=_int(bp, "min_paragraph_chars", 200, "trim.boilerplate", 1) or 200,
            tool_output=tool,
            history=history,
            pin_roles=_str_list(pin, "roles", "trim.pin"),
            pin_names=_str_list(pin, "names", "trim.pin"),
            message_overhead_tokens=_int(top, "message_overhead_tokens", 4, "trim") or 0,
            image_part_tokens=_int(top, "image_part_tokens", 85, "trim") or 0,
        )

    @property
    def history_budget(self) -> int | None:
        return self.history.max_tokens if self.history.enabled else None
