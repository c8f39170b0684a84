"""The state one request carries through the pipeline, and the answer a lane produces."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gateway.lanes import AUTO, RouteRequest
from policies.domain import EdgeCheck, Outcome, Principal, RouteDecision, Usage
from policies.router.features import Prompt

if TYPE_CHECKING:
    from gateway.pipeline.runner import ModelCall

__all__ = ["Answer", "Api", "Operation", "WireOperation", "Outcome", "Principal", "RequestContext", "RouteDecision", "Usage"]

WireOperation = Literal["chat", "completions", "embeddings"]  # an OpenAI endpoint's operation
# count_tokens: Messages' token count, admitted and metered but answered by no lane
Operation = Literal["chat", "completions", "embeddings", "count_tokens"]
# The wire API a request came in through: the OpenAI endpoints (named by their operation), or a
# front door that translates into the chat operation. Attribution only: no stage reads it.
Api = Literal["chat", "completions", "embeddings", "messages", "responses"]


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
    request: Any = None  # the validated wire model (gateway.protocol); stages read typed values from it
    native_body: dict[str, Any] | None = None  # the client's own body, for an upstream that serves `api` natively
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
