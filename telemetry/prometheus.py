"""The same measurements for Prometheus, in a registry of our own, rendered at GET /metrics.

A separate prometheus_client registry (rather than an OTel reader rendered by hand) keeps
/metrics working when no OTLP endpoint is configured, and lets prometheus_client own the
exposition format; the price is a second, cheap update per request. Every label value
passes through `LabelBounds` first, so the number of series is fixed by the configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from telemetry.attributes import SAVING_REASONS
from telemetry.loop_monitor import LAG_BUCKETS, LoopMonitor
from telemetry.metrics import CONFIDENCE_BUCKETS, DURATION_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS, Measurement

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _ReadCounter:
    """A counter whose total is read from a callable at scrape time.

    NOTE: prometheus_client's Counter has no `set_function` (only Gauge has); a total kept
    elsewhere (the ledger's failed rows, counted by its writer thread) is exported as a
    counter by a collector of its own instead.
    """

    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name = name
        self._documentation = documentation
        self._read = read

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, self._documentation)]

    def collect(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, self._documentation, value=float(self._read()))]


# (name, documentation, what of a scope's ScopeStats it reads; None: not exported this scrape)
CACHE_BOUND_GAUGES: tuple[tuple[str, str, Callable[[Any], float | None]], ...] = (
    ("tierlane_cache_served_error", "Semantic cache hits judged wrong, as they are served now (cache.max_error_rate)",
     lambda st: st.error),
    ("tierlane_cache_served_error_upper", "Upper confidence bound of the semantic cache's served error",
     lambda st: st.upper),
    ("tierlane_cache_max_error_rate", "The bound the served error's upper bound is kept under", lambda st: st.max_error_rate),
    ("tierlane_cache_serve_threshold", "The threshold semantic hits are served at (verifier probability, or cosine)",
     lambda st: st.threshold),
    ("tierlane_cache_hit_rate", "Cache hits over cache lookups, where cache.max_error_rate is set", lambda st: st.hit_rate),
    ("tierlane_cache_judged_hits", "Semantic hits judged against the upstream's answer (all, since start)",
     lambda st: float(st.observed)),
)  # fmt: skip


# the routing quality bound (lanes.upstream.tiers.max_quality_loss) per tenant/app and region (RegionStats)
ROUTE_BOUND_GAUGES: tuple[tuple[str, str, Callable[[Any], float | None]], ...] = (
    ("tierlane_route_quality_loss", "Share of a region's tiered requests the cost tier answers differently (judged)",
     lambda st: st.loss),
    ("tierlane_route_quality_loss_upper", "Upper confidence bound of that share", lambda st: st.upper),
    ("tierlane_route_max_quality_loss", "The bound that upper bound is kept under", lambda st: st.max_quality_loss),
    ("tierlane_route_region_threshold", "The router score at or above which the region's requests go to the strong tier",
     lambda st: st.threshold),
    ("tierlane_route_region_strong_share", "Share of the region's tiered requests this replica sent to the strong tier",
     lambda st: st.strong_share),
    ("tierlane_route_judged", "Tiered answers judged against the other tier's (all, since start)", lambda st: float(st.observed)),
)  # fmt: skip


class BoundCollector:
    """A bound's gauges per tenant/app (and region, where it has them), read at scrape time; labels
    bounded like every other (regions are a fixed, small set)."""

    def __init__(self, gauges: tuple[tuple[str, str, Callable[[Any], float | None]], ...], read: Callable[[], list[Any]],
                 tenant: Callable[[str], str], app: Callable[[str], str], *, regions: bool = False) -> None:  # fmt: skip
        self._gauges = gauges
        self._read = read
        self._tenant = tenant
        self._app = app
        self._labels = ["tenant", "app", "region"] if regions else ["tenant", "app"]

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(name, doc, labels=self._labels) for name, doc, _ in self._gauges]

    def collect(self) -> list[GaugeMetricFamily]:
        families = self.describe()
        seen: set[tuple[str, ...]] = set()
        for st in self._read():
            scope = st.scope  # the cache bound's `tenant/app`, or the route bound's Scope
            tenant, app = (scope.tenant, scope.app) if hasattr(scope, "tenant") else scope.partition("/")[::2]
            labels: tuple[str, ...] = (self._tenant(tenant), self._app(app))
            if len(self._labels) == 3:
                labels = (*labels, str(st.region))
            if labels in seen:
                continue  # unlisted tenants/apps share `other`: the first one seen stands for them
            seen.add(labels)
            for family, (_, _, value) in zip(families, self._gauges):
                v = value(st)
                if v is not None:
                    family.add_metric(list(labels), float(v))
        return families


class PromMetrics:
    """prometheus_client instruments, created once; `render()` is the /metrics body."""

    def __init__(
        self,
        ledger_pending: Callable[[], float] | None = None,
        ledger_failed: Callable[[], float] | None = None,
        store_errors: Callable[[], float] | None = None,
        store_fallbacks: Callable[[], float] | None = None,
        store_resets: Callable[[], float] | None = None,
        usage_store_errors: Callable[[], float] | None = None,
        usage_rows_dropped: Callable[[], float] | None = None,
        loop: LoopMonitor | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Label values are bounded (LabelBounds), so this cache of labelled series is bounded too.
        self._series: dict[tuple[Any, ...], tuple[Any, ...]] = {}
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
        self._edge_checks = Counter(
            "tierlane_edge_checks",
            "Edge answers checked by the confidence cascade, by result (served, escalated, not_cacheable) and reason",
            ["tenant", "app", "result", "reason"],
            registry=self.registry,
        )
        self._edge_confidence = Histogram(
            "tierlane_edge_confidence",
            "Calibrated confidence that an edge answer is right, as the cascade scored it",
            ["tenant", "app"],
            buckets=CONFIDENCE_BUCKETS,
            registry=self.registry,
        )
        self._edge_wasted = Counter(
            "tierlane_edge_escalated_tokens",
            "Edge tokens (prompt and output) spent on answers the cascade escalated upstream",
            ["tenant", "app"],
            registry=self.registry,
        )
        self._tier_requests = Counter(
            "tierlane_tier_requests",
            "Upstream requests by tier: cost, strong (the router's pick where the policy has tiers), none",
            ["tenant", "app", "tier"],
            registry=self.registry,
        )
        self._tier_cost = Counter(
            "tierlane_tier_cost_usd", "What upstream answering cost, USD, by tier", ["tenant", "app", "tier"],
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
        if ledger_failed is not None:
            # Exposed as tierlane_ledger_rows_failed_total: rows the ledger dropped (unwritable).
            self.registry.register(
                _ReadCounter(
                    "tierlane_ledger_rows_failed",
                    "Ledger rows that could not be written and were dropped",
                    ledger_failed,
                )
            )
        if store_errors is not None:
            # state.backend: redis: operations the shared budget store failed or ran past its timeout on
            self.registry.register(
                _ReadCounter("tierlane_budget_store_errors", "Shared budget store operations that failed or timed out", store_errors)
            )
        if store_fallbacks is not None:
            self.registry.register(
                _ReadCounter(
                    "tierlane_budget_store_fallback_admissions",
                    "Requests admitted without the shared budget store (state.on_outage: local_share or allow)",
                    store_fallbacks,
                )
            )
        if store_resets is not None:
            self.registry.register(
                _ReadCounter(
                    "tierlane_budget_store_resets",
                    "Times the shared budget store was found to have lost its data (restart without persistence, flush)",
                    store_resets,
                )
            )
        if usage_store_errors is not None:
            # state.backend: redis: fleet usage batches the store did not take (each is sent again)
            self.registry.register(
                _ReadCounter(
                    "tierlane_usage_store_errors",
                    "Attempts to send fleet usage to the shared store that failed or timed out (the batch is sent again)",
                    usage_store_errors,
                )
            )
        if usage_rows_dropped is not None:
            self.registry.register(
                _ReadCounter(
                    "tierlane_usage_rows_dropped",
                    "Requests never added to the fleet usage totals: too many waiting for the store, or unsent at stop "
                    "(the ledger keeps them)",
                    usage_rows_dropped,
                )
            )

        if loop is not None:
            self._watch_loop(loop)

    def _watch_loop(self, loop: LoopMonitor) -> None:
        """The event loop's stalls: every tick's lateness, the largest since the last scrape, the count."""
        lag = Histogram(
            "tierlane_event_loop_lag_seconds",
            f"How late a timer due every {loop.interval_s * 1000:g} ms fired on the event loop (blocked loop time)",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        loop.on_lag(lag.observe)
        largest = Gauge(
            "tierlane_event_loop_lag_max_seconds",
            "The largest event-loop lateness since the previous scrape",
            registry=self.registry,
        )
        largest.set_function(loop.window())
        # Exposed as tierlane_event_loop_stalls_total.
        self.registry.register(
            _ReadCounter(
                "tierlane_event_loop_stalls",
                f"Event-loop ticks late by {loop.stall_s * 1000:g} ms or more (the loop was blocked that long)",
                lambda: loop.stalls,
            )
        )

    def record(self, m: Measurement) -> None:
        key = (m.operation, m.provider, m.request_model, m.response_model, m.lane, m.tenant, m.app,
               m.cache_status, m.status_class, m.error_type)  # fmt: skip
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = self._children(m)
        (tokens_in, tokens_out, duration, ttft, latency, requests, count_in, count_out, count_cached, count_written, cost,
         saved) = series
        if m.model_called:
            tokens_in.observe(m.input_tokens)
            tokens_out.observe(m.output_tokens)
            duration.observe(m.model_seconds)
        if m.ttft_s is not None:
            ttft.observe(m.ttft_s)
        latency.observe(m.latency_s)
        requests.inc()
        count_in.inc(m.input_tokens)
        count_out.inc(m.output_tokens)
        if m.cached_input_tokens:
            count_cached.inc(m.cached_input_tokens)
        if m.cache_write_tokens:
            count_written.inc(m.cache_write_tokens)
        if m.cost > 0:
            cost.inc(m.cost)
        for reason, amount in m.saved.items():
            if amount > 0:
                saved[reason].inc(amount)
        if m.edge_result is not None:
            self._edge(m)
        if m.lane == "upstream":
            self._tier_requests.labels(m.tenant, m.app, m.tier).inc()
            if m.cost > 0:
                self._tier_cost.labels(m.tenant, m.app, m.tier).inc(m.cost)

    def _edge(self, m: Measurement) -> None:
        self._edge_checks.labels(m.tenant, m.app, m.edge_result, m.edge_reason).inc()
        if m.edge_confidence is not None:
            self._edge_confidence.labels(m.tenant, m.app).observe(m.edge_confidence)
        if m.edge_wasted_tokens:
            self._edge_wasted.labels(m.tenant, m.app).inc(m.edge_wasted_tokens)

    def _children(self, m: Measurement) -> tuple[Any, ...]:
        """The labelled series one label combination writes to; looked up once, then reused."""
        labels = (m.operation, m.provider, m.request_model, m.response_model, m.lane, m.tenant, m.app)
        who = (m.lane, m.tenant, m.app)
        return (
            self._tokens.labels(*labels, "input"),
            self._tokens.labels(*labels, "output"),
            self._duration.labels(*labels, m.error_type or ""),
            self._ttft.labels(m.operation, m.request_model, *who),
            self._latency.labels(*who, m.cache_status, m.status_class),
            self._requests.labels(*who, m.cache_status, m.status_class),
            self._token_count.labels(*who, m.request_model, "input"),
            self._token_count.labels(*who, m.request_model, "output"),
            self._token_count.labels(*who, m.request_model, "cached_input"),
            self._token_count.labels(*who, m.request_model, "cache_write"),
            self._cost.labels(*who, m.request_model),
            {reason: self._saved.labels(*who, reason) for reason in SAVING_REASONS},
        )

    def rejected(self, tenant: str, app: str, code: str) -> None:
        self._rejections.labels(tenant, app, code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
