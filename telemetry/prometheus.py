"""The same measurements for Prometheus, in a registry of our own, rendered at GET /metrics.

A separate prometheus_client registry (rather than an OTel reader rendered by hand) keeps
/metrics working when no OTLP endpoint is configured, and lets prometheus_client own the
exposition format; the price is a second, cheap update per request. Every label value
passes through `LabelBounds` first, so the number of series is fixed by the configuration.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from telemetry.metrics import DURATION_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS, Measurement

CONTENT_TYPE = CONTENT_TYPE_LATEST


class PromMetrics:
    """prometheus_client instruments, created once; `render()` is the /metrics body."""

    def __init__(self, ledger_pending: Callable[[], float] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        genai = ["operation", "provider", "request_model", "response_model", "lane", "tenant", "app"]
        who = ["lane", "tenant", "app"]
        self._tokens = Histogram(
            "gen_ai_client_token_usage",
            "Tokens used per model call (GenAI semconv gen_ai.client.token.usage)",
            [*genai, "token_type"],
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self._duration = Histogram(
            "gen_ai_client_operation_duration_seconds",
            "Duration of the model call, edge or upstream (gen_ai.client.operation.duration)",
            [*genai, "error_type"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self._ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time from receiving a request to its first answer token (gen_ai.server.time_to_first_token)",
            ["operation", "request_model", *who],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._latency = Histogram(
            "tierlane_request_duration_seconds",
            "Whole request latency as the client saw it",
            [*who, "cache_status", "status_class"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self._requests = Counter(
            "tierlane_requests", "Finished requests", [*who, "cache_status", "status_class"], registry=self.registry
        )
        self._token_count = Counter(
            "tierlane_tokens",
            "Tokens by lane; on the cache lane these are the tokens the hit avoided",
            [*who, "model", "token_type"],
            registry=self.registry,
        )
        self._cost = Counter(
            "tierlane_cost_usd", "What answering cost, USD", [*who, "model"], registry=self.registry
        )
        self._saved = Counter(
            "tierlane_saved_usd",
            "Saved against the counterfactual upstream, USD, by reason (cache, edge, trim)",
            [*who, "reason"],
            registry=self.registry,
        )
        self._rejections = Counter(
            "tierlane_budget_rejections",
            "Requests refused by a rate limit or budget",
            ["tenant", "app", "code"],
            registry=self.registry,
        )
        if ledger_pending is not None:
            pending = Gauge(
                "tierlane_ledger_pending_rows", "Ledger rows waiting for their commit", registry=self.registry
            )
            pending.set_function(ledger_pending)

    def record(self, m: Measurement) -> None:
        if m.model_called:
            labels = (m.operation, m.provider, m.request_model, m.response_model, m.lane, m.tenant, m.app)
            self._tokens.labels(*labels, "input").observe(m.input_tokens)
            self._tokens.labels(*labels, "output").observe(m.output_tokens)
            self._duration.labels(*labels, m.error_type or "").observe(m.model_seconds)
        if m.ttft_s is not None:
            self._ttft.labels(m.operation, m.request_model, m.lane, m.tenant, m.app).observe(m.ttft_s)
        self._latency.labels(m.lane, m.tenant, m.app, m.cache_status, m.status_class).observe(m.latency_s)
        self._requests.labels(m.lane, m.tenant, m.app, m.cache_status, m.status_class).inc()
        tokens = self._token_count
        tokens.labels(m.lane, m.tenant, m.app, m.request_model, "input").inc(m.input_tokens)
        tokens.labels(m.lane, m.tenant, m.app, m.request_model, "output").inc(m.output_tokens)
        if m.cached_input_tokens:
            tokens.labels(m.lane, m.tenant, m.app, m.request_model, "cached_input").inc(m.cached_input_tokens)
        if m.cost > 0:
            self._cost.labels(m.lane, m.tenant, m.app, m.request_model).inc(m.cost)
        for reason, amount in m.saved.items():
            if amount > 0:
                self._saved.labels(m.lane, m.tenant, m.app, reason).inc(amount)

    def rejected(self, tenant: str, app: str, code: str) -> None:
        self._rejections.labels(tenant, app, code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
