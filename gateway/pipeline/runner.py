"""Runs the stages over a RequestContext, calls the lane, and schedules the completion hooks."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import Iterator, Sequence

from gateway.context import Answer, Outcome, RequestContext
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
        # The model span stays open past this method: a stream's usage and duration are only
        # known when it ends, so `complete` closes it.
        span = tel.model_span(ctx)
        span.__enter__()
        try:
            answer = await self._execute(ctx)
        except BaseException as exc:
            span.__exit__(type(exc), exc, exc.__traceback__)
            raise
        ctx.model_span = span
        return answer

    async def _execute(self, ctx: RequestContext) -> Answer:
        if ctx.lane == "edge":
            from gateway.lanes import edge as edge_lane

            return await edge_lane.answer(self.services.engine, ctx)
        tel = self.services.telemetry
        inject = tel.spans.inject if tel is not None and tel.spans.enabled else None
        estimate = tel.estimate_usage if tel is not None else None
        return await upstream_lane.answer(self.services.pool, ctx, inject_trace=inject, estimate=estimate)

    def complete(self, ctx: RequestContext, outcome: Outcome) -> None:
        """Close the model span and run the hooks off the response path; drained on shutdown.

        Idempotent: only the first call for a request counts, so every request that entered the
        pipeline is metered (and its budget reservation settled) exactly once.
        """
        if ctx.completed:
            return
        ctx.completed = True
        span, ctx.model_span = ctx.model_span, None
        if span is not None:
            span.set_response(outcome.response)
            span.__exit__(None, None, None)
        if not self.hooks:
            return
        task = asyncio.get_running_loop().create_task(self._run_hooks(ctx, outcome))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _run_hooks(self, ctx: RequestContext, outcome: Outcome) -> None:
        for hook in self.hooks:
            try:
                await hook.on_complete(ctx, outcome)
            except Exception:  # noqa: BLE001 - a failing hook must not affect other hooks
                log.exception("completion hook %s failed for request %s", hook.name, ctx.request_id)

    async def drain(self) -> None:
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)


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
