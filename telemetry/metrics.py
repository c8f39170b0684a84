"""OpenTelemetry metric instruments (GenAI semconv and tierlane's cost counters), created once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from telemetry import attributes as a
from telemetry.loop_monitor import LAG_BUCKETS, LoopMonitor

# Bucket boundaries recommended by the GenAI semantic conventions.
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
CONFIDENCE_BUCKETS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


@dataclass(slots=True, kw_only=True)
class Measurement:
    """One finished request, with every label value already bounded."""

    operation: str
    provider: str
    request_model: str
    response_model: str
    tenant: str
    app: str
    lane: str
    cache_status: str
    status_class: str
    error_type: str | None
    model_called: bool  # False for cache hits and requests refused before a lane ran
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    model_seconds: float
    latency_s: float
    ttft_s: float | None
    cost: float
    saved: dict[str, float] = field(default_factory=dict)
    cache_write_tokens: int = 0  # input tokens written to a provider's prompt cache (5-minute and 1-hour)
    # the cascade's check of an edge answer: served | escalated | not_cacheable (pinned, below threshold)
    edge_result: str | None = None
    edge_reason: str = ""  # why it was escalated: low_confidence | loop
    edge_confidence: float | None = None
    edge_wasted_tokens: int = 0  # edge tokens of escalated answers: spent, not served
    tier: str = "none"  # upstream tier (cost | strong | none | other)


class OtelMetrics:
    """The OTel instruments; `record` is called once per request by the meter hook."""

    def __init__(self, meter: Meter) -> None:
        self._meter = meter
        self._tokens = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Tokens used per model call, by token type",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        self._duration = meter.create_histogram(
            "gen_ai.client.operation.duration",
            unit="s",
            description="Duration of the model call (edge or upstream)",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self._ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time from receiving a request to its first answer token",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self._latency = meter.create_histogram(
            "tierlane.request.duration",
            unit="s",
            description="Whole request latency as the client saw it, every lane",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self._requests = meter.create_counter("tierlane.requests", unit="{request}", description="Finished requests")
        self._cost = meter.create_counter("tierlane.cost", unit="USD", description="What answering cost")
        self._saved = meter.create_counter(
            "tierlane.saved", unit="USD", description="Saved against the counterfactual upstream, by reason"
        )
        self._tier_requests = meter.create_counter(
            "tierlane.tier.requests", unit="{request}", description="Upstream requests by tier (cost, strong, none)"
        )
        self._tier_cost = meter.create_counter(
            "tierlane.tier.cost", unit="USD", description="What upstream answering cost, by tier"
        )
        self._rejections = meter.create_counter(
            "tierlane.budget.rejections", unit="{request}", description="Requests refused by a limit"
        )

    def record(self, m: Measurement) -> None:
        who = {a.TENANT: m.tenant, a.APP: m.app, a.LANE: m.lane}
        if m.model_called:
            genai = {
                a.GEN_AI_OPERATION: m.operation,
                a.GEN_AI_PROVIDER: m.provider,
                a.GEN_AI_REQUEST_MODEL: m.request_model,
                a.GEN_AI_RESPONSE_MODEL: m.response_model,
                **who,
            }
            self._tokens.record(m.input_tokens, {**genai, a.GEN_AI_TOKEN_TYPE: "input"})
            self._tokens.record(m.output_tokens, {**genai, a.GEN_AI_TOKEN_TYPE: "output"})
            if m.error_type:
                genai[a.ERROR_TYPE] = m.error_type
            self._duration.record(m.model_seconds, genai)
        outcome = {**who, a.CACHE_STATUS: m.cache_status, "http.response.status_class": m.status_class}
        if m.ttft_s is not None:
            self._ttft.record(m.ttft_s, {a.GEN_AI_OPERATION: m.operation, a.GEN_AI_REQUEST_MODEL: m.request_model, **who})
        self._latency.record(m.latency_s, outcome)
        self._requests.add(1, outcome)
        if m.cost:
            self._cost.add(m.cost, {**who, a.GEN_AI_REQUEST_MODEL: m.request_model})
        for reason, amount in m.saved.items():
            if amount > 0:
                self._saved.add(amount, {**who, "tierlane.reason": reason})
        if m.lane == "upstream":
            tier = {a.TENANT: m.tenant, a.APP: m.app, a.TIER: m.tier}
            self._tier_requests.add(1, tier)
            if m.cost:
                self._tier_cost.add(m.cost, tier)

    def rejected(self, tenant: str, app: str, code: str) -> None:
        self._rejections.add(1, {a.TENANT: tenant, a.APP: app, "error.type": code})

    def watch_loop(self, loop: LoopMonitor) -> None:
        """The event loop's stalls: every tick's lateness, the largest per export, the count of stalls."""
        lag = self._meter.create_histogram(
            "tierlane.event_loop.lag",
            unit="s",
            description=f"How late a timer due every {loop.interval_s * 1000:g} ms fired on the event loop",
            explicit_bucket_boundaries_advisory=LAG_BUCKETS,
        )
        loop.on_lag(lag.record)
        read_max = loop.window()

        def largest(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(read_max())]

        def stalls(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(loop.stalls)]

        self._meter.create_observable_gauge(
            "tierlane.event_loop.lag.max",
            callbacks=[largest],
            unit="s",
            description="The largest event-loop lateness since the previous export",
        )
        self._meter.create_observable_counter(
            "tierlane.event_loop.stalls",
            callbacks=[stalls],
            unit="{stall}",
            description=f"Event-loop ticks late by {loop.stall_s * 1000:g} ms or more",
        )
