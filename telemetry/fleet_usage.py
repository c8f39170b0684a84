"""Usage totals of every replica, kept in Redis/Valkey next to the budgets (`state.backend: redis`).

Each replica's SQLite ledger stays the audit record of the requests it served. With the redis
backend, metering also adds each request to hourly aggregates in the store, so that /v1/usage on
any replica answers for the whole fleet:

- `<prefix>{tenant}:usage:<hour>`: a hash per tenant and UTC hour (`hour` = unix seconds // 3600);
  each field is a JSON array `[app, model, lane, measure]`, its value a running total
  (HINCRBYFLOAT); the key expires `USAGE_TTL_S` after its last write;
- `<prefix>{tenant}:usage:hours`: a sorted set of the hours that tenant has data for;
- `<prefix>usage:tenants`: the set of tenants with any usage.

Writes are fire-and-forget: one background writer sends a pipeline of HINCRBYFLOATs off the
response path, bounded by the store's op timeout; requests metered while a pipeline is in flight
are added up locally and go out together in the next one (one per request when they come one at
a time, fewer under load). A request the shared budgets settle (its tenant or app has a limit)
carries its increments in that settlement's script instead (`tally`, one round trip for both;
the tenants set, in another slot, is then added by the writer once per tenant and hour). A
failure is counted (`errors`, in rows), never raised, and the ledger still has the row.
Queries read whole hours: a bucket is counted when its hour overlaps [from, to), so a range is
widened to the hours around it (the ledger counts to the second).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
from collections.abc import Coroutine
from typing import Any

import orjson
import redis.asyncio as aioredis

from policies.budget_store import Tally
from policies.redis_client import redis_client
from telemetry.ledger import LedgerRow
from telemetry.usage import MEASURES, UsageQuery

log = logging.getLogger(__name__)

HOUR_S = 3600
USAGE_TTL_S = 400 * 86400  # hourly buckets are kept this long after their last write (the ledger keeps rows for ever)
MAX_PENDING = 10_000  # distinct (tenant, hour, app, model, lane) waiting beyond this: rows dropped (and counted)
_PIPELINE_CHUNK = 500  # commands per round trip when reading

# Stored measures: what one ledger row adds to each (saved_usd is their sum of the saved_* ones).
STORED = tuple(name for name in MEASURES if name != "saved_usd")


def _amounts(row: LedgerRow) -> dict[str, float]:
    return {
        "requests": 1.0,
        "errors": 1.0 if row.status >= 400 else 0.0,
        "input_tokens": float(row.input_tokens),
        "output_tokens": float(row.output_tokens),
        "cached_input_tokens": float(row.cached_input_tokens),
        "trimmed_tokens": float(row.trimmed_tokens),
        "estimated_requests": 1.0 if row.estimated else 0.0,
        "cost_usd": row.cost,
        "saved_cache_usd": row.saved_cache,
        "saved_edge_usd": row.saved_edge,
        "saved_trim_usd": row.saved_trim,
    }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class FleetUsage:
    """Hourly usage aggregates of every replica in the shared store."""

    def __init__(self, client: aioredis.Redis, *, key_prefix: str = "tierlane:", op_timeout_s: float = 0.1,
                 query_timeout_s: float = 5.0) -> None:  # fmt: skip
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("state.key_prefix must not contain { or }: the tenant is the hash tag")
        self.client = client
        self._prefix = key_prefix
        self._timeout = op_timeout_s
        self._query_timeout = query_timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        # (tenant, hour) -> field -> amount not sent yet, and how many rows that is
        self._pending: dict[tuple[str, int], dict[str, float]] = {}
        self._pending_rows = 0
        self._groups = 0
        self._announce: set[str] = set()  # tenants to add to the tenants set (their usage went with a settlement)
        self._announced: dict[str, int] = {}  # tenant -> the hour it was last added in
        self._writer: asyncio.Task[None] | None = None
        self._failures = 0
        self.errors = 0  # rows that failed, timed out or were dropped
        self.query_errors = 0  # queries that failed (answered from the local ledger instead)

    @classmethod
    def connect(cls, url: str, *, key_prefix: str, connect_timeout_s: float, op_timeout_s: float) -> FleetUsage:
        """A client that connects lazily and reconnects on its own after the server comes back."""
        # a query reads many replies; each write has its own bound
        client = redis_client(url, connect_timeout_s=connect_timeout_s, read_timeout_s=max(op_timeout_s, 1.0))
        return cls(client, key_prefix=key_prefix, op_timeout_s=op_timeout_s)

    def _hour_key(self, tenant: str, hour: int) -> str:
        return f"{self._prefix}{{{tenant}}}:usage:{hour}"

    def _hours_key(self, tenant: str) -> str:
        return f"{self._prefix}{{{tenant}}}:usage:hours"

    @property
    def _tenants_key(self) -> str:
        return f"{self._prefix}usage:tenants"

    # Writes -----------------------------------------------------------------------------

    def tally(self, row: LedgerRow) -> Tally:
        """The increments of one row, for a budget settlement to add in its own round trip (see `added`)."""
        hour = int(row.ts // HOUR_S)
        group = orjson.dumps([row.app, row.model, row.lane]).decode()[:-1]
        fields = {f'{group},"{measure}"]': amount for measure, amount in _amounts(row).items() if amount}
        return Tally(self._hour_key(row.tenant, hour), self._hours_key(row.tenant), hour, hour - USAGE_TTL_S // HOUR_S,
                     USAGE_TTL_S, fields)  # fmt: skip

    def added(self, row: LedgerRow) -> None:
        """A settlement added this row's `tally`: what is left is the tenants set, once per tenant and hour."""
        hour = int(row.ts // HOUR_S)
        if self._announced.get(row.tenant) != hour:
            self._announced[row.tenant] = hour
            self._announce.add(row.tenant)
            if self._writer is None:
                self._writer = self._spawn(self._write())

    def lost(self, rows: int = 1) -> None:
        """A settlement carrying tallies failed: count them as failed writes."""
        self.errors += rows
        self._log(RuntimeError("the budget settlement carrying the usage failed"))

    def record(self, row: LedgerRow) -> None:
        """Add one metered request to the aggregates, in the background (never raises, never waits)."""
        if self._groups >= MAX_PENDING:
            self.errors += 1
            self._log(RuntimeError(f"{MAX_PENDING} usage groups already waiting for the store"))
            return
        fields = self._pending.setdefault((row.tenant, int(row.ts // HOUR_S)), {})
        group = orjson.dumps([row.app, row.model, row.lane]).decode()[:-1]  # '["app","model","lane"' + ',"measure"]'
        if group + ',"requests"]' not in fields:
            self._groups += 1
        for measure, amount in _amounts(row).items():
            if amount:
                name = f'{group},"{measure}"]'
                fields[name] = fields.get(name, 0.0) + amount
        self._pending_rows += 1
        if self._writer is None:
            self._writer = self._spawn(self._write())

    async def _write(self) -> None:
        try:
            while self._pending or self._announce:
                batch, rows, tenants = self._pending, self._pending_rows, self._announce
                self._pending, self._pending_rows, self._groups, self._announce = {}, 0, 0, set()
                try:
                    async with asyncio.timeout(self._timeout):
                        await self._send(batch, tenants)
                except Exception as exc:  # noqa: BLE001 - any store failure: counted; the ledgers have the rows
                    self.errors += rows
                    for tenant in tenants:  # try again with the tenant's next row
                        self._announced.pop(tenant, None)
                    self._log(exc)
        finally:
            self._writer = None

    async def _send(self, batch: dict[tuple[str, int], dict[str, float]], tenants: set[str]) -> None:
        """The increments of a batch (and the tenants to add to the tenants set) in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        if tenants:
            pipe.sadd(self._tenants_key, *sorted(tenants))
        for (tenant, hour), fields in batch.items():
            key, hours = self._hour_key(tenant, hour), self._hours_key(tenant)
            for name, amount in fields.items():
                pipe.hincrbyfloat(key, name, amount)
            pipe.expire(key, USAGE_TTL_S)
            pipe.zadd(hours, {str(hour): hour})
            pipe.zremrangebyscore(hours, "-inf", f"({hour - USAGE_TTL_S // HOUR_S}")
            pipe.expire(hours, USAGE_TTL_S)
            pipe.sadd(self._tenants_key, tenant)
        await pipe.execute()

    async def flush(self) -> None:
        """Wait until what was recorded has been sent (or failed: each round trip is bounded by the op timeout)."""
        while self._writer is not None:
            await asyncio.wait({self._writer})

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._timeout * 2)
        await self.client.aclose()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _log(self, exc: BaseException) -> None:
        self._failures += 1
        if self._failures == 1 or self._failures % 1000 == 0:
            log.warning("fleet usage write failed (%d rows lost so far): %r", self.errors, exc)

    # Reads ------------------------------------------------------------------------------

    async def query(self, query: UsageQuery) -> list[dict[str, Any]]:
        """The rows `telemetry.usage.run_query` would give over every replica's ledger, at hour granularity.

        Raises whatever the store raises (or TimeoutError): the caller falls back to the local ledger.
        """
        return await asyncio.wait_for(self._query(query), self._query_timeout)

    async def _query(self, query: UsageQuery) -> list[dict[str, Any]]:
        first, last = int(query.start // HOUR_S), math.ceil(query.end / HOUR_S) - 1
        tenant = query.filters.get("tenant")
        if tenant is not None:
            tenants = [tenant]
        else:
            tenants = sorted(_text(t) for t in await self.client.smembers(self._tenants_key))
        spans = await self._pipelined([("zrangebyscore", (self._hours_key(t), first, last)) for t in tenants])
        buckets = [(t, int(_text(h))) for t, hours in zip(tenants, spans) for h in hours]
        hashes = await self._pipelined([("hgetall", (self._hour_key(t, h),)) for t, h in buckets])
        wanted = {k: v for k, v in query.filters.items() if k != "tenant"}
        totals: dict[tuple[str, ...], dict[str, float]] = {}
        for (bucket_tenant, hour), fields in zip(buckets, hashes):
            day = _day(hour)
            for raw_field, raw_value in fields.items():
                app, model, lane, measure = orjson.loads(raw_field)
                labels = {"tenant": bucket_tenant, "app": app, "model": model, "lane": lane, "day": day}
                if any(labels[k] != v for k, v in wanted.items()) or measure not in STORED:
                    continue
                group = tuple(labels[k] for k in query.group_by)
                sums = totals.setdefault(group, dict.fromkeys(STORED, 0.0))
                sums[measure] += float(_text(raw_value))
        rows = []
        for group in sorted(totals):
            sums = totals[group]
            item: dict[str, Any] = dict(zip(query.group_by, group))
            for name in MEASURES:
                if name == "saved_usd":
                    item[name] = round(sums["saved_cache_usd"] + sums["saved_edge_usd"] + sums["saved_trim_usd"], 9)
                elif name.endswith("_usd"):
                    item[name] = round(sums[name], 9)
                else:
                    item[name] = int(round(sums[name]))
            if item["requests"]:
                rows.append(item)
        return rows

    async def _pipelined(self, commands: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        replies: list[Any] = []
        for i in range(0, len(commands), _PIPELINE_CHUNK):
            pipe = self.client.pipeline(transaction=False)
            for name, args in commands[i : i + _PIPELINE_CHUNK]:
                getattr(pipe, name)(*args)
            replies.extend(await pipe.execute())
        return replies


def _day(hour: int) -> str:
    return dt.datetime.fromtimestamp(hour * HOUR_S, dt.UTC).strftime("%Y-%m-%d")
