"""The trim policy section parsed into typed, validated settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator, model_validator

from policies.sections import OverrideRule, StrictSection, parse_section
from policies.trim.agent_context import AgentContextPolicy

LOSSLESS_PASSES: tuple[str, ...] = ("whitespace", "boilerplate", "duplicates")
BUDGETED_PASSES: tuple[str, ...] = ("tool_output", "history")
MASKING = "agent_context"  # observation masking (policies/trim/agent_context.py): runs last, priced apart
PASSES: tuple[str, ...] = LOSSLESS_PASSES + BUDGETED_PASSES
_MATCH_KEYS = frozenset({"tenant", "app", "model"})  # what the trim stage resolves with



class TrimPolicyError(ValueError):
    """The trim section of the policy is malformed; raised at start-up, not per request."""


class _Switch(StrictSection):
    enabled: bool = True


class _Boilerplate(StrictSection):
    enabled: bool = True
    min_repeats: int = Field(3, ge=2, description="identical consecutive lines collapsed to one and a count")
    min_paragraph_chars: int = Field(200, ge=1, description="a paragraph repeated within one message becomes a marker")


class _Pin(StrictSection):
    roles: list[str] = Field(default_factory=list, description="messages of these roles are never changed or dropped")
    names: list[str] = Field(default_factory=list, description="nor messages whose `name` is listed")

    @field_validator("roles", "names", mode="before")
    @classmethod
    def _empty(cls, value: Any) -> Any:
        return [] if value is None else value


class ToolOutputPolicy(StrictSection):
    """Long tool/function results are cut to a head and a tail around a marker.

    NOTE: off by default. A cut result is a file or a command output the model no longer sees
    whole (an agent's next edit is built on it), and each cut rewrites the provider's cached
    prefix. Opt in per tenant/app; the results the model has not answered yet are never cut.
    """

    enabled: bool = False
    max_tokens: int = Field(2048, ge=64, description="longer tool/function results keep head and tail")
    head_tokens: int = Field(1024, ge=0)
    tail_tokens: int = Field(768, ge=0)

    @model_validator(mode="after")
    def _room_for_the_marker(self) -> ToolOutputPolicy:
        # The marker needs room, or a second trim would cut the already-cut output again.
        if self.head_tokens + self.tail_tokens + 32 > self.max_tokens:
            raise ValueError(
                "head_tokens + tail_tokens must leave at least 32 tokens under max_tokens "
                f"({self.head_tokens} + {self.tail_tokens} vs {self.max_tokens})"
            )
        return self


class HistoryPolicy(StrictSection):
    """A token budget for the whole prompt, met by dropping the oldest middle turns."""

    enabled: bool = True
    max_tokens: int | None = Field(None, ge=1, description="prompt budget; null keeps every turn")
    marker: bool = Field(False, description="insert a system note where turns were dropped")


class TrimSection(StrictSection):
    """The `trim` policy section as written. Its defaults are the shipped policy's.

    NOTE: the one source of these defaults; policies/defaults/trim.yaml lists the same values
    for operators to read, and a test keeps the two equal.
    """

    enabled: bool = True
    message_overhead_tokens: int = Field(4, ge=0, description="chat-format framing per message, plus the role")
    image_part_tokens: int = Field(85, ge=0, description="counted, never changed")
    pin: _Pin = Field(default_factory=_Pin)
    whitespace: _Switch = Field(default_factory=_Switch)
    boilerplate: _Boilerplate = Field(default_factory=_Boilerplate)
    duplicates: _Switch = Field(default_factory=_Switch)
    tool_output: ToolOutputPolicy = Field(default_factory=ToolOutputPolicy)
    history: HistoryPolicy = Field(default_factory=HistoryPolicy)
    agent_context: AgentContextPolicy = Field(default_factory=AgentContextPolicy)
    overrides: list[OverrideRule] = Field(default_factory=list)

    @field_validator("pin", "whitespace", "boilerplate", "duplicates", "tool_output", "history", "agent_context",
                     mode="before")
    @classmethod
    def _empty(cls, value: Any) -> Any:
        # NOTE: a sub-section left with only comments in YAML reads as null: its defaults then.
        return {} if value is None else value


@dataclass(slots=True, frozen=True)
class TrimPolicy:
    """Which passes run and with what limits, for one resolved tenant/app/model (built from `TrimSection`)."""

    enabled: bool
    whitespace: bool
    duplicates: bool
    boilerplate: bool
    boilerplate_min_repeats: int
    boilerplate_min_paragraph_chars: int
    tool_output: ToolOutputPolicy
    history: HistoryPolicy
    pin_roles: frozenset[str]
    pin_names: frozenset[str]
    message_overhead_tokens: int
    image_part_tokens: int
    agent_context: AgentContextPolicy = AgentContextPolicy()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> TrimPolicy:
        """The policy of a resolved `trim` section (missing keys: the defaults).

        Given the raw policy section, with its `overrides`, each override is validated too and
        the base policy is returned. Raises TrimPolicyError naming the dotted path of a bad key.
        """
        section = parse_section(TrimSection, d or {}, "trim", _MATCH_KEYS, TrimPolicyError)
        return cls(
            enabled=section.enabled,
            whitespace=section.whitespace.enabled,
            duplicates=section.duplicates.enabled,
            boilerplate=section.boilerplate.enabled,
            boilerplate_min_repeats=section.boilerplate.min_repeats,
            boilerplate_min_paragraph_chars=section.boilerplate.min_paragraph_chars,
            tool_output=section.tool_output,
            history=section.history,
            pin_roles=frozenset(section.pin.roles),
            pin_names=frozenset(section.pin.names),
            message_overhead_tokens=section.message_overhead_tokens,
            image_part_tokens=section.image_part_tokens,
            agent_context=section.agent_context,
        )

    @property
    def history_budget(self) -> int | None:
        return self.history.max_tokens if self.history.enabled else None
