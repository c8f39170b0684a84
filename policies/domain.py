"""What a request is to every layer: who asks, where it was routed, what it used and how it ended.

A leaf module (it imports nothing of tierlane): the gateway fills these, and policies and
telemetry read them without depending on the gateway.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# How urgent a request is: interactive (a person waits; the default), standard (a service that
# can wait seconds), batch (bulk work that fills idle capacity; every Batch API line). Flow control
# serves the classes in this order when the upstream is busy.
Priority = Literal["interactive", "standard", "batch"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "standard", "batch")


@dataclass(slots=True, frozen=True)
class Principal:
    """Who is calling: resolved from the API key by the auth middleware."""

    tenant: str
    app: str
    key_id: str = "open"
    admin: bool = False
    admin_scope: Literal["global", "tenant"] = "global"  # what an admin key administers: every tenant, or its own

    @property
    def global_admin(self) -> bool:
        """An admin of every tenant: all usage, any cache purge, /v1/shadow and /metrics."""
        return self.admin and self.admin_scope == "global"

    def administers(self, tenant: str) -> bool:
        """Whether this caller may read or purge `tenant`'s data."""
        return self.admin and (self.admin_scope == "global" or tenant == self.tenant)


@dataclass(slots=True)
class Usage:
    """Token counts of one answer; filled by the lane that answered, read by accounting."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    estimated: bool = False
    # input tokens written to the provider's prompt cache (Anthropic's cache_creation_input_tokens),
    # for 5 minutes and for an hour: priced above plain input (1.25x and 2x by default)
    cache_write_tokens: int = 0
    cache_write_1h_tokens: int = 0

    # The most tokens one request may be metered for: far above any context window, far below
    # what SQLite's INTEGER or a float sum can hold. A larger report is clamped to it.
    MAX_TOKENS = 10_000_000

    @classmethod
    def from_openai(cls, usage: Any) -> Usage | None:
        """The `usage` object of an OpenAI-style answer, validated; None when it cannot be used.

        `usage` may be any JSON value (it comes from an upstream or a stored answer). The rule:
        - not a mapping, empty, or with neither `prompt_tokens` nor `completion_tokens`: None;
        - a count must be a non-negative integer (an int, or a float with an integral value);
          booleans, strings, NaN, infinities, fractions, negatives and containers are rejected,
          and a report with a rejected prompt or completion count is None as a whole, so the
          caller falls back to its local estimate (never a partly made-up report);
        - a missing or null count is 0 (embeddings report no `completion_tokens`);
        - a count above MAX_TOKENS is clamped to it, and cached tokens to the input tokens;
        - a malformed `prompt_tokens_details` or `cached_tokens` counts no cached tokens
          (the input is then priced in full).
        Whenever a stored count is not exactly what was reported, the Usage is `estimated`.
        """
        if not isinstance(usage, Mapping) or not usage:
            return None
        reported = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
        if all(value is None for value in reported):
            return None
        counts = [cls._count(value) for value in reported]
        if any(count is None for count in counts):
            return None
        input_tokens, output_tokens = (count or 0 for count in counts)
        estimated = False
        cached_tokens = 0
        details = usage.get("prompt_tokens_details")
        if isinstance(details, Mapping):
            cached = cls._count(details.get("cached_tokens"))
            if cached is None:
                estimated = True
            else:
                cached_tokens = cached
        elif details is not None:
            estimated = True
        clamped_input, clamped_output = min(input_tokens, cls.MAX_TOKENS), min(output_tokens, cls.MAX_TOKENS)
        clamped_cached = min(cached_tokens, clamped_input)
        if (clamped_input, clamped_output, clamped_cached) != (input_tokens, output_tokens, cached_tokens):
            estimated = True
        return cls(
            input_tokens=clamped_input,
            output_tokens=clamped_output,
            cached_input_tokens=clamped_cached,
            estimated=estimated,
        )

    @staticmethod
    def _count(value: Any) -> int | None:
        """A reported token count as a non-negative int (None/absent is 0); None when unusable."""
        if value is None:
            return 0
        # NOTE: bool is a subclass of int, and `true` is not a token count.
        if isinstance(value, bool):
            return None
        if isinstance(value, float):
            # is_integer() is False for NaN and the infinities too.
            if not value.is_integer():
                return None
            value = int(value)
        if not isinstance(value, int) or value < 0:
            return None
        return value

    def to_openai(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.input_tokens,
            "completion_tokens": self.output_tokens,
            "total_tokens": self.input_tokens + self.output_tokens,
        }


@dataclass(slots=True)
class RouteDecision:
    """Which lane the router chose and why."""

    lane: str
    score: float | None
    reason: str
    threshold: float | None = None


@dataclass(slots=True, frozen=True)
class EdgeCheck:
    """The confidence check of an edge answer to an `auto` request (the cascade).

    `passed`: the confidence reached the threshold (only such answers may be cached);
    `escalated`: the edge answer was dropped and the request went upstream for `reason`
    ("low_confidence", "loop", ...); the edge tokens spent on it are a cost, not a saving.
    """

    confidence: float | None
    threshold: float | None
    passed: bool
    escalated: bool = False
    reason: str = ""
    edge_output_tokens: int = 0
    edge_input_tokens: int = 0


@dataclass(slots=True)
class Outcome:
    """How a request ended; handed to the completion hooks (cache admission, metering)."""

    status: int
    response: dict[str, Any] | None  # the whole answer, assembled from chunks for streams
    complete: bool  # True when the answer ended normally (not cut, not an error)
    error_code: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
