"""Usage totals of every replica, kept in Redis/Valkey next to the budgets (`state.backend: redis`).

Each replica's SQLite ledger stays the audit record of the requests it served. With the redis
backend, metering also adds each request to hourly aggregates in the store, so that /v1/usage on
any replica answers for the whole fleet:

- `<prefix>{tenant}:usage:<hour>`: a hash per tenant and UTC hour (`hour` = unix seconds // 3600);
  each field is a JSON array `[app, model, lane, measure]`, its value a running total
  (HINCRBYFLOAT); the key expires `USAGE_TTL_S` after its last write;
- `<prefix>{tenant}:usage:hours`: a sorted set of the hours that tenant has data for;
- `<prefix>{tenant}:usage:seq:<replica>`: the last batch of that replica that was added (see
  below), expiring `SEQ_TTL_S` after it, so a replica that stopped leaves nothing behind;
- `<prefix>usage:tenants`: the set of tenants with any usage.

Writes go off the response path: one background writer sends a batch (one script per tenant,
over the multiplexed connection of policies/shared_state/redis_mux.py) `_LINGER_S` after its first row;
requests metered meanwhile, or while a batch is in flight, are added up locally and go out
together.

Exactly once, through outages: every batch carries this replica's id and a sequence number, and
the script adds a tenant's part only if that number is above the last one it added for this
replica. A batch that failed or timed out is sent again, the same batch with the same number,
before anything recorded after it (with a backoff of up to `_MAX_BACKOFF_S` while the store is
down), so a write that did reach the store before its timeout is not added twice, and one that
did not is added when the store is back. While a batch waits, new rows are added up in memory up
to `MAX_PENDING` groups; beyond that, and for whatever is still unsent when the replica stops,
rows are dropped and counted (`dropped`; the ledger still has them). A store that restarts empty
keeps what was sent after it came back.

Queries read whole hours: a bucket is counted when its hour overlaps [from, to), so a range is
widened to the hours around it (the ledger counts to the second).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import secrets
from dataclasses import dataclass
from typing import Any

import orjson
from redis.exceptions import ResponseError

from policies.shared_state.redis_mux import MuxClient
from policies.task_stop import cancel_and_wait
from telemetry.ledger import LedgerRow
from telemetry.usage import JUDGE, MEASURES, UsageQuery

log = logging.getLogger(__name__)

HOUR_S = 3600
USAGE_TTL_S = 400 * 86400  # hourly buckets are kept this long after their last write (as the ledger's hourly rollups by default)
MAX_PENDING = 10_000  # distinct (tenant, hour, app, model, lane) waiting beyond this: rows dropped (and counted)
SEQ_TTL_S = 7 * 86400  # how long a replica's last batch number is kept after its last write
_MIN_BACKOFF_S, _MAX_BACKOFF_S = 0.1, 2.0  # between attempts to send a batch the store did not take
# NOTE: a batch is taken this long after its first row: rows of the requests finishing meanwhile
# share its script (about 18 commands a script inside the store, 60 us of its CPU). Without it,
# under load most batches held one row. The totals lag by this much; no request waits on it.
_LINGER_S = 0.05
_READ_CHUNK = 500  # commands in flight at once when reading

# KEYS: this replica's seq key for the tenant, its hours index, then one hash per hour. ARGV: batch
# number, ttl (s), seq ttl (s), oldest hour kept, then per hour (in KEYS order): the hour, how
# many fields, then field, amount pairs. Returns 1 when added, 0 when this batch was added before.
_ADD_LUA = """
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) <= last then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
local at = 5
for k = 3, #KEYS do
  local hour, n = ARGV[at], tonumber(ARGV[at + 1])
  at = at + 2
  for _ = 1, n do
    redis.call('HINCRBYFLOAT', KEYS[k], ARGV[at], ARGV[at + 1])
    at = at + 2
  end
  redis.call('EXPIRE', KEYS[k], ARGV[2])
  redis.call('ZADD', KEYS[2], hour, hour)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""

# Stored measures: what one ledger row adds to each (saved_usd is their sum of the saved_* ones).
STORED = tuple(name for name in MEASURES if name != "saved_usd")


def _amounts(row: LedgerRow) -> dict[str, float]:
    if row.operation == JUDGE:  # a shadow re-ask: judging spend, not a request (telemetry/usage.py)
        return {
            "judge_requests": 1.0,
            "judge_input_tokens": float(row.input_tokens),
            "judge_output_tokens": float(row.output_tokens),
            "judge_cost_usd": row.cost,
        }
    return {
        "requests": 1.0,
        "errors": 1.0 if row.status >= 400 else 0.0,
        "input_tokens": float(row.input_tokens),
        "output_tokens": float(row.output_tokens),
        "cached_input_tokens": float(row.cached_input_tokens),
        "cache_write_tokens": float(row.cache_write_tokens),
        "trimmed_tokens": float(row.trimmed_tokens),
        "estimated_requests": 1.0 if row.estimated else 0.0,
        "cost_usd": row.cost,
        "saved_cache_usd": row.saved_cache,
        "saved_edge_usd": row.saved_edge,
        "saved_trim_usd": row.saved_trim,
        "saved_vs_strong_usd": row.saved_vs_strong if row.saved_vs_strong is not None else row.saved_cache + row.saved_edge + row.saved_trim,
        "saved_vs_named_usd": row.saved_vs_named if row.saved_vs_named is not None else row.saved_cache + row.saved_edge + row.saved_trim,
    }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(slots=True)
class _Batch:
    """Rows added up for the store, under one batch number (sent again as they are until taken)."""

    seq: int
    groups: dict[tuple[str, int], dict[str, float]]  # (tenant, hour) -> field -> amount
    rows: int


class FleetUsage:
    """Hourly usage aggregates of every replica in the shared store."""

    def __init__(self, client: MuxClient, *, key_prefix: str = "tierlane:", op_timeout_s: float = 0.1,
                 query_timeout_s: float = 5.0) -> None:  # fmt: skip
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("state.key_prefix must not contain { or }: the tenant is the hash tag")
        self.client = client
        self._add = client.script(_ADD_LUA)
        self._prefix = key_prefix
        self._timeout = op_timeout_s
        # NOTE: no request waits on these writes, and a batch after an outage may be large: a bound
        # as short as a request's would time out on every attempt while the store applies it.
        self._write_timeout = max(1.0, 10 * op_timeout_s)
        self._query_timeout = query_timeout_s
        self._replica = secrets.token_hex(8)  # this process: batch numbers count per replica
        self._seq = 0
        self._pending: dict[tuple[str, int], dict[str, float]] = {}  # not in a batch yet
        self._pending_rows = 0
        self._groups = 0
        self._unsent: _Batch | None = None  # the batch being sent (again, after a failure)
        self._writer: asyncio.Task[None] | None = None
        self._backing_off = False
        self._failures = 0
        self.errors = 0  # attempts to send a batch that failed or timed out (each batch is sent again)
        self.dropped = 0  # rows never sent: too many waiting, or still unsent when the replica stopped
        self.sent = 0  # rows the store took
        self.query_errors = 0  # queries that failed (answered from the local ledger instead)

    @classmethod
    def connect(cls, url: str, *, key_prefix: str, connect_timeout_s: float, op_timeout_s: float) -> FleetUsage:
        """A client that connects lazily and reconnects on its own after the server comes back."""
        client = MuxClient(url, connect_timeout_s=connect_timeout_s, stale_after_s=max(5.0, 10 * op_timeout_s))
        return cls(client, key_prefix=key_prefix, op_timeout_s=op_timeout_s)

    def _hour_key(self, tenant: str, hour: int) -> str:
        return f"{self._prefix}{{{tenant}}}:usage:{hour}"

    def _hours_key(self, tenant: str) -> str:
        return f"{self._prefix}{{{tenant}}}:usage:hours"

    def _seq_key(self, tenant: str) -> str:
        return f"{self._prefix}{{{tenant}}}:usage:seq:{self._replica}"

    @property
    def _tenants_key(self) -> str:
        return f"{self._prefix}usage:tenants"

    # Writes -----------------------------------------------------------------------------

    def record(self, row: LedgerRow) -> None:
        """Add one metered request to the aggregates, in the background (never raises, never waits)."""
        bucket = (row.tenant, int(row.ts // HOUR_S))
        group = orjson.dumps([row.app, row.model, row.lane]).decode()[:-1]  # '["app","model","lane"' + ',"measure"]'
        fields = self._pending.get(bucket)
        marker = group + (',"judge_requests"]' if row.operation == JUDGE else ',"requests"]')
        if fields is None or marker not in fields:  # a new group: the only thing that takes memory
            if self._groups >= MAX_PENDING:
                self.dropped += 1
                self._log(RuntimeError(f"{MAX_PENDING} usage groups already waiting for the store"))
                return
            self._groups += 1
            fields = self._pending.setdefault(bucket, {})
        for measure, amount in _amounts(row).items():
            if amount and math.isfinite(amount):  # the store refuses nan and inf (and would refuse the whole batch)
                name = f'{group},"{measure}"]'
                fields[name] = fields.get(name, 0.0) + amount
        self._pending_rows += 1
        if self._writer is None:
            self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        backoff = 0.0
        try:
            while self._unsent is not None or self._pending:
                if self._unsent is None:
                    await asyncio.sleep(_LINGER_S)
                    self._seq += 1
                    self._unsent = _Batch(self._seq, self._pending, self._pending_rows)
                    self._pending, self._pending_rows, self._groups = {}, 0, 0
                batch = self._unsent
                try:
                    async with asyncio.timeout(self._write_timeout):
                        await self._send(batch)
                except ResponseError as exc:  # the store refused it (not a failure to reach it): sending again cannot help
                    self.dropped += batch.rows
                    self._unsent = None
                    log.error("fleet usage: the store refused a batch of %d rows, dropped (the ledgers have them): %s",
                              batch.rows, exc)  # fmt: skip
                    continue
                except Exception as exc:  # noqa: BLE001 - any store failure: the same batch goes again, after a pause
                    self.errors += 1
                    self._log(exc)
                    backoff = min(_MAX_BACKOFF_S, max(_MIN_BACKOFF_S, backoff * 2))
                    self._backing_off = True
                    await asyncio.sleep(backoff)  # rows recorded meanwhile wait in _pending
                    self._backing_off = False
                    continue
                backoff = 0.0
                self._unsent = None
                self.sent += batch.rows
        finally:
            self._writer = None
            self._backing_off = False

    async def _send(self, batch: _Batch) -> None:
        """One script per tenant (each in its tenant's slot) and the tenants set, all in flight at once."""
        by_tenant: dict[str, list[int]] = {}
        for tenant, hour in batch.groups:
            by_tenant.setdefault(tenant, []).append(hour)
        # the tenants set with every batch: a store that restarted empty learns them again
        calls = [self.client.call("SADD", self._tenants_key, *sorted(by_tenant))]
        for tenant, hours in by_tenant.items():
            keys = [self._seq_key(tenant), self._hours_key(tenant)] + [self._hour_key(tenant, h) for h in hours]
            args: list[Any] = [batch.seq, USAGE_TTL_S, SEQ_TTL_S, min(hours) - USAGE_TTL_S // HOUR_S]
            for hour in hours:
                fields = batch.groups[(tenant, hour)]
                args += [hour, len(fields)]
                for name, amount in fields.items():
                    args += [name, repr(amount)]
            calls.append(self._add(keys=keys, args=args))
        await asyncio.gather(*calls)

    async def flush(self) -> None:
        """Wait until what was recorded has been sent, or an attempt to send it failed (it goes again later)."""
        while self._writer is not None and not self._backing_off:
            await asyncio.wait({self._writer}, timeout=0.05)

    async def close(self) -> None:
        """Send what waits (bounded by twice the op timeout); what the store did not take is counted as dropped."""
        writer = self._writer
        if writer is not None:
            await asyncio.wait({writer}, timeout=_LINGER_S + self._write_timeout)
            await cancel_and_wait(writer)
        lost = self._pending_rows + (self._unsent.rows if self._unsent is not None else 0)
        if lost:
            self.dropped += lost
            log.warning("fleet usage: %d rows not sent to the store before stopping (the ledger has them)", lost)
        self._pending, self._pending_rows, self._groups, self._unsent = {}, 0, 0, None
        await self.client.close()

    def _log(self, exc: BaseException) -> None:
        self._failures += 1
        if self._failures == 1 or self._failures % 1000 == 0:
            log.warning("fleet usage write failed (%d attempts so far; the batch is sent again): %r", self._failures, exc)

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
            tenants = sorted(_text(t) for t in await self.client.call("SMEMBERS", self._tenants_key))
        spans = await self._calls([("ZRANGEBYSCORE", self._hours_key(t), first, last) for t in tenants])
        buckets = [(t, int(_text(h))) for t, hours in zip(tenants, spans) for h in hours]
        flat = await self._calls([("HGETALL", self._hour_key(t, h)) for t, h in buckets])
        hashes = [dict(zip(reply[::2], reply[1::2])) for reply in flat]
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
            if item["requests"] or item["judge_requests"]:
                rows.append(item)
        return rows

    async def _calls(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        replies: list[Any] = []
        for i in range(0, len(commands), _READ_CHUNK):
            replies.extend(await asyncio.gather(*(self.client.call(*c) for c in commands[i : i + _READ_CHUNK])))
        return replies


def _day(hour: int) -> str:
    return dt.datetime.fromtimestamp(hour * HOUR_S, dt.UTC).strftime("%Y-%m-%d")
