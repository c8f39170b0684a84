"""Budgets in a shared store, with a bounded wait on it and a fallback when it fails.

No request waits on the store longer than `op_timeout_s`. When the store fails (unreachable,
an error, or slower than that), `on_store_error` decides: `allow` admits the request against
the in-process `Budgets` of this replica (`fallback: local`, so each replica enforces the
limits alone while the store is down) or without any check (`fallback: none`), and counts it;
`deny` refuses it with StoreUnavailable (a 503 with Retry-After). The client reconnects on its
own, so the next request uses the store again once it is back.

Streams are charged in batches: `charge_chunk` runs on every streamed chunk and must not cost a
round trip each, so tokens are accumulated and sent every `batch_tokens` tokens or `batch_s`
seconds, in a background task (one at a time per request); the breach it finds ends the stream
at the next chunk. A stream can so pass a limit by at most one batch more than in-process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from policies.budget_store import BudgetStore
from policies.budgets import OPEN_SWEEP_AT, OPEN_TTL_S, Budgets
from policies.errors import LimitExceeded, StoreUnavailable

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    """A request the store admitted: where it is counted and its stream's unsent charges."""

    tenant: str
    app: str
    local: bool  # admitted by the in-process fallback while the store failed
    admitted: float = 0.0
    pending_tokens: int = 0
    pending_cost: float = 0.0
    sent_at: float = 0.0
    flush: asyncio.Task[None] | None = None
    breach: LimitExceeded | None = None


class SharedBudgets:
    """Admission, stream charges and settlement against a shared `BudgetStore`, with the fallback."""

    def __init__(
        self,
        budgets: Budgets,
        store: BudgetStore,
        *,
        op_timeout_s: float,
        on_store_error: Literal["allow", "deny"] = "allow",
        fallback: Literal["local", "none"] = "local",
        batch_tokens: int = 32,
        batch_s: float = 0.25,
    ) -> None:
        self.budgets = budgets
        self.store = store
        self._timeout = op_timeout_s
        self._deny = on_store_error == "deny"
        self._local_fallback = fallback == "local"
        self._batch_tokens = batch_tokens
        self._batch_s = batch_s
        self._open: dict[str, _Request] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.store_errors = 0  # operations the store failed (all kinds)
        self.fallback_admissions = 0  # requests admitted without the store (on_store_error: allow)

    def in_flight(self) -> int:
        return len(self._open)

    async def admit(self, key: str, tenant: str, app: str, tokens: int, reserve_usd: float) -> None:
        """Raises LimitExceeded / BudgetExceeded from the store, or StoreUnavailable when it fails and errors deny."""
        tenant_limits, app_limits = self.budgets.limits(tenant, app)
        if tenant_limits.unlimited and app_limits.unlimited:
            return
        try:
            async with asyncio.timeout(self._timeout):  # no task per call, unlike wait_for on 3.11
                await self.store.admit(key, tenant, app, tokens, reserve_usd)
        except LimitExceeded:
            raise
        except Exception as exc:  # noqa: BLE001 - any store failure (connection, timeout, script) takes the fallback
            self._failed("admit", exc)
            # A timeout may come after the script ran: release what it may hold, when the store answers.
            self._spawn(self._forget(key, tenant, app))
            if self._deny:
                raise StoreUnavailable(
                    "the shared budget store is unavailable; try again shortly", retry_after=1.0
                ) from None
            if self._local_fallback:
                self.budgets.admit(key, tenant, app, tokens, reserve_usd)  # may raise: this replica's own limits
            self.fallback_admissions += 1
            self._track(key, _Request(tenant, app, local=True))
            return
        self._track(key, _Request(tenant, app, local=False))

    def _track(self, key: str, request: _Request) -> None:
        now = time.monotonic()
        request.admitted = request.sent_at = now
        if len(self._open) >= OPEN_SWEEP_AT:  # requests whose settlement never ran (a hook that did not)
            for stale in [k for k, r in self._open.items() if now - r.admitted > OPEN_TTL_S]:
                del self._open[stale]
        self._open[key] = request

    async def _forget(self, key: str, tenant: str, app: str) -> None:
        try:
            await asyncio.wait_for(self.store.settle(key, tenant, app, 0, 0.0), self._timeout)
        except Exception:  # noqa: BLE001 - best effort: the hold expires on its own after hold_ttl_s
            pass

    def charge_chunk(self, key: str, tokens: int, cost: float) -> LimitExceeded | None:
        """Charge a streamed chunk without waiting: the breach a previous batch found, if any."""
        request = self._open.get(key)
        if request is None or tokens <= 0:
            return None
        if request.local:
            return self.budgets.stream_breach(key, tokens, cost) if self._local_fallback else None
        if request.breach is not None:
            return request.breach
        request.pending_tokens += tokens
        request.pending_cost += cost if cost > 0.0 else 0.0
        now = time.monotonic()
        due = request.pending_tokens >= self._batch_tokens or now - request.sent_at >= self._batch_s
        if due and request.flush is None:
            request.sent_at = now
            request.flush = self._spawn(self._flush(key, request))
        return None

    async def _flush(self, key: str, request: _Request) -> None:
        tokens, cost = request.pending_tokens, request.pending_cost
        request.pending_tokens, request.pending_cost = 0, 0.0
        try:
            breach = await asyncio.wait_for(self.store.charge(key, request.tenant, request.app, tokens, cost), self._timeout)
            request.breach = request.breach or breach
        except Exception as exc:  # noqa: BLE001 - a lost batch is made good by the settlement
            self._failed("charge", exc)
        finally:
            request.flush = None

    async def settle(self, key: str, tokens: int, cost: float) -> None:
        """Replace the request's hold and charges by its final usage (after any batch still being sent)."""
        request = self._open.pop(key, None)
        if request is None:
            return
        if request.local:
            if self._local_fallback:
                self.budgets.settle(key, tokens, cost)
            return
        if request.flush is not None:
            await asyncio.wait({request.flush})
        try:
            async with asyncio.timeout(self._timeout):
                await self.store.settle(key, request.tenant, request.app, tokens, cost)
        except Exception as exc:  # noqa: BLE001 - the hold expires on its own (hold_ttl_s); the spend is lost
            self._failed("settle", exc)

    def release_soon(self, key: str) -> None:
        """Settle a request that spent nothing, from a path that cannot await (it is being cancelled)."""
        if key in self._open:
            self._spawn(self._release(key))

    async def _release(self, key: str) -> None:
        await self.settle(key, 0, 0.0)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._timeout * 2)
        await self.store.close()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _failed(self, operation: str, exc: BaseException) -> None:
        self.store_errors += 1
        if self.store_errors == 1 or self.store_errors % 1000 == 0:
            log.warning("shared budget store failed on %s (%d failures so far): %r", operation, self.store_errors, exc)
