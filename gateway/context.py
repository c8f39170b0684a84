"""The state one request carries through the pipeline, and the answer a lane produces."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Operation = Literal["chat", "completions", "embeddings"]


@dataclass(slots=True, frozen=True)
class Principal:
    """Who is calling: resolved from the API key by the auth middleware."""

    tenant: str
    app: str
    key_id: str = "open"
    admin: bool = False


@dataclass(slots=True)
class Usage:
    """Token counts of one answer; filled by the lane that answered, read by accounting."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    estimated: bool = False

    @classmethod
    def from_openai(cls, usage: Mapping[str, Any] | None) -> Usage | None:
        if not usage:
            return None
        details = usage.get("prompt_tokens_details") or {}
        return cls(
            input_tokens=int(usage.get("prompt_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens") or 0),
            cached_input_tokens=int(details.get("cached_tokens") or 0),
        )

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


@dataclass(slots=True)
class Answer:
    """What a lane (cache, edge, upstream) produced: a whole JSON body or a stream of chunks.

    `chunks` yields OpenAI chunk objects (`chat.completion.chunk` / `text_completion`);
    the HTTP layer frames them as SSE. `headers` are extra response headers.
    """

    lane: str
    body: dict[str, Any] | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Outcome:
    """How a request ended; handed to the completion hooks (cache admission, metering)."""

    status: int
    response: dict[str, Any] | None  # the whole answer, assembled from chunks for streams
    complete: bool  # True when the answer ended normally (not cut, not an error)
    error_code: str | None = None
    finish_reasons: list[str] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class RequestContext:
    """One request on its way through the pipeline; stages read and write it."""

    request_id: str
    operation: Operation
    body: dict[str, Any]  # the request as it will be sent onward; stages may rewrite it
    headers: Mapping[str, str]
    principal: Principal
    model: str  # the model name the client asked for
    stream: bool = False
    received_at: float = field(default_factory=time.perf_counter)
    lane: str = "upstream"  # cache | edge | upstream
    target_model: str | None = None  # the model the lane is asked for
    pool: str | None = None  # upstream pool name when lane == upstream
    embedding: Any = None  # numpy vector of the last user turn, shared by cache and router
    route: RouteDecision | None = None
    cache_status: str = "off"  # hit | miss | bypass | off
    cache_similarity: float | None = None
    cache_key: Any = None  # set by the cache lookup for the store stage
    trim_saved: dict[str, int] = field(default_factory=dict)  # tokens removed, by pass
    usage: Usage | None = None
    first_token_at: float | None = None
    lane_seconds: float = 0.0  # time spent waiting on the lane (not gateway overhead)
    attributes: dict[str, Any] = field(default_factory=dict)  # extra span attributes
    model_span: Any = None  # the open CLIENT span of the lane call; closed when the answer ends
    model_span: Any = None  # the open CLIENT span of the lane call; closed when the answer ends

    def header(self, name: str) -> str | None:
        return self.headers.get(name)

    def overhead_ms(self, now: float | None = None) -> float:
        end = time.perf_counter() if now is None else now
        return max(0.0, (end - self.received_at - self.lane_seconds) * 1000.0)
