"""Stored responses of the Responses API, in the state backend: SQLite under state_dir, or Redis/Valkey.

A record is one response with the items it answered (`input`) and a link to the response it
continued (`previous`): `previous_response_id` rebuilds a conversation by following the links
(bounded in turns, bytes and items), so a chain stores each turn once. Records written before
links carry the conversation before them (`context`) instead, and are still read. Records are
keyed by tenant and id, so another tenant's id is simply not found, and expire after
`responses.ttl_s`. Each tenant's records and bytes are counted for its quota
(`responses.max_records_per_tenant`, `max_bytes_per_tenant`): a request that would store past
it is refused (429 insufficient_quota) before any work; nothing is evicted to make room.

Admission reserves: a request with `store` takes a reservation (its body's size and a bound for
its answer, `responses.reserve_output_bytes`) at once, with no await between the check and the
taking, and the check counts what is stored plus what every admitted request still holds; so 64
concurrent requests cannot all pass an empty quota. The reservation is settled when the record
is stored (the record's real size is counted instead) and released when the request fails, is
refused or its client goes away. A request is refused once stored plus reserved is at the quota,
so the quota is passed by at most the last admitted request (and by an answer larger than its
bound). Reservations are held by this process: replicas sharing a Redis store each hold their own.

SQLite keeps a record's input items once per tenant and content (`inputs`, keyed by tenant and
the SHA-256 of the items' JSON; never shared across tenants): a record names its input by
digest. A tenant's bytes count each distinct input once (however many records name it) beside
its records without their input; an input is deleted when no record names it any more (at
DELETE, and at each sweep of expired rows). All tenants together are held to
`responses.max_bytes_total` (507 response_store_full past it, checked like the quota).

SQLite writes are written behind (batched, on one worker thread) and read back from memory
until committed, so no answer waits on the disk; a process killed within those milliseconds
loses those records. Redis writes are awaited: another replica may be asked for them next.
"""

from __future__ import annotations

import asyncio
import hashlib
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


class StoreFull(GatewayError):
    """The gateway's stored responses are at its ceiling (`responses.max_bytes_total`), all tenants together."""

    status = 507
    type = "server_error"
    code = "response_store_full"


@dataclass(slots=True)
class Usage:
    """What one tenant's stored responses hold."""

    records: int = 0
    bytes: int = 0


@dataclass(slots=True, frozen=True)
class Limits:
    """What admission holds a request with `store` to."""

    records: int  # per tenant
    bytes: int  # per tenant
    total_bytes: int | None = None  # all tenants together (where the store counts them); None: no ceiling


@dataclass(slots=True, eq=False)
class Reservation:
    """Room one admitted request holds until its record is stored (settled) or it fails (released)."""

    tenant: str
    bytes: int
    held: bool = True


class _Admission:
    """Reservations of admitted requests, per tenant; touched on the event loop only."""

    def __init__(self) -> None:
        self._held: dict[str, Usage] = {}
        self._held_bytes = 0

    async def usage(self, tenant: str) -> Usage:
        raise NotImplementedError

    def _stored_total(self) -> int | None:
        """Bytes stored for all tenants together, or None where this store does not count them."""
        return None

    async def reserve(self, tenant: str, size: int, limits: Limits) -> Reservation:
        """Admit a request that will store about `size` bytes, or refuse it (QuotaExceeded, StoreFull).

        The check and the taking run with no await between them, after the usage is read, so
        concurrent requests each see the others' reservations."""
        used = await self.usage(tenant)
        held = self._held.get(tenant) or Usage()
        records, nbytes = used.records + held.records, used.bytes + held.bytes
        if records >= limits.records or nbytes >= limits.bytes:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {used.records} stored responses ({used.bytes} bytes) and {held.records} "
                f"being answered ({held.bytes} bytes reserved), its quota (responses.max_records_per_tenant "
                f"{limits.records}, max_bytes_per_tenant {limits.bytes}); send store: false, or DELETE responses "
                "no longer needed", param="store")
        total = self._stored_total()
        if limits.total_bytes is not None and total is not None and total + self._held_bytes >= limits.total_bytes:
            raise StoreFull(
                f"the gateway's stored responses hold {total} bytes and {self._held_bytes} reserved, its ceiling "
                f"(responses.max_bytes_total {limits.total_bytes}) for all tenants together; send store: false",
                param="store")
        mine = self._held.setdefault(tenant, Usage())
        mine.records += 1
        mine.bytes += size
        self._held_bytes += size
        return Reservation(tenant, size)

    def release(self, reservation: Reservation) -> None:
        """Give the room back: after the record is stored (it is counted as stored now) or on failure.
        Releasing twice is a no-op."""
        if not reservation.held:
            return
        reservation.held = False
        self._held_bytes -= reservation.bytes
        mine = self._held.get(reservation.tenant)
        if mine is not None:
            mine.records -= 1
            mine.bytes -= reservation.bytes
            if mine.records <= 0:
                del self._held[reservation.tenant]

    def reserved(self, tenant: str) -> Usage:
        held = self._held.get(tenant)
        return Usage(held.records, held.bytes) if held else Usage()


class ResponseStore(Protocol):
    """Where stored responses live; every method is scoped to one tenant."""

    async def put(self, tenant: str, response_id: str, record: Record) -> None: ...

    async def get(self, tenant: str, response_id: str) -> Record | None: ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def usage(self, tenant: str) -> Usage: ...

    async def reserve(self, tenant: str, size: int, limits: Limits) -> Reservation: ...

    def release(self, reservation: Reservation) -> None: ...

    async def close(self) -> None: ...


SCHEMA_VERSION = 2  # 1: records whole; 2: input items kept once per tenant and content (`inputs`)


def _split(record: Record) -> tuple[bytes, str | None, bytes | None]:
    """A record as stored: without its input items, their digest, and the items' JSON (None where it has none)."""
    if "input" not in record:
        return orjson.dumps(record), None, None
    items = orjson.dumps(record["input"])
    rest = orjson.dumps({key: value for key, value in record.items() if key != "input"})
    return rest, hashlib.sha256(items).hexdigest(), items


def _join(rest: bytes, items: bytes | None) -> Record:
    record: Record = orjson.loads(rest)
    if items is not None:
        record["input"] = orjson.loads(items)
    return record


@dataclass(slots=True)
class _Counts:
    """What the file holds, counted on the worker thread: per tenant (records, their bytes with each
    distinct input once) and per (tenant, digest) the input's size and the live records naming it."""

    usage: dict[str, Usage]
    inputs: dict[tuple[str, str], list[int]]


class SqliteResponseStore(_Admission):
    """One SQLite file (WAL); the connection lives on one worker thread, never on the event loop."""

    def __init__(self, path: Path, ttl_s: float) -> None:
        super().__init__()
        self.ttl_s = ttl_s
        # NOTE: a single worker thread owns the connection, so it is never used concurrently.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierlane-responses")
        self._path = path
        self._db: sqlite3.Connection | None = None
        self._writes = 0
        # NOTE: writes wait here (touched on the event loop only) and are committed in batches on
        # the worker thread: (tenant, id) -> (expires, record without input, input digest, input JSON).
        self._pending: dict[tuple[str, str], tuple[float, bytes, str | None, bytes | None]] = {}
        self._flushing: asyncio.Future[None] | None = None
        # per tenant: what its records hold (touched on the event loop only; counted again from the
        # file at start and after each sweep of expired rows, so expiry makes room)
        self._usage: dict[str, Usage] = {}
        # (tenant, digest) -> [input bytes, live records naming it]: an input's bytes are counted
        # in its tenant's usage once, while the first record names it, and leave with the last
        self._inputs: dict[tuple[str, str], list[int]] = {}

    async def start(self) -> None:
        await self._run(self._open)
        self._set_counts(await self._run(self._count_usage))

    def _set_counts(self, counts: _Counts) -> None:
        self._usage, self._inputs = counts.usage, counts.inputs

    def _count_usage(self) -> _Counts:
        db = self._conn()
        now = time.time()
        usage = {tenant: Usage(int(n), int(size or 0)) for tenant, n, size in db.execute(
            "SELECT tenant, COUNT(*), SUM(LENGTH(record)) FROM responses WHERE expires >= ? GROUP BY tenant", (now,))}
        inputs: dict[tuple[str, str], list[int]] = {}
        for tenant, digest, n, size in db.execute(
                "SELECT r.tenant, r.input_digest, COUNT(*), LENGTH(i.body) FROM responses r JOIN inputs i "
                "ON i.tenant = r.tenant AND i.digest = r.input_digest WHERE r.expires >= ? "
                "GROUP BY r.tenant, r.input_digest", (now,)):
            inputs[(tenant, digest)] = [int(size), int(n)]
            usage.setdefault(tenant, Usage()).bytes += int(size)
        return _Counts(usage, inputs)

    async def usage(self, tenant: str) -> Usage:
        return self._usage.get(tenant) or Usage()

    def _stored_total(self) -> int:
        return sum(used.bytes for used in self._usage.values())

    def _open(self) -> None:
        self._db = db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA journal_size_limit=67108864")  # the WAL is cut back to 64 MiB after a checkpoint
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise StoreFailed(f"{self._path} was written by a newer tierlane (schema {version}, this one reads "
                              f"{SCHEMA_VERSION})")
        with db:
            db.execute("BEGIN")
            db.execute(
                "CREATE TABLE IF NOT EXISTS responses (tenant TEXT NOT NULL, id TEXT NOT NULL, expires REAL NOT NULL, "
                "record BLOB NOT NULL, input_digest TEXT, PRIMARY KEY (tenant, id))"
            )
            columns = {row[1] for row in db.execute("PRAGMA table_info(responses)")}
            if "input_digest" not in columns:  # schema 1: its records stay whole (input_digest NULL) and are read as they are
                db.execute("ALTER TABLE responses ADD COLUMN input_digest TEXT")
            db.execute("CREATE TABLE IF NOT EXISTS inputs (tenant TEXT NOT NULL, digest TEXT NOT NULL, body BLOB NOT NULL, "
                       "PRIMARY KEY (tenant, digest))")
            db.execute("CREATE INDEX IF NOT EXISTS responses_expires ON responses (expires)")
            db.execute("CREATE INDEX IF NOT EXISTS responses_input ON responses (tenant, input_digest)")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreFailed("the response store is closed")
        return self._db

    def _count_in(self, counts: dict[str, Usage], inputs: dict[tuple[str, str], list[int]], tenant: str,
                  rest: bytes, digest: str | None, items: bytes | None) -> None:
        """Count one live record: itself, and its input where no other live record names it yet."""
        used = counts.setdefault(tenant, Usage())
        used.records += 1
        used.bytes += len(rest)
        if digest is not None and items is not None:
            held = inputs.get((tenant, digest))
            if held is None:
                inputs[(tenant, digest)] = [len(items), 1]
                used.bytes += len(items)
            else:
                held[1] += 1

    def _count_out(self, tenant: str, size: int, digest: str | None) -> None:
        """Uncount one deleted record (`size` bytes without its input) and, with the last record naming it, its input."""
        used = self._usage.get(tenant)
        if used is None:
            return
        used.records = max(0, used.records - 1)
        used.bytes = max(0, used.bytes - size)
        if digest is None:
            return
        held = self._inputs.get((tenant, digest))
        if held is not None:
            held[1] -= 1
            if held[1] <= 0:
                del self._inputs[(tenant, digest)]
                used.bytes = max(0, used.bytes - held[0])

    async def put(self, tenant: str, response_id: str, record: Record) -> None:
        """Kept at once for this replica's reads; written behind, many responses to one commit.

        The caller never waits on the disk: a stored response is read back from `_pending` until
        its commit, so the next turn of a conversation finds it however soon it comes.
        """
        rest, digest, items = _split(record)
        self._pending[(tenant, response_id)] = (time.time() + self.ttl_s, rest, digest, items)
        self._count_in(self._usage, self._inputs, tenant, rest, digest, items)
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, {}
                # NOTE: reads and deletes run on the same single worker thread after this write,
                # so a response taken out of `_pending` here is never missed by them.
                rows = [(tenant, rid, expires, rest, digest)
                        for (tenant, rid), (expires, rest, digest, _) in batch.items()]
                inputs = {(tenant, digest): items for (tenant, _), (_, _, digest, items) in batch.items()
                          if digest is not None and items is not None}
                try:
                    recounted = await self._run(self._put_many, rows,
                                                [(tenant, digest, items) for (tenant, digest), items in inputs.items()])
                except Exception:  # the answers are already out: the loss is logged
                    log.exception("could not store %d responses", len(rows))
                    recounted = None
                if recounted is not None:  # expired rows were swept: count again (pending ones on top)
                    for (tenant, _), (_, rest, digest, items) in self._pending.items():
                        self._count_in(recounted.usage, recounted.inputs, tenant, rest, digest, items)
                    self._set_counts(recounted)
        finally:
            self._flushing = None

    def _put_many(self, rows: list[tuple[str, str, float, bytes, str | None]],
                  inputs: list[tuple[str, str, bytes]]) -> _Counts | None:
        """Commit `rows` and the inputs they name; every _SWEEP_EVERY writes also delete the expired
        rows and the inputs no record names, and return the usage counted again."""
        now = time.time()
        db = self._conn()
        with db:
            db.execute("BEGIN")
            # an input already stored for this tenant (same digest, so the same items) is kept as it is
            db.executemany("INSERT INTO inputs VALUES (?, ?, ?) ON CONFLICT (tenant, digest) DO NOTHING", inputs)
            db.executemany("INSERT OR REPLACE INTO responses (tenant, id, expires, record, input_digest) "
                           "VALUES (?, ?, ?, ?, ?)", rows)
        before = self._writes
        self._writes += len(rows)
        if self._writes // _SWEEP_EVERY != before // _SWEEP_EVERY:
            with db:
                db.execute("BEGIN")
                db.execute("DELETE FROM responses WHERE expires < ?", (now,))
                db.execute("DELETE FROM inputs WHERE NOT EXISTS (SELECT 1 FROM responses r "
                           "WHERE r.tenant = inputs.tenant AND r.input_digest = inputs.digest)")
            return self._count_usage()
        return None

    async def get(self, tenant: str, response_id: str) -> Record | None:
        pending = self._pending.get((tenant, response_id))
        if pending is not None:
            expires, rest, _, items = pending
            return _join(rest, items) if expires >= time.time() else None
        stored = await self._run(self._get, tenant, response_id)
        return None if stored is None else _join(*stored)

    def _get(self, tenant: str, response_id: str) -> tuple[bytes, bytes | None] | None:
        row = self._conn().execute(
            "SELECT r.record, i.body FROM responses r LEFT JOIN inputs i ON i.tenant = r.tenant "
            "AND i.digest = r.input_digest WHERE r.tenant = ? AND r.id = ? AND r.expires >= ?",
            (tenant, response_id, time.time())
        ).fetchone()
        return None if row is None else (bytes(row[0]), None if row[1] is None else bytes(row[1]))

    async def delete(self, tenant: str, response_id: str) -> bool:
        pending = self._pending.pop((tenant, response_id), None)
        deleted = await self._run(self._delete, tenant, response_id)
        if pending is not None:
            deleted = (len(pending[1]), pending[2])
        if deleted is not None:
            self._count_out(tenant, *deleted)
        return deleted is not None and (pending is None or pending[0] >= time.time())

    def _delete(self, tenant: str, response_id: str) -> tuple[int, str | None] | None:
        """The deleted record's size (without its input) and input digest, or None when there was
        none (expired counts as none). Its input goes too where no other record names it."""
        db = self._conn()
        row = db.execute("SELECT LENGTH(record), expires, input_digest FROM responses WHERE tenant = ? AND id = ?",
                         (tenant, response_id)).fetchone()
        if row is None:
            return None
        with db:
            db.execute("BEGIN")
            db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
            if row[2] is not None:
                db.execute("DELETE FROM inputs WHERE tenant = ? AND digest = ? AND NOT EXISTS (SELECT 1 FROM responses "
                           "WHERE tenant = ? AND input_digest = ?)", (tenant, row[2], tenant, row[2]))
        return (int(row[0]), row[2]) if row[1] >= time.time() else None

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


class RedisResponseStore(_Admission):
    """`<prefix>{<tenant>}:resp:<id>` strings with a TTL, in the store every replica shares, and per
    tenant the books its quota reads (`resp-index`, `resp-sizes`, `resp-bytes`), kept by Lua scripts.
    Records are stored whole (no input deduplication) and no gateway-wide ceiling is counted here:
    Redis's own `maxmemory` bounds it."""

    def __init__(self, client: Any, prefix: str, ttl_s: float, op_timeout_s: float) -> None:
        super().__init__()
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
        from policies.shared_state.redis_client import redis_client  # redis is imported only when configured

        # a stored response can be large: reads get more time than a budget check
        timeout = max(state.op_timeout_ms / 1000.0, 1.0)
        client = redis_client(state.url, connect_timeout_s=state.connect_timeout_ms / 1000.0, read_timeout_s=timeout)
        return RedisResponseStore(client, state.key_prefix, ttl, timeout)
    store = SqliteResponseStore(settings.state_dir / "responses.sqlite3", ttl)
    await store.start()
    return store
