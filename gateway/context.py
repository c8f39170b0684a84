"""The state one request carries through the pipeline, and the answer a lane produces.

The types the stages, the lanes and the runner share live here, so that none of them needs
another to name them: this module imports no stage, lane or front door.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from gateway.lanes import AUTO, RouteRequest
from policies.domain import EdgeCheck, Outcome, Principal, Priority, RouteDecision, Usage
from policies.router.features import Prompt

__all__ = ["Answer", "Api", "ModelCall", "NativeApi", "NativeStream", "Operation", "WireOperation", "Outcome", "Principal",
           "RequestContext", "RouteDecision", "TRIM_HEADER", "Usage"]

WireOperation = Literal["chat", "completions", "embeddings"]  # an OpenAI endpoint's operation
# count_tokens: Messages' token count, admitted and metered but answered by no lane
Operation = Literal["chat", "completions", "embeddings", "count_tokens"]
# The wire API a request came in through: the OpenAI endpoints (named by their operation), or a
# front door that translates into the chat operation. Attribution only: no stage reads it.
Api = Literal["chat", "completions", "embeddings", "messages", "responses"]

# The trim's report to the client (`ctx.trim_saved`), and the client's `off`: set by the trim
# stage, and by the upstream lane where the client's own body went instead of the trimmed one.
TRIM_HEADER = "x-tierlane-trim"


@dataclass(slots=True)
class Answer:
    """What a lane (cache, edge, upstream) produced: a whole JSON body or a stream of chunks.

    `chunks` yields OpenAI chunk objects (`chat.completion.chunk` / `text_completion`);
    the HTTP layer frames them as SSE. `headers` are extra response headers.
    """

    lane: str
    body: dict[str, Any] | None = None
    chunks: AsyncGenerator[dict[str, Any], None] | None = None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    # An upstream that served the client's API natively: its whole answer as the client gets it
    # (`body` then holds the same answer in the chat shape, for the completion hooks).
    native: dict[str, Any] | None = None


class NativeStream(Protocol):
    """Reads one stream of an upstream that serves a front door's API itself."""

    usage: Usage | None  # the usage the events so far report

    def chunk(self, event: dict[str, Any]) -> dict[str, Any]:
        """The event as a chat chunk that carries the event itself under `native`."""
        ...

    def ends(self, event: dict[str, Any]) -> bool:
        """Whether the event is the stream's last."""
        ...


@dataclass(frozen=True, slots=True)
class NativeApi:
    """What a front door provides for an upstream that serves its API itself (`RequestContext.native_api`).

    The client gets that upstream's own answer; the upstream lane reads it into the chat shape
    the completion hooks read (cache admission, metering) with these.
    """

    usage: Callable[[Any], Usage | None]  # the API's usage object as tierlane's (any JSON value)
    chat: Callable[[dict[str, Any]], dict[str, Any]]  # a whole answer as the chat completion it stands for
    stream: Callable[[], NativeStream]  # a reader for one stream


class ModelCall:
    """The telemetry span of one lane call, open from `start` until the answer has ended.

    A stream's usage and duration are only known when it ends, after `Pipeline.answer` has
    returned, so the span cannot be a `with` block there; `finish` (or `fail`) ends it once.
    """

    __slots__ = ("_handle", "_span")

    def __init__(self, telemetry: Any, ctx: RequestContext) -> None:
        self._span: Any = telemetry.model_span(ctx)
        self._handle: contextlib.ExitStack | None = None

    def start(self) -> None:
        handle = contextlib.ExitStack()
        self._span = handle.enter_context(self._span)
        self._handle = handle

    def finish(self, outcome: Outcome) -> None:
        """End the span with the answer the client got (assembled for streams)."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        self._span.set_response(outcome.response)
        handle.close()

    def fail(self, exc: BaseException) -> None:
        """End the span of a lane call that raised before it had an answer."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.__exit__(type(exc), exc, exc.__traceback__)


@dataclass(slots=True, kw_only=True)
class RequestContext:
    """One request on its way through the pipeline; stages read and write it."""

    request_id: str
    operation: Operation
    body: dict[str, Any]  # the request as it will be sent onward; stages may rewrite it
    headers: Mapping[str, str]
    principal: Principal
    model: str  # the model name the client asked for (after the settings' model_aliases)
    client_model: str | None = None  # the model name exactly as the client sent it: what its answers carry
    # One conversation's key (an agent session: prompt_cache_key, Codex's session id, a
    # previous_response_id chain, Anthropic's metadata.user_id session); attribution and affinity
    # only, never a cache key, and always within the request's tenant.
    session: str | None = None
    stream: bool = False
    api: Api = "chat"  # the wire API it came in through (attribution: spans and the ledger)
    priority: Priority = "interactive"  # its class: flow control's order when the upstream is busy
    received_at: float = field(default_factory=time.perf_counter)
    lane: str = "upstream"  # cache | edge | upstream
    target_model: str | None = None  # the model the lane is asked for
    pool: str | None = None  # upstream pool name when lane == upstream
    tier: str | None = None  # upstream tier ("cost" | "strong") the router picked, when the policy has tiers
    embedding: Any = None  # numpy vector of the last user turn, shared by cache and router
    route: RouteDecision | None = None
    requested_route: RouteRequest | None = None  # x-tierlane-route, validated once by the resolve stage
    cache_status: str = "off"  # hit | miss | bypass | off
    cache_similarity: float | None = None
    cache_key: Any = None  # set by the cache lookup for the store stage
    # cache.max_error_rate: on a miss, the best stored answer refused by the error bound alone (a
    # CacheHit); the shadow stage judges it against the upstream's answer
    cache_candidate: Any = None
    trim_saved: dict[str, int] = field(default_factory=dict)  # tokens removed, by pass
    usage: Usage | None = None
    first_token_at: float | None = None
    lane_seconds: float = 0.0  # time spent waiting on the lane (not gateway overhead)
    edge_seconds: float = 0.0  # of lane_seconds: the edge's time on an answer the cascade escalated
    strong_target: tuple[str | None, str | None] | None = None  # (pool, model) of the strong tier: a counterfactual
    attributes: dict[str, Any] = field(default_factory=dict)  # extra span attributes, nothing else
    response_headers: dict[str, str] = field(default_factory=dict)  # headers stages add to the answer
    model_span: ModelCall | None = None  # the lane call's span; finished when the answer ends
    edge_check: EdgeCheck | None = None  # the cascade's check of an edge answer (auto requests)
    edge_prior: float | None = None  # the calibration's prior that the edge answers this right
    fallback: tuple[str | None, str | None] | None = None  # (pool, model) an escalated edge answer goes to
    fallback_tier: str | None = None  # the upstream tier of `fallback`, when the policy has tiers
    # lanes.upstream.tiers.max_quality_loss: the region the tier was picked in (gateway.route_quality.QualityProbe)
    quality_probe: Any = None
    learned: Any = None  # a learned template's request with an artifact (gateway.pipeline.learned.LearnedRequest)
    request: Any = None  # the validated wire model (gateway.protocol); stages read typed values from it
    native_body: dict[str, Any] | None = None  # the client's own body, for an upstream that serves `api` natively
    native_api: NativeApi | None = None  # set with native_body by the front door: how its API's answers read as chat
    # NOTE: generated here, never taken from the client: budgets key what a request holds by it,
    # and a client reusing its x-request-id must not overwrite another request's charges.
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    completed: bool = False  # set once the completion hooks were scheduled (exactly once per request)

    @property
    def auto(self) -> bool:
        """Whether the router picks the lane: the model `auto`, or the route header `auto`."""
        return self.model == AUTO or self.requested_route == AUTO

    def header(self, name: str) -> str | None:
        return self.headers.get(name)

    def overhead_ms(self, now: float | None = None) -> float:
        end = time.perf_counter() if now is None else now
        return max(0.0, (end - self.received_at - self.lane_seconds) * 1000.0)


def request_prompt(ctx: RequestContext) -> Prompt:
    """The chat messages, or the completion prompt as one string."""
    messages = ctx.body.get("messages")
    if isinstance(messages, list):
        return [m for m in messages if isinstance(m, dict)]
    prompt = ctx.body.get("prompt")
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return prompt if isinstance(prompt, str) else ""
