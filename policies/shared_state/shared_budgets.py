"""Budgets in a shared store, with a bounded wait on it and a fallback when it fails.

No request waits on the store longer than `op_timeout_s`. When the store fails (unreachable,
an error, or slower than that), `on_outage` decides:

- `local_share` (the default): this replica admits against its share of what the store last
  said was left (that remainder divided by the replicas alive, plus its share of the rate
  limits' refill; policies/shared_state/outage_share.py), so the fleet admits about the limit in all;
- `allow`: this replica admits against its own in-process `Budgets` (`fallback: local`, each
  replica enforcing the whole limits alone) or without any check (`fallback: none`);
- `deny`: nothing is admitted (StoreUnavailable, a 503 with Retry-After).

What a replica admitted alone is added to the store once it answers again (`reconcile`), and
every replica beats every `heartbeat_s` (replicas alive, for the share; a store that lost its
data, such as a restart without persistence, is detected by its epoch marker and logged). The
client reconnects on its own, so the next request uses the store again once it is back.

Streams are charged in batches: `charge_chunk` runs on every streamed chunk and must not cost a
round trip each, so tokens are accumulated and sent every `batch_tokens` tokens or `batch_s`
seconds, in a background task (one at a time per request); the breach it finds ends the stream
at the next chunk. A stream can so pass a limit by at most one batch more than in-process.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from policies.budgets import OPEN_SWEEP_AT, OPEN_TTL_S, Budgets, Limits
from policies.errors import LimitExceeded, StoreUnavailable
from policies.shared_state.budget_store import BudgetStore
from policies.shared_state.outage_share import OutageShare
from policies.task_stop import cancel_and_wait

OutageMode = Literal["deny", "local_share", "allow"]
OWED_MAX = 100_000  # outage requests kept to count in the store later; past it they are counted in owed_dropped
RECONCILE_BATCH = 200  # sent together (one multiplexed connection) per beat round

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    """A request the store admitted: where it is counted and its stream's unsent charges."""

    tenant: str
    app: str
    local: bool  # admitted by the in-process fallback while the store failed
    reserved_usd: float = 0.0
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
        on_outage: OutageMode = "local_share",
        fallback: Literal["local", "none"] = "local",
        batch_tokens: int = 32,
        batch_s: float = 0.25,
        heartbeat_s: float = 5.0,
    ) -> None:
        self.budgets = budgets
        self.store = store
        self._timeout = op_timeout_s
        self._mode = on_outage
        self._local_fallback = fallback == "local"
        self._batch_tokens = batch_tokens
        self._batch_s = batch_s
        self._heartbeat_s = heartbeat_s
        self._open: dict[str, _Request] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._share = OutageShare()
        self._replica = uuid.uuid4().hex[:16]
        self._epoch = uuid.uuid4().hex  # set in the store when its marker is missing
        self._seen_epoch: str | None = None
        # requests admitted alone during an outage, to count in the store once it is back: (key, tenant, app, tokens, USD)
        self._owed: list[tuple[str, str, str, int, float]] = []
        self.owed_dropped = 0  # past OWED_MAX: never counted in the store
        self._beats: asyncio.Task[None] | None = None
        self._closed = False
        self.replicas = 1  # alive, by the last heartbeat
        self.store_errors = 0  # operations the store failed (all kinds)
        self.fallback_admissions = 0  # requests admitted without the store
        self.store_resets = 0  # times the store was found to have lost its data

    def in_flight(self) -> int:
        return len(self._open)

    @property
    def owed(self) -> int:
        """Requests admitted alone during an outage that the store has not counted yet."""
        return len(self._owed)

    async def admit(self, key: str, tenant: str, app: str, tokens: int, reserve_usd: float) -> None:
        """Raises LimitExceeded / BudgetExceeded from the store (or from this replica's share while it is
        unreachable), or StoreUnavailable when it fails and on_outage is deny."""
        tenant_limits, app_limits = self.budgets.limits(tenant, app)
        if tenant_limits.unlimited and app_limits.unlimited:
            return
        if self._beats is None and not self._closed:
            self._beats = asyncio.ensure_future(self._beat_loop())
        try:
            async with asyncio.timeout(self._timeout):  # no task per call, unlike wait_for on 3.11
                left = await self.store.admit(key, tenant, app, tokens, reserve_usd)
        except LimitExceeded:
            raise
        except Exception as exc:  # noqa: BLE001 - any store failure (connection, timeout, script) takes the fallback
            self._failed("admit", exc)
            if self._mode == "deny":
                # A timeout may come after the script ran: release what it may hold, when the store answers.
                self._spawn(self._forget(key, tenant, app))
                raise StoreUnavailable(
                    "the shared budget store is unavailable; try again shortly", retry_after=1.0
                ) from None
            if self._mode == "local_share":
                self._share.admit(self._scopes(tenant, app), tokens, reserve_usd, self.replicas, time.time())
            elif self._local_fallback:
                self.budgets.admit(key, tenant, app, tokens, reserve_usd)  # may raise: this replica's own limits
            self.fallback_admissions += 1
            self._track(key, _Request(tenant, app, local=True, reserved_usd=reserve_usd))
            return
        now = time.time()
        for scope, values in zip(self.store.scope_keys(tenant, app), left):
            self._share.learn(scope, values, now)
        self._track(key, _Request(tenant, app, local=False, reserved_usd=reserve_usd))

    def _scopes(self, tenant: str, app: str) -> list[tuple[str, str, Limits]]:
        """(key, name, limits) of the caller's limited scopes, keyed as the store's `scope_keys`."""
        tenant_limits, app_limits = self.budgets.limits(tenant, app)
        scopes = [(tenant, f"tenant {tenant!r}", tenant_limits), (f"{tenant}/{app}", f"app {app!r} of tenant {tenant!r}", app_limits)]
        return [scope for scope in scopes if not scope[2].unlimited]

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
            # NOTE: a stream admitted during an outage is counted at its end (settle), by its share
            use_local = self._mode == "allow" and self._local_fallback
            return self.budgets.stream_breach(key, tokens, cost) if use_local else None
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
            if self._mode == "local_share":
                self._share.settle([k for k, _, _ in self._scopes(request.tenant, request.app)], request.reserved_usd, cost,
                                   time.time())
            elif self._local_fallback:
                self.budgets.settle(key, tokens, cost)
            # NOTE: counted in the store once it answers (beat), by this key: an admission that timed out here but
            # ran there late is settled, one that never arrived is added; its hold is released either way
            if len(self._owed) < OWED_MAX:
                self._owed.append((key, request.tenant, request.app, tokens, max(0.0, cost)))
            else:
                self.owed_dropped += 1
            return
        if request.flush is not None:
            await asyncio.wait({request.flush})
        # what is known to be left shrinks by what the request cost beyond its reservation
        self._share.spent(self.store.scope_keys(request.tenant, request.app), cost - request.reserved_usd)
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

    async def _beat_loop(self) -> None:
        while not self._closed:
            try:
                await self.beat()
            except Exception as exc:  # noqa: BLE001 - the next beat tries again; requests never wait on it
                self._failed("heartbeat", exc)
            await asyncio.sleep(self._heartbeat_s)

    async def beat(self) -> None:
        """One heartbeat: count the replicas alive, check the store kept its data, send what is owed."""
        async with asyncio.timeout(self._timeout):
            replicas, epoch = await self.store.heartbeat(self._replica, 3 * self._heartbeat_s, self._epoch)
        self.replicas = max(1, replicas)
        lost = self._seen_epoch is not None and epoch != self._seen_epoch  # gone ('': this beat set it anew) or replaced
        if epoch == "":
            epoch = self._epoch
        if lost:
            self.store_resets += 1
            log.warning(
                "the shared budget store lost its data (a restart without persistence, or a flush): rate limits, "
                "spend and holds counted before are gone; counting starts over"
            )
        self._seen_epoch = epoch
        while self._owed:
            batch = self._owed[:RECONCILE_BATCH]
            async with asyncio.timeout(self._timeout * 10):
                # NOTE: a call that timed out after the store ran it is sent again: a no-op there (reconcile.lua)
                await asyncio.gather(*(self.store.reconcile(*owed) for owed in batch))
            del self._owed[: len(batch)]

    async def close(self) -> None:
        self._closed = True
        if self._beats is not None:
            await cancel_and_wait(self._beats)
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
