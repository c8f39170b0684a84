"""The Telemetry facade the gateway holds: spans, metering, budgets, ledger and metrics in one object."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.trace.export import SpanExporter

from policies.budgets import Budgets, SpendRow
from policies.cache.error_bound import ScopeStats
from policies.domain import EdgeCheck, Outcome, Usage
from policies.errors import LimitExceeded
from policies.learn.service import TemplateStats
from policies.policy import Policy
from policies.pricing import Pricing, TokenPrice
from policies.shared_state.shared_budgets import SharedBudgets
from telemetry import attributes as a
from telemetry.attributes import LabelBounds
from telemetry.billing import Bill, compute_bill
from telemetry.config import TelemetryConfig
from telemetry.flow_metrics import FlowCollector, FlowRead
from telemetry.learn_metrics import LearnCollector
from telemetry.ledger import FILENAME, Ledger, LedgerRow
from telemetry.loop_monitor import LoopMonitor
from telemetry.metrics import Measurement, OtelMetrics
from telemetry.prometheus import CACHE_BOUND_GAUGES, ROUTE_BOUND_GAUGES, BoundCollector, PromMetrics
from telemetry.record import MeteredRequest
from telemetry.setup import build_providers
from telemetry.spans import ModelSpan, NoopSpan, ServerSpan, Spans, StageSpan
from telemetry.tokens import (
    TokenCount,
    chunk_tokens,
    estimate_request_tokens,
    estimate_usage,
    heuristic_count,
    load_local_tokenizer,
    prompt_texts,
    resolve_usage,
)
from telemetry.totals import rollups_current, totals
from telemetry.usage import JUDGE, UsageQuery, read_usage

if TYPE_CHECKING:
    from telemetry.fleet_usage import FleetUsage

log = logging.getLogger(__name__)

# The warning of a usage report answered from this replica's ledger because the shared store did not answer.
FLEET_UNAVAILABLE = "the shared state store did not answer: these are this replica's totals only"
FLEET_NO_PRIORITY = "the fleet totals keep no priority class: these are this replica's totals only"


class Telemetry:
    """Built once by `create_app`; `start()` opens the ledger, `close()` flushes everything."""

    def __init__(
        self,
        config: TelemetryConfig,
        policy: Policy,
        *,
        env: Mapping[str, str] | None = None,
        span_exporter: SpanExporter | None = None,
        metric_reader: MetricReader | None = None,
        token_count: TokenCount | None = None,
        error_codes: frozenset[str] = frozenset(),
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        shared: Callable[[Budgets], SharedBudgets] | None = None,
        fleet: FleetUsage | None = None,
    ) -> None:
        self.config = config
        self.pricing = Pricing.from_policy(policy)
        self.budgets = Budgets(policy, monotonic=monotonic, wall=wall)
        self.budgets.enabled = self.budgets.enabled and config.metering
        # state.backend: redis: limits counted in the shared store; None: in self.budgets alone
        self.shared = shared(self.budgets) if shared is not None and self.budgets.enabled else None
        # state.backend: redis: every metered request is also added to the fleet's totals in the store
        self.fleet = fleet if config.metering else None
        self.ledger = Ledger(config.state_dir / FILENAME, commit_window_s=config.commit_window_s,
                             retention=config.ledger_retention, wall=wall)  # fmt: skip
        self.bounds = LabelBounds(config.tenants, config.apps, {*self.pricing.known, *config.models})
        self._providers = build_providers(
            config.service_name,
            tracing=config.tracing,
            metrics=config.metrics,
            env=os.environ if env is None else env,
            span_exporter=span_exporter,
            metric_reader=metric_reader,
        )
        tp, mp = self._providers.tracer_provider, self._providers.meter_provider
        self.spans = Spans(
            tp.get_tracer("tierlane") if tp is not None else None,
            record_content=config.record_content,
            upstream_provider=config.upstream_provider,
        )
        self.otel = OtelMetrics(mp.get_meter("tierlane")) if mp is not None else None
        # The event loop's stalls, wherever metrics go (/metrics or OTLP); started by `start()`.
        self.loop: LoopMonitor | None = (
            LoopMonitor(config.loop_interval_s, config.loop_stall_s)
            if config.metrics and config.loop_interval_s > 0
            else None
        )
        if self.otel is not None and self.loop is not None:
            self.otel.watch_loop(self.loop)
        shared_state, fleet_usage = self.shared, self.fleet
        self.prometheus = (
            PromMetrics(
                ledger_pending=self.ledger.pending,
                ledger_failed=lambda: self.ledger.failed,
                store_errors=None if shared_state is None else lambda: shared_state.store_errors,
                store_fallbacks=None if shared_state is None else lambda: shared_state.fallback_admissions,
                store_resets=None if shared_state is None else lambda: shared_state.store_resets,
                usage_store_errors=None if fleet_usage is None else lambda: fleet_usage.errors,
                usage_rows_dropped=None if fleet_usage is None else lambda: fleet_usage.dropped,
                loop=self.loop,
            )
            if config.metrics
            else None
        )
        self._count: TokenCount = token_count or heuristic_count
        self._load_tokenizer = token_count is None
        self._wall = wall
        # the error codes the gateway's own error tree defines: the only error labels metrics carry
        self._error_codes = error_codes
        self._started = False
        self._watching_bounds = False
        self._watching_route_bounds = False
        self._watching_flow = False
        self._watching_learn = False

    async def start(self) -> None:
        """Start the loop monitor; open the ledger, load the local tokenizer and restore this month's spend."""
        if self.loop is not None:
            self.loop.start()
        if self._started or not self.config.metering:
            return
        # NOTE: with a shared store the spend of every replica is in the store already; restoring
        # this replica's ledger seeds only the fallback used while the store is down.
        if self._load_tokenizer:
            self._count = await asyncio.to_thread(load_local_tokenizer)
        await asyncio.to_thread(self.ledger.start)
        self.budgets.restore(await asyncio.to_thread(self._month_spend))
        self._started = True

    async def close(self) -> None:
        """Commit every ledger row and export every pending span; safe to call twice."""
        if self.loop is not None:
            self.loop.stop()
        if self.shared is not None:
            shared, self.shared = self.shared, None
            await shared.close()
        if self.fleet is not None:
            fleet, self.fleet = self.fleet, None
            await fleet.close()
        if self._started:
            await asyncio.to_thread(self.ledger.close)
            self._started = False
        await asyncio.to_thread(self._providers.shutdown)

    # Spans ------------------------------------------------------------------------------

    def server_span(self, request: Any) -> ServerSpan | NoopSpan:
        return self.spans.server_span(request)

    def stage_span(self, ctx: MeteredRequest, name: str) -> StageSpan | NoopSpan:
        return self.spans.stage_span(ctx, name)

    def model_span(self, ctx: MeteredRequest) -> ModelSpan | NoopSpan:
        return self.spans.model_span(ctx)

    # Budgets ----------------------------------------------------------------------------

    def admit(self, ctx: MeteredRequest) -> None:
        """Count the request and reserve what it can cost, or raise LimitExceeded / BudgetExceeded (a 429).

        In-process only (no await): the embedded backend. `admit_async` is what the pipeline calls.
        """
        if not self.budgets.enabled:
            return
        tokens = estimate_request_tokens(ctx.body)
        try:
            self.budgets.admit(ctx.uid, ctx.principal.tenant, ctx.principal.app, tokens, self._reservation(ctx))
        except LimitExceeded as exc:
            self._rejected(ctx, exc)
            raise

    async def admit_async(self, ctx: MeteredRequest) -> None:
        """`admit`, against the shared store when there is one (StoreUnavailable, a 503, when it fails and errors deny)."""
        shared = self.shared
        if shared is None:
            self.admit(ctx)
            return
        tokens = estimate_request_tokens(ctx.body)
        try:
            await shared.admit(ctx.uid, ctx.principal.tenant, ctx.principal.app, tokens, self._reservation(ctx))
        except LimitExceeded as exc:
            self._rejected(ctx, exc)
            raise

    def _rejected(self, ctx: MeteredRequest, exc: LimitExceeded) -> None:
        tenant, app = self.bounds.tenant(ctx.principal.tenant), self.bounds.app(ctx.principal.app)
        code = exc.code or "rate_limit_exceeded"
        if self.otel is not None:
            self.otel.rejected(tenant, app, code)
        if self.prometheus is not None:
            self.prometheus.rejected(tenant, app, code)

    def estimate_usage(self, body: Mapping[str, Any], response: Mapping[str, Any] | None) -> Usage:
        """A local count of a request and its answer, marked `estimated` (for upstreams that report none)."""
        return estimate_usage(self._count, body, response)

    def _price(self, ctx: MeteredRequest) -> TokenPrice | None:
        """The price of the lane answering ctx now (None for a cache hit, which costs no tokens)."""
        if ctx.lane not in ("edge", "upstream"):
            return None  # a cache hit, or a request no lane answers (count_tokens)
        return self.pricing.edge if ctx.lane == "edge" else self.pricing.upstream(ctx.target_model, ctx.pool)

    def _reservation(self, ctx: MeteredRequest) -> float:
        """USD held at admission: the prompt and the most completion tokens the request may produce."""
        price = self._price(ctx)
        if price is None:
            return 0.0
        wire = ctx.request
        if ctx.operation == "embeddings" or wire is None:
            output = 0
        else:
            limit = wire.output_limit
            output = (self.budgets.reserve_output_tokens if limit is None else limit) * (wire.n or 1)
        return reservation_usd(price, ctx.body, output)

    def charge_chunk(self, ctx: MeteredRequest, chunk: Mapping[str, Any]) -> None:
        """Charge the tokens of one streamed chunk; raises LimitExceeded/BudgetExceeded to end the stream.

        Never awaits: with a shared store the charges go out in batches (see policies/shared_state/shared_budgets.py),
        and a breach a batch found ends the stream at a later chunk.
        """
        if not self.budgets.enabled:
            return
        price = self._price(ctx)
        if price is None:
            return
        tokens = chunk_tokens(chunk)
        cost = tokens * price.output / 1_000_000.0
        shared = self.shared
        breach = (
            self.budgets.stream_breach(ctx.uid, tokens, cost) if shared is None else shared.charge_chunk(ctx.uid, tokens, cost)
        )
        if breach is not None:
            raise breach

    # Metering ---------------------------------------------------------------------------

    async def meter(self, ctx: MeteredRequest, outcome: Outcome) -> Bill | None:
        """Cost, savings, ledger row, metrics and span attributes of one finished request."""
        if not self.config.metering:
            return None
        ended = time.perf_counter()
        try:
            usage = await resolve_usage(ctx, outcome, self._count)
            bill = compute_bill(ctx, usage, self.pricing)
        except BaseException:
            if self.shared is None:
                self.budgets.settle(ctx.uid, 0, 0.0)  # never leave a reservation behind
            else:
                self.shared.release_soon(ctx.uid)
            raise
        latency = max(0.0, ended - ctx.received_at)
        ttft = max(0.0, ctx.first_token_at - ctx.received_at) if ctx.first_token_at is not None else None
        row = self._row(ctx, outcome, usage, bill, latency, ttft, self._wall() - latency)
        tokens = usage.input_tokens + usage.output_tokens
        if self.shared is None:
            self.budgets.settle(ctx.uid, tokens, bill.cost)
        else:
            await self.shared.settle(ctx.uid, tokens, bill.cost)
        self.ledger.append(row)
        if self.fleet is not None:
            self.fleet.record(row)  # in the background; a store failure is retried or counted, never raised
        if self.otel is not None or self.prometheus is not None:
            measurement = self._measurement(ctx, outcome, usage, bill, latency, ttft)
            if self.otel is not None:
                self.otel.record(measurement)
            if self.prometheus is not None:
                self.prometheus.record(measurement)
        self.spans.annotate(
            ctx,
            {
                a.COST: bill.cost,
                a.SAVED: bill.saved,
                a.SAVED_CACHE: bill.saved_cache,
                a.SAVED_EDGE: bill.saved_edge,
                a.SAVED_TRIM: bill.saved_trim,
                a.SAVED_MASK: bill.saved_mask,
                a.SAVED_VS_STRONG: bill.saved_vs_strong,
                a.SAVED_VS_NAMED: bill.saved_vs_named,
                a.USAGE_ESTIMATED: usage.estimated,
                **({a.TIER: ctx.tier} if ctx.lane == "upstream" and ctx.tier is not None else {}),
                **_edge_attributes(ctx.edge_check),
            },
        )
        return bill

    def release(self, ctx: MeteredRequest) -> None:
        """Give back what admission reserved for a request that ends unanswered and is not metered: a Batch
        API line refused by a busy upstream, or cut off by a shutdown, that runs again later (no ledger row)."""
        if not self.budgets.enabled:
            return
        if self.shared is None:
            self.budgets.settle(ctx.uid, 0, 0.0)
        else:
            self.shared.release_soon(ctx.uid)

    async def admit_judge(self, key: str, tenant: str, app: str, tokens: int) -> bool:
        """Hold a judging re-ask (gateway/pipeline/shadow.py) against the budgets of `tenant`/`app`, the
        line it is billed to; False when that line is over a limit (or the shared store refuses): the
        judgement is then skipped. `key` identifies it until `record_judge`."""
        if not self.config.metering or not self.budgets.enabled:
            return True
        try:
            if self.shared is None:
                self.budgets.admit(key, tenant, app, tokens)
            else:
                await self.shared.admit(key, tenant, app, tokens, 0.0)
        except Exception:  # noqa: BLE001 - over a limit, or the store down: no judging on that line now
            return False
        return True

    async def record_judge(
        self,
        key: str,
        *,
        request_id: str,
        tenant: str,
        app: str,
        judged_tenant: str,
        judged_app: str,
        lane: str,
        model: str,
        input_tokens: int,
        output_tokens: int,
        cost: float,
        status: int,
        latency_s: float,
    ) -> None:
        """Bill one judging re-ask to `tenant`/`app`: settle its hold in the budgets and write its ledger row
        (operation `judge`; /v1/usage shows it under the judge_* measures, never as a request)."""
        if not self.config.metering:
            return
        tokens, cost = max(0, input_tokens) + max(0, output_tokens), max(0.0, cost)
        if self.budgets.enabled:
            if self.shared is None:
                self.budgets.settle(key, tokens, cost)
            else:
                await self.shared.settle(key, tokens, cost)
        latency = max(0.0, latency_s)
        row = LedgerRow(
            request_id=f"{JUDGE}:{request_id}", ts=self._wall() - latency, tenant=tenant, app=app, lane=lane,
            model=model, requested_model=model, operation=JUDGE, stream=False, input_tokens=max(0, input_tokens),
            output_tokens=max(0, output_tokens), cached_input_tokens=0, estimated=False, trimmed_tokens=0, cost=cost,
            saved_cache=0.0, saved_edge=0.0, saved_trim=0.0, status=status, complete=status == 200, error_code=None,
            latency_ms=latency * 1000.0, ttft_ms=None, cache_status="off", route_score=None,
            judged_tenant=judged_tenant, judged_app=judged_app, priority="batch",  # re-asks wait for idle capacity
        )  # fmt: skip
        self.ledger.append(row)
        if self.fleet is not None:
            self.fleet.record(row)

    def _row(
        self,
        ctx: MeteredRequest,
        outcome: Outcome,
        usage: Usage,
        bill: Bill,
        latency: float,
        ttft: float | None,
        started: float,
    ) -> LedgerRow:
        check = ctx.edge_check
        escalated = check is not None and check.escalated
        # the request's trace: the current span's (tracing on), else the caller's `traceparent`
        span = trace.get_current_span().get_span_context()
        trace_id: str | None = format(span.trace_id, "032x") if span.is_valid else None
        if trace_id is None:
            parts = str(ctx.headers.get("traceparent") or "").split("-")
            if len(parts) >= 4 and len(parts[1]) == 32 and parts[1].strip("0123456789abcdef") == "" and parts[1].strip("0"):
                trace_id = parts[1]
        return LedgerRow(
            request_id=ctx.request_id,
            ts=started,
            tenant=ctx.principal.tenant,
            app=ctx.principal.app,
            lane=ctx.lane,
            model=ctx.target_model or ctx.model,
            requested_model=ctx.model,
            session=ctx.session,
            cache_write_tokens=max(0, usage.cache_write_tokens) + max(0, usage.cache_write_1h_tokens),
            mask_mode=_mask_mode(ctx.attributes.get(a.MASK_MODE)),
            masked_tokens=bill.masked_tokens,
            mask_write_tokens=bill.mask_write_tokens,
            saved_mask=bill.saved_mask,
            operation=ctx.operation,
            stream=ctx.stream,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_input_tokens=usage.cached_input_tokens,
            estimated=usage.estimated,
            trimmed_tokens=bill.trimmed_tokens,
            cost=bill.cost,
            saved_cache=bill.saved_cache,
            saved_edge=bill.saved_edge,
            saved_trim=bill.saved_trim,
            status=outcome.status,
            complete=outcome.complete,
            error_code=outcome.error_code,
            latency_ms=latency * 1000.0,
            ttft_ms=None if ttft is None else ttft * 1000.0,
            cache_status=ctx.cache_status,
            route_score=ctx.route.score if ctx.route is not None else None,
            route_reason=ctx.route.reason if ctx.route is not None else None,
            confidence=check.confidence if check is not None else None,
            escalated=escalated,
            edge_tokens=check.edge_output_tokens + check.edge_input_tokens if check is not None else 0,
            escalation_reason=(check.reason or "unknown") if check is not None and escalated else None,
            cache_similarity=ctx.cache_similarity if ctx.cache_status == "hit" else None,
            trace_id=trace_id,
            api=ctx.api,
            priority=ctx.priority,
            tier=ctx.tier if ctx.lane == "upstream" else None,
            saved_vs_strong=bill.saved_vs_strong,
            saved_vs_named=bill.saved_vs_named,
            cache_score=_float_or_none(ctx.attributes.get("tierlane.cache.score")) if ctx.cache_status == "hit" else None,
        )

    def _measurement(
        self, ctx: MeteredRequest, outcome: Outcome, usage: Usage, bill: Bill, latency: float, ttft: float | None
    ) -> Measurement:
        bounds = self.bounds
        response_model = (outcome.response or {}).get("model") if isinstance(outcome.response, dict) else None
        request_model = bounds.model(ctx.target_model or ctx.model)
        called = ctx.lane in ("edge", "upstream") and (
            ctx.lane_seconds > 0 or ctx.first_token_at is not None or usage.input_tokens + usage.output_tokens > 0
        )
        error = outcome.error_code or (bounds.status_class(outcome.status) if outcome.status >= 400 else None)
        return Measurement(
            operation=a.OPERATION_NAMES.get(ctx.operation, ctx.operation),
            provider="llama.cpp" if ctx.lane == "edge" else self.config.upstream_provider,
            request_model=request_model,
            response_model=bounds.model(response_model) if response_model else request_model,
            tenant=bounds.tenant(ctx.principal.tenant),
            app=bounds.app(ctx.principal.app),
            lane=bounds.lane(ctx.lane),
            cache_status=ctx.cache_status if ctx.cache_status in ("hit", "miss", "bypass", "off") else a.OTHER,
            status_class=bounds.status_class(outcome.status),
            error_type=None if error is None else self._bounded_error(error),
            model_called=called,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_input_tokens=usage.cached_input_tokens,
            cache_write_tokens=max(0, usage.cache_write_tokens) + max(0, usage.cache_write_1h_tokens),
            model_seconds=ctx.lane_seconds,
            latency_s=latency,
            ttft_s=ttft,
            cost=bill.cost,
            saved=bill.saved_by_reason(),
            tier=bounds.tier(ctx.tier) if ctx.lane == "upstream" else a.NO_TIER,
            **_edge_fields(ctx.edge_check),
        )

    def _bounded_error(self, code: str) -> str:
        # An upstream may pass any code through; only the gateway's own codes become labels.
        return code if code in self._error_codes or code.endswith("xx") else a.OTHER

    # Reports ----------------------------------------------------------------------------

    def usage_query(self, params: Mapping[str, Any]) -> UsageQuery:
        """Parse /v1/usage parameters against this telemetry's clock; raises InvalidRequest."""
        return UsageQuery.parse(params, now=self._wall())

    async def usage(self, query: UsageQuery) -> list[dict[str, Any]]:
        """Ledger totals for a query, including rows appended a moment ago."""
        return (await self.local_usage(query))[0]

    async def local_usage(self, query: UsageQuery) -> tuple[list[dict[str, Any]], str | None]:
        """(rows, warning): this replica's ledger totals, and what a report must say about rows past retention."""
        if self._started:
            await asyncio.to_thread(self.ledger.flush)
        return await asyncio.to_thread(read_usage, self.ledger, query)

    async def fleet_usage(self, query: UsageQuery) -> tuple[list[dict[str, Any]], str, str | None]:
        """(rows, source, warning): the totals of every replica from the shared store (source "fleet",
        whole UTC hours) when there is one and it answers, else this replica's ledger ("local"; with
        the redis backend, a warning says the store did not answer). The fleet totals keep no priority
        class: a query by it is this replica's, and says so."""
        fleet = self.fleet
        if fleet is not None and query.rows_only:
            rows, note = await self.local_usage(query)
            return rows, "local", "; ".join(w for w in (FLEET_NO_PRIORITY, note) if w)
        if fleet is not None:
            try:
                return await fleet.query(query), "fleet", None
            except Exception as exc:  # noqa: BLE001 - store down or slow: this replica's ledger answers
                fleet.query_errors += 1
                log.warning("fleet usage query failed, answering from the local ledger: %r", exc)
                rows, note = await self.local_usage(query)
                return rows, "local", FLEET_UNAVAILABLE if note is None else f"{FLEET_UNAVAILABLE}; {note}"
        rows, note = await self.local_usage(query)
        return rows, "local", note

    def watch_cache_bounds(self, read: Callable[[], list[ScopeStats]]) -> None:
        """Export the semantic cache's error bound per tenant/app (cache.max_error_rate): on /metrics,
        and as OTel observable gauges where an OTel meter is configured. Called once, when the cache is built."""
        if self._watching_bounds:
            return
        self._watching_bounds = True
        bounds = self.bounds
        if self.prometheus is not None:
            self.prometheus.registry.register(BoundCollector(CACHE_BOUND_GAUGES, read, bounds.tenant, bounds.app))
        mp = self._providers.meter_provider
        if mp is None:
            return
        meter = mp.get_meter("tierlane")
        for name, doc, value in CACHE_BOUND_GAUGES:

            def observe(options: CallbackOptions, value: Callable[[ScopeStats], float | None] = value) -> list[Observation]:
                out = []
                for st in read():
                    tenant, _sep, app = st.scope.partition("/")
                    v = value(st)
                    if v is not None:
                        out.append(Observation(float(v), {a.TENANT: bounds.tenant(tenant), a.APP: bounds.app(app)}))
                return out

            # tierlane_cache_served_error -> tierlane.cache.served_error
            meter.create_observable_gauge("tierlane.cache." + name.removeprefix("tierlane_cache_"), callbacks=[observe],
                                          description=doc)  # fmt: skip

    def watch_route_bounds(self, read: Callable[[], list[Any]]) -> None:
        """Export the routing quality bound per tenant/app and region on /metrics (lanes.upstream.tiers.max_quality_loss)."""
        if self._watching_route_bounds or self.prometheus is None:
            return
        self._watching_route_bounds = True
        bounds = self.bounds
        self.prometheus.registry.register(BoundCollector(ROUTE_BOUND_GAUGES, read, bounds.tenant, bounds.app, regions=True))

    def watch_learn(self, read: Callable[[], list[TemplateStats]]) -> None:
        """Export the learned templates' counters on /metrics (policy `learn`). Called once, when learning is on."""
        if self._watching_learn or self.prometheus is None:
            return
        self._watching_learn = True
        self.prometheus.registry.register(LearnCollector(read, self.bounds.tenant, self.bounds.app))

    def watch_flow(self, read: FlowRead) -> None:
        """Export flow control's queues, waits, refusals and budgets on /metrics (telemetry/flow_metrics.py). Once."""
        if self._watching_flow or self.prometheus is None:
            return
        self._watching_flow = True
        self.prometheus.registry.register(FlowCollector(read))

    def render_metrics(self) -> bytes:
        return self.prometheus.render() if self.prometheus is not None else b""

    def _month_spend(self) -> list[SpendRow]:
        """This month's spend per tenant, app and UTC day (judging included), from the rollups where rows are past retention."""
        now = dt.datetime.fromtimestamp(self._wall(), dt.UTC)
        month = dt.datetime(now.year, now.month, 1, tzinfo=dt.UTC)
        nxt = dt.datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=dt.UTC)
        edges = [d.timestamp() for d in (month + dt.timedelta(days=i) for i in range((nxt - month).days + 1))]
        ranges = list(zip(edges, edges[1:]))
        with self.ledger.snapshot() as conn:
            if conn is None:
                return []
            rows = totals(conn, ranges, ("tenant", "app"), measures=("cost", "judge_cost"), rollups=rollups_current(conn))
        return [SpendRow(tenant=r["tenant"], app=r["app"], day=time.strftime("%Y-%m-%d", time.gmtime(ranges[r["label"]][0])),
                         cost=r["cost"] + r["judge_cost"]) for r in rows]  # fmt: skip


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


# Template tokens a chat format may add per message (role markers, separators), and once per
# request: generous, because a reservation must not be smaller than what the request costs.
RESERVE_PER_MESSAGE_TOKENS = 16


def _edge_attributes(check: EdgeCheck | None) -> dict[str, Any]:
    if check is None:
        return {}
    attrs: dict[str, Any] = {a.EDGE_PASSED: check.passed, a.EDGE_ESCALATED: check.escalated}
    if check.confidence is not None:
        attrs[a.EDGE_CONFIDENCE] = check.confidence
    if check.threshold is not None:
        attrs[a.EDGE_THRESHOLD] = check.threshold
    if check.escalated:
        attrs[a.EDGE_ESCALATION_REASON] = check.reason
        attrs[a.EDGE_ESCALATED_TOKENS] = check.edge_input_tokens + check.edge_output_tokens
    return attrs


def _edge_fields(check: EdgeCheck | None) -> dict[str, Any]:
    if check is None:
        return {}
    result = "escalated" if check.escalated else "served" if check.passed else "not_cacheable"
    return {
        "edge_result": result,
        "edge_reason": check.reason if check.escalated else "",
        "edge_confidence": check.confidence,
        "edge_wasted_tokens": check.edge_input_tokens + check.edge_output_tokens if check.escalated else 0,
    }


def reservation_usd(price: TokenPrice, body: Mapping[str, Any], output_tokens: int) -> float:
    """An upper bound of what a request costs: prompt bytes as tokens, plus `output_tokens`.

    NOTE: a byte-level tokenizer never makes more tokens than the text has UTF-8 bytes, so
    bytes bound the prompt for any model (about 4x the usual count of English text); a
    heuristic count could come in under the real one, and then concurrent requests could
    pass a limit by more than one reservation.
    """
    texts, messages = prompt_texts(body)
    tokens = sum(len(t.encode("utf-8")) for t in texts) + (messages + 1) * RESERVE_PER_MESSAGE_TOKENS
    for schema in ("tools", "functions", "response_format"):  # schemas the model reads as prompt
        if body.get(schema) is not None:
            tokens += len(orjson.dumps(body[schema]))
    return price.input_cost(tokens) + output_tokens * price.output / 1_000_000.0


async def build_telemetry(settings: Any, policy: Policy, error_codes: frozenset[str] = frozenset()) -> Telemetry:
    """The gateway component builder: a started Telemetry from `gateway.settings.Settings`."""
    telemetry = Telemetry(
        TelemetryConfig.from_settings(settings),
        policy,
        error_codes=error_codes,
        shared=shared_budgets(settings),
        fleet=fleet_usage(settings),
    )
    await telemetry.start()
    return telemetry


def fleet_usage(settings: Any) -> FleetUsage | None:
    """The fleet usage aggregates `state.backend: redis` asks for; None for embedded."""
    state = getattr(settings, "state", None)
    if state is None or state.backend != "redis":
        return None
    from telemetry.fleet_usage import FleetUsage  # redis is imported only when configured

    return FleetUsage.connect(
        state.url,
        key_prefix=state.key_prefix,
        connect_timeout_s=state.connect_timeout_ms / 1000.0,
        op_timeout_s=state.op_timeout_ms / 1000.0,
    )


def shared_budgets(settings: Any) -> Callable[[Budgets], SharedBudgets] | None:
    """The builder of the shared budgets `state.backend: redis` asks for; None for embedded."""
    state = getattr(settings, "state", None)
    if state is None or state.backend != "redis":
        return None

    def build(budgets: Budgets) -> SharedBudgets:
        from policies.shared_state.redis_budgets import RedisBudgets  # redis is imported only when configured

        store = RedisBudgets.connect(
            budgets,
            state.url,
            key_prefix=state.key_prefix,
            connect_timeout_s=state.connect_timeout_ms / 1000.0,
            op_timeout_s=state.op_timeout_ms / 1000.0,
            hold_ttl_s=state.hold_ttl_s,
        )
        return SharedBudgets(
            budgets,
            store,
            op_timeout_s=state.op_timeout_ms / 1000.0,
            on_outage=state.outage,
            fallback=state.fallback_limits,
            heartbeat_s=state.heartbeat_s,
            batch_tokens=state.stream_batch_tokens,
            batch_s=state.stream_batch_ms / 1000.0,
        )

    return build


def _mask_mode(value: object) -> str | None:
    return value if value in ("shadow", "on") else None
