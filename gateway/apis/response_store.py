"""Stored responses of the Responses API, in the state backend: SQLite under state_dir, or Redis/Valkey.

A record is one response with the items it answered (`input`) and a link to the response it
continued (`previous`): `previous_response_id` rebuilds a conversation by following the links
(bounded in turns, bytes and items), so a chain stores each turn once. Records written before
links carry the conversation before them (`context`) instead, and are still read. Records are
keyed by tenant and id, so another tenant's id is simply not found, and expire after
`responses.ttl_s`. Each tenant's records and bytes are counted for its quota
(`responses.max_records_per_tenant`, `max_bytes_per_tenant`): a request that would store past
it is refused (429 insufficient_quota) before any work; nothing is evicted to make room.

SQLite writes are written behind (batched, on one worker thread) and read back from memory
until committed, so no answer waits on the disk; a process killed within those milliseconds
loses those records. Redis writes are awaited: another replica may be asked for them next.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.settings import Settings

log = logging.getLogger(__name__)

Record = dict[str, Any]
_SWEEP_EVERY = 256  # writes between two deletions of expired rows (SQLite)


class StoreFailed(GatewayError):
    status = 503
    type = "server_error"
    code = "response_store_unavailable"


class QuotaExceeded(GatewayError):
    """A tenant's stored responses are at its quota: a request that would store one more is refused."""

    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"


@dataclass(slots=True)
class Usage:
    """What one tenant's stored responses hold."""

    records: int = 0
    bytes: int = 0


class ResponseStore(Protocol):
    """Where stored responses live; every method is scoped to one tenant."""

    async def put(self, tenant: str, response_id: str, record: Record) -> None: ...

    async def get(self, tenant: str, response_id: str) -> Record | None: ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def usage(self, tenant: str) -> Usage: ...

    async def close(self) -> None: ...


class SqliteResponseStore:
    """One SQLite file (WAL); the connection lives on one worker thread, never on the event loop."""

    def __init__(self, path: Path, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        # NOTE: a single worker thread owns the connection, so it is never used concurrently.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierlane-responses")
        self._path = path
        self._db: sqlite3.Connection | None = None
        self._writes = 0
        # NOTE: writes wait here (touched on the event loop only) and are committed in batches on
        # the worker thread: (tenant, id) -> (expires, record).
        self._pending: dict[tuple[str, str], tuple[float, bytes]] = {}
        self._flushing: asyncio.Future[None] | None = None
        # per tenant: what its records hold (touched on the event loop only; counted again from the
        # file at start and after each sweep of expired rows, so expiry makes room)
        self._usage: dict[str, Usage] = {}

    async def start(self) -> None:
        await self._run(self._open)
        self._usage = await self._run(self._count_usage)

    def _count_usage(self) -> dict[str, Usage]:
        rows = self._conn().execute(
            "SELECT tenant, COUNT(*), SUM(LENGTH(record)) FROM responses WHERE expires >= ? GROUP BY tenant", (time.time(),))
        return {tenant: Usage(int(n), int(size or 0)) for tenant, n, size in rows}

    async def usage(self, tenant: str) -> Usage:
        return self._usage.get(tenant) or Usage()

    def _open(self) -> None:
        self._db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS responses (tenant TEXT NOT NULL, id TEXT NOT NULL, expires REAL NOT NULL, "
            "record BLOB NOT NULL, PRIMARY KEY (tenant, id))"
        )
        self._db.execute("CREATE INDEX IF NOT EXISTS responses_expires ON responses (expires)")

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreFailed("the response store is closed")
        return self._db

    async def put(self, tenant: str, response_id: str, record: Record) -> None:
        """Kept at once for this replica's reads; written behind, many responses to one commit.

        The caller never waits on the disk: a stored response is read back from `_pending` until
        its commit, so the next turn of a conversation finds it however soon it comes.
        """
        blob = orjson.dumps(record)
        self._pending[(tenant, response_id)] = (time.time() + self.ttl_s, blob)
        used = self._usage.setdefault(tenant, Usage())
        used.records += 1
        used.bytes += len(blob)
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, {}
                # NOTE: reads and deletes run on the same single worker thread after this write,
                # so a response taken out of `_pending` here is never missed by them.
                rows = [(tenant, rid, expires, blob) for (tenant, rid), (expires, blob) in batch.items()]
                try:
                    recounted = await self._run(self._put_many, rows)
                except Exception:  # the answers are already out: the loss is logged
                    log.exception("could not store %d responses", len(rows))
                    recounted = None
                if recounted is not None:  # expired rows were swept: count again (pending ones on top)
                    for (tenant, _), (_, blob) in self._pending.items():
                        used = recounted.setdefault(tenant, Usage())
                        used.records += 1
                        used.bytes += len(blob)
                    self._usage = recounted
        finally:
            self._flushing = None

    def _put_many(self, rows: list[tuple[str, str, float, bytes]]) -> dict[str, Usage] | None:
        """Commit `rows`; every _SWEEP_EVERY writes also delete the expired ones and return the usage counted again."""
        now = time.time()
        db = self._conn()
        with db:
            db.execute("BEGIN")
            db.executemany("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)", rows)
        before = self._writes
        self._writes += len(rows)
        if self._writes // _SWEEP_EVERY != before // _SWEEP_EVERY:
            db.execute("DELETE FROM responses WHERE expires < ?", (now,))
            return self._count_usage()
        return None

    async def get(self, tenant: str, response_id: str) -> Record | None:
        pending = self._pending.get((tenant, response_id))
        if pending is not None:
            expires, blob = pending
            return orjson.loads(blob) if expires >= time.time() else None
        stored = await self._run(self._get, tenant, response_id)
        return None if stored is None else orjson.loads(stored)

    def _get(self, tenant: str, response_id: str) -> bytes | None:
        row = self._conn().execute(
            "SELECT record FROM responses WHERE tenant = ? AND id = ? AND expires >= ?", (tenant, response_id, time.time())
        ).fetchone()
        return None if row is None else bytes(row[0])

    async def delete(self, tenant: str, response_id: str) -> bool:
        pending = self._pending.pop((tenant, response_id), None)
        size = await self._run(self._delete, tenant, response_id)
        if pending is not None:
            size = len(pending[1])
        used = self._usage.get(tenant)
        if size is not None and used is not None:
            used.records = max(0, used.records - 1)
            used.bytes = max(0, used.bytes - size)
        return size is not None and (pending is None or pending[0] >= time.time())

    def _delete(self, tenant: str, response_id: str) -> int | None:
        """The deleted record's size, or None when there was none (expired counts as none)."""
        db = self._conn()
        row = db.execute("SELECT LENGTH(record), expires FROM responses WHERE tenant = ? AND id = ?",
                         (tenant, response_id)).fetchone()
        if row is None:
            return None
        db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
        return int(row[0]) if row[1] >= time.time() else None

    async def close(self) -> None:
        if self._flushing is not None:
            await self._flushing

        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await self._run(shut)
        self._executor.shutdown(wait=True)


# Per tenant, beside each record: an index of its ids by expiry (ms), their sizes, and their total;
# one hash tag (the tenant), so a cluster keeps them on one node. Expired ids leave the books at
# the tenant's next write or usage read (256 at a time), so expiry makes room.
_SWEEP = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 256)
for _, id in ipairs(expired) do
  local size = redis.call('HGET', KEYS[2], id)
  if size then redis.call('DECRBY', KEYS[3], size) end
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
end
"""
_PUT = _SWEEP + """
local old = redis.call('HGET', KEYS[2], ARGV[2])
if old then redis.call('DECRBY', KEYS[3], old) end
local size = string.len(ARGV[3])
redis.call('SET', KEYS[4], ARGV[3], 'PX', ARGV[4])
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[4]), ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], size)
redis.call('INCRBY', KEYS[3], size)
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
return 1
"""
_USAGE = _SWEEP + """
return {redis.call('ZCARD', KEYS[1]), tonumber(redis.call('GET', KEYS[3]) or '0')}
"""
_DELETE = _SWEEP + """
local n = redis.call('DEL', KEYS[4])
local size = redis.call('HGET', KEYS[2], ARGV[2])
if size then
  redis.call('DECRBY', KEYS[3], size)
  redis.call('HDEL', KEYS[2], ARGV[2])
  redis.call('ZREM', KEYS[1], ARGV[2])
end
return n
"""


class RedisResponseStore:
    """`<prefix>{<tenant>}:resp:<id>` strings with a TTL, in the store every replica shares, and per
    tenant the books its quota reads (`resp-index`, `resp-sizes`, `resp-bytes`), kept by Lua scripts."""

    def __init__(self, client: Any, prefix: str, ttl_s: float, op_timeout_s: float) -> None:
        self._client = client
        self._prefix = prefix
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._timeout = op_timeout_s
        self._put = client.register_script(_PUT)
        self._usage = client.register_script(_USAGE)
        self._delete = client.register_script(_DELETE)

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{self._prefix}{{{tenant}}}:resp:{response_id}"

    def _keys(self, tenant: str, response_id: str | None = None) -> list[str]:
        """The tenant's books (index, sizes, total) and, given an id, that record's key."""
        base = f"{self._prefix}{{{tenant}}}:"
        books = [base + "resp-index", base + "resp-sizes", base + "resp-bytes"]
        return books if response_id is None else [*books, self._key(tenant, response_id)]

    async def _call(self, coro: Any) -> Any:
        try:
            return await asyncio.wait_for(coro, self._timeout)
        except (TimeoutError, OSError, ConnectionError) as exc:
            raise StoreFailed(f"the response store did not answer: {type(exc).__name__}", retry_after=1) from None
        except Exception as exc:  # noqa: BLE001 - redis-py's own errors; the caller gets a 503, never a 500
            raise StoreFailed(f"the response store failed: {type(exc).__name__}", retry_after=1) from None

    async def put(self, tenant: str, response_id: str, record: Record) -> None:
        now = int(time.time() * 1000)
        await self._call(self._put(keys=self._keys(tenant, response_id),
                                   args=[now, response_id, orjson.dumps(record), self.ttl_ms]))

    async def get(self, tenant: str, response_id: str) -> Record | None:
        blob = await self._call(self._client.get(self._key(tenant, response_id)))
        return None if blob is None else orjson.loads(blob)

    async def delete(self, tenant: str, response_id: str) -> bool:
        now = int(time.time() * 1000)
        return bool(await self._call(self._delete(keys=self._keys(tenant, response_id), args=[now, response_id])))

    async def usage(self, tenant: str) -> Usage:
        records, size = await self._call(self._usage(keys=self._keys(tenant), args=[int(time.time() * 1000)]))
        return Usage(int(records), int(size))

    async def close(self) -> None:
        await self._client.aclose()


async def open_store(settings: Settings) -> ResponseStore:
    """The store `settings.state` names (the same backend budgets and the cache use)."""
    ttl = settings.responses.ttl_s
    state = settings.state
    if state.backend == "redis":
        from policies.redis_client import redis_client  # redis is imported only when configured

        # a stored response can be large: reads get more time than a budget check
        timeout = max(state.op_timeout_ms / 1000.0, 1.0)
        client = redis_client(state.url, connect_timeout_s=state.connect_timeout_ms / 1000.0, read_timeout_s=timeout)
        return RedisResponseStore(client, state.key_prefix, ttl, timeout)
    store = SqliteResponseStore(settings.state_dir / "responses.sqlite3", ttl)
    await store.start()
    return store
