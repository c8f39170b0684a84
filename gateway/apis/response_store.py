"""Stored responses of the Responses API, in the state backend: SQLite under state_dir, or Redis/Valkey.

A record is one response with the items it answered (`input`) and the conversation before
them (`context`), so `previous_response_id` rebuilds a conversation from one read. Records are
keyed by tenant and id, so another tenant's id is simply not found, and expire after
`responses.ttl_s`.

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


class ResponseStore(Protocol):
    """Where stored responses live; every method is scoped to one tenant."""

    async def put(self, tenant: str, response_id: str, record: Record) -> None: ...

    async def get(self, tenant: str, response_id: str) -> Record | None: ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...

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

    async def start(self) -> None:
        await self._run(self._open)

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
        self._pending[(tenant, response_id)] = (time.time() + self.ttl_s, orjson.dumps(record))
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
                    await self._run(self._put_many, rows)
                except Exception:  # the answers are already out: the loss is logged
                    log.exception("could not store %d responses", len(rows))
        finally:
            self._flushing = None

    def _put_many(self, rows: list[tuple[str, str, float, bytes]]) -> None:
        now = time.time()
        db = self._conn()
        with db:
            db.execute("BEGIN")
            db.executemany("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)", rows)
        before = self._writes
        self._writes += len(rows)
        if self._writes // _SWEEP_EVERY != before // _SWEEP_EVERY:
            db.execute("DELETE FROM responses WHERE expires < ?", (now,))

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
        deleted = bool(await self._run(self._delete, tenant, response_id))
        return deleted or (pending is not None and pending[0] >= time.time())

    def _delete(self, tenant: str, response_id: str) -> bool:
        cursor = self._conn().execute(
            "DELETE FROM responses WHERE tenant = ? AND id = ? AND expires >= ?", (tenant, response_id, time.time())
        )
        return cursor.rowcount > 0

    async def close(self) -> None:
        if self._flushing is not None:
            await self._flushing

        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await self._run(shut)
        self._executor.shutdown(wait=True)


class RedisResponseStore:
    """`<prefix>{<tenant>}:resp:<id>` strings with a TTL, in the store every replica shares."""

    def __init__(self, client: Any, prefix: str, ttl_s: float, op_timeout_s: float) -> None:
        self._client = client
        self._prefix = prefix
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._timeout = op_timeout_s

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{self._prefix}{{{tenant}}}:resp:{response_id}"

    async def _call(self, coro: Any) -> Any:
        try:
            return await asyncio.wait_for(coro, self._timeout)
        except (TimeoutError, OSError, ConnectionError) as exc:
            raise StoreFailed(f"the response store did not answer: {type(exc).__name__}", retry_after=1) from None
        except Exception as exc:  # noqa: BLE001 - redis-py's own errors; the caller gets a 503, never a 500
            raise StoreFailed(f"the response store failed: {type(exc).__name__}", retry_after=1) from None

    async def put(self, tenant: str, response_id: str, record: Record) -> None:
        await self._call(self._client.set(self._key(tenant, response_id), orjson.dumps(record), px=self.ttl_ms))

    async def get(self, tenant: str, response_id: str) -> Record | None:
        blob = await self._call(self._client.get(self._key(tenant, response_id)))
        return None if blob is None else orjson.loads(blob)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self._call(self._client.delete(self._key(tenant, response_id))))

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
