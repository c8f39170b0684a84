"""Runs the stages over a RequestContext, calls the lane, and schedules the completion hooks."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import Iterator, Sequence

from gateway.cascade import Escalate
from gateway.context import Answer, ModelCall, Outcome, RequestContext
from gateway.errors import Overloaded
from gateway.lanes import upstream as upstream_lane
from gateway.pipeline.base import CompletionHook, Stage
from gateway.services import Services

log = logging.getLogger(__name__)


class Pipeline:
    """The stages and hooks built for one running gateway."""

    def __init__(
        self,
        services: Services,
        stages: Sequence[tuple[str, str | None]],
        hooks: Sequence[tuple[str, str | None]],
    ) -> None:
        self.services = services
        self.stages: list[Stage] = [s for s in _build(services, stages) if s is not None]  # type: ignore[misc]
        self.hooks: list[CompletionHook] = [h for h in _build(services, hooks) if h is not None]  # type: ignore[misc]
        self._pending: set[asyncio.Task[None]] = set()
        self._closed = False

    async def answer(self, ctx: RequestContext) -> Answer:
        """Walk the stages; the first Answer wins, else the lane chosen on ctx answers."""
        tel = self.services.telemetry
        for stage in self.stages:
            if ctx.operation not in stage.operations:
                continue
            with _span(tel, "stage_span", ctx, stage.name):
                early = await stage.run(ctx)
            if early is not None:
                return early
        if tel is None:
            return await self._execute(ctx)
        call = ctx.model_span = ModelCall(tel, ctx)
        call.start()
        try:
            return await self._execute(ctx)
        except BaseException as exc:
            call.fail(exc)
            raise

    async def _execute(self, ctx: RequestContext) -> Answer:
        if ctx.lane == "edge":
            from gateway.lanes import edge as edge_lane

            engine = self.services.engine
            if engine is None:  # the resolve and route stages only pick the edge when it runs
                raise Overloaded("the edge lane is not running on this gateway", retry_after=5)
            cascade = self.services.cascade
            attempt = cascade.attempt_for(ctx) if cascade is not None else None
            try:
                return await edge_lane.answer(engine, ctx, attempt)
            except Escalate:
                assert ctx.fallback is not None, "only requests with a fallback are escalated"
                ctx.lane = "upstream"
                ctx.pool, ctx.target_model = ctx.fallback
                ctx.tier = ctx.fallback_tier
                ctx.edge_seconds = ctx.lane_seconds  # the escalated attempt's time; the upstream's is added
                ctx.first_token_at = None  # the client's first token is the upstream's
        tel = self.services.telemetry
        inject = tel.spans.inject if tel is not None and tel.spans.enabled else None
        estimate = tel.estimate_usage if tel is not None else None
        return await upstream_lane.answer(self.services.pool, ctx, inject_trace=inject, estimate=estimate)

    def complete(self, ctx: RequestContext, outcome: Outcome) -> None:
        """Finish the model call and run the hooks off the response path; drained on shutdown.

        Idempotent: only the first call for a request counts, so every request that entered the
        pipeline is metered (and its budget reservation settled) exactly once.
        """
        if ctx.completed:
            return
        ctx.completed = True
        call, ctx.model_span = ctx.model_span, None
        if call is not None:
            call.finish(outcome)
        if not self.hooks:
            return
        task = asyncio.get_running_loop().create_task(self._run_hooks(ctx, outcome))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _run_hooks(self, ctx: RequestContext, outcome: Outcome) -> None:
        for hook in self.hooks:
            try:
                await hook.on_complete(ctx, outcome)
            except Exception:
                log.exception("completion hook %s failed for request %s", hook.name, ctx.request_id)

    async def drain(self) -> None:
        """Wait for the hooks scheduled so far (not for background work the hooks started)."""
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def close(self) -> None:
        """Drain the hooks, then close hooks and stages; before the components and pool they use.

        Hooks close first: the shadow hook finishes its in-flight upstream calls there.
        """
        if self._closed:
            return
        self._closed = True
        await self.drain()
        parts: list[Stage | CompletionHook] = [*self.hooks, *self.stages]
        for part in parts:
            try:
                await part.close()
            except Exception:
                log.exception("closing pipeline part %s failed", part.name)


def _build(services: Services, entries: Sequence[tuple[str, str | None]]) -> Iterator[object]:
    for module, section in entries:
        if section is not None and services.policy.section(section).get("enabled", True) is False:
            continue
        yield importlib.import_module(module).build(services)


@contextlib.contextmanager
def _span(telemetry: object, method: str, *args: object) -> Iterator[None]:
    factory = getattr(telemetry, method, None) if telemetry is not None else None
    if factory is None:
        yield
        return
    with factory(*args):
        yield
