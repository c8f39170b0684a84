"""Cache entries in SQLite (WAL): the response, its usage and scope, TTL and LRU bookkeeping."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from policies.embedding.embedder import vector_space

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY,
    exact TEXT NOT NULL UNIQUE,
    scope TEXT NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    text TEXT NOT NULL,
    vector BLOB,
    response BLOB NOT NULL,
    usage BLOB,
    created REAL NOT NULL,
    expires REAL NOT NULL,
    last_used REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS entries_scope ON entries(scope);
CREATE INDEX IF NOT EXISTS entries_tenant ON entries(tenant);
CREATE INDEX IF NOT EXISTS entries_last_used ON entries(last_used);
CREATE INDEX IF NOT EXISTS entries_expires ON entries(expires);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# What a store's vectors were embedded with when it predates the meta table.
LEGACY_VECTOR_SPACE = vector_space("fp32")

_COLUMNS = "id, exact, scope, tenant, model, text, response, usage, created, expires, last_used, hits"
# What a row holds in the file: its keys, text, vector, response and usage, the keys again in
# their indexes, and ~100 bytes of numbers, rowids and record headers (measured against the
# file's size: tests/unit/cache/test_cache_bounds.py).
_ROW_BYTES = (
    "(2 * (length(CAST(exact AS BLOB)) + length(CAST(scope AS BLOB)) + length(CAST(tenant AS BLOB)))"
    " + length(CAST(model AS BLOB)) + length(CAST(text AS BLOB)) + COALESCE(length(vector), 0)"
    " + length(response) + COALESCE(length(usage), 0) + 100)"
)
_EVICT_PAGE = 512  # least recently used rows read per step of an eviction


@dataclass(slots=True)
class Entry:
    """One cached answer."""

    id: int
    exact: str
    scope: str
    tenant: str
    model: str
    text: str
    response: dict[str, Any]
    usage: dict[str, Any] | None
    created: float
    expires: float
    last_used: float
    hits: int

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Entry:
        return cls(
            id=row[0],
            exact=row[1],
            scope=row[2],
            tenant=row[3],
            model=row[4],
            text=row[5],
            response=orjson.loads(row[6]),
            usage=orjson.loads(row[7]) if row[7] else None,
            created=row[8],
            expires=row[9],
            last_used=row[10],
            hits=row[11],
        )


def _get_exact(db: sqlite3.Connection, exact: str, now: float) -> Entry | None:
    row = db.execute(f"SELECT {_COLUMNS} FROM entries WHERE exact = ? AND expires > ?", (exact, now)).fetchone()
    return Entry.from_row(row) if row else None


class EntryReader:
    """A read-only connection for exact lookups straight from the event loop's thread.

    In WAL mode a reader never waits for the writer, and a lookup by the unique `exact` index
    costs tens of microseconds: less than handing it to the cache's worker thread, which under
    load waited for the GIL for milliseconds (CPython switches threads every 5 ms). Anything
    that blocks here for longer (`timeout_s`) raises sqlite3.Error; the caller then asks the
    worker instead.
    """

    def __init__(self, path: Path, *, timeout_s: float = 0.05) -> None:
        self._db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False,
                                   isolation_level=None, timeout=timeout_s)  # fmt: skip

    def get_exact(self, exact: str, now: float) -> Entry | None:
        return _get_exact(self._db, exact, now)

    def close(self) -> None:
        self._db.close()


class EntryStore:
    """SQLite entry table; every method blocks, so the cache calls it from its worker thread.

    NOTE: the connection is opened with check_same_thread=False but is only ever used by the
    cache's single worker thread (or by a CLI process), so no further locking is needed.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        # NOTE: the entry count and stored bytes are kept here rather than counted per write
        # (COUNT(*) reads a whole index: O(entries) on every put). Another process's writes (the
        # CLI's purge) change PRAGMA data_version, and the next `changed_elsewhere` counts again.
        self.count = 0
        self.nbytes = 0
        self._data_version = -1
        self.changed_elsewhere()

    def changed_elsewhere(self) -> bool:
        """Whether another connection wrote since the last call (the count and bytes are then counted again)."""
        (version,) = self._db.execute("PRAGMA data_version").fetchone()
        if version == self._data_version:
            return False
        self._data_version = version
        self._recount()
        return True

    def _recount(self) -> None:
        self.count, self.nbytes = self._db.execute(f"SELECT COUNT(*), COALESCE(SUM({_ROW_BYTES}), 0) FROM entries").fetchone()

    def close(self) -> None:
        self._db.close()

    def get_exact(self, exact: str, now: float) -> Entry | None:
        return _get_exact(self._db, exact, now)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction. NOTE: the connection is in autocommit mode (isolation_level=None),
        where `with connection:` opens none: each statement inside committed on its own."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def adopt_vector_space(self, name: str) -> int:
        """Mark the stored vectors as embedded with `name`; vectors of another embedding are dropped.

        Their entries stay and still answer exact repeats; a cosine between vectors of two
        embeddings (float32 and int8 differ by ~0.01) is not what the cache's thresholds were
        chosen on. Returns how many vectors were dropped.
        """
        row = self._db.execute("SELECT value FROM meta WHERE key = 'vector_space'").fetchone()
        current = row[0] if row is not None else LEGACY_VECTOR_SPACE
        dropped = 0
        with self._transaction():
            if current != name:
                dropped = self._db.execute("UPDATE entries SET vector = NULL WHERE vector IS NOT NULL").rowcount
            if row is None or current != name:
                self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('vector_space', ?)", (name,))
        if dropped:
            self._recount()
        return max(dropped, 0)

    def get_many(self, ids: Iterable[int]) -> dict[int, Entry]:
        ids = list(ids)
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM entries WHERE id IN ({marks})", ids).fetchall()
        return {row[0]: Entry.from_row(row) for row in rows}

    def put(
        self,
        *,
        exact: str,
        scope: str,
        tenant: str,
        model: str,
        text: str,
        vector: np.ndarray | None,
        response: dict[str, Any],
        usage: dict[str, Any] | None,
        now: float,
        ttl_s: float,
    ) -> tuple[int, int | None]:
        """Insert (or replace the entry with the same exact key); returns (new id, replaced id)."""
        blob = None if vector is None else np.ascontiguousarray(vector, dtype=np.float32).tobytes()
        with self._transaction():
            old = self._db.execute(f"SELECT id, {_ROW_BYTES} FROM entries WHERE exact = ?", (exact,)).fetchone()
            if old:
                self._db.execute("DELETE FROM entries WHERE id = ?", (old[0],))
            cursor = self._db.execute(
                "INSERT INTO entries (exact, scope, tenant, model, text, vector, response, usage,"
                " created, expires, last_used, hits) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                (
                    exact,
                    scope,
                    tenant,
                    model,
                    text,
                    blob,
                    orjson.dumps(response),
                    orjson.dumps(usage) if usage else None,
                    now,
                    now + ttl_s,
                    now,
                ),
            )
            assert cursor.lastrowid is not None
            (added,) = self._db.execute(f"SELECT {_ROW_BYTES} FROM entries WHERE id = ?", (cursor.lastrowid,)).fetchone()
        self.count += 1 - bool(old)
        self.nbytes += added - (old[1] if old else 0)
        return cursor.lastrowid, old[0] if old else None

    def touch(self, entry_id: int, now: float) -> None:
        self._db.execute("UPDATE entries SET hits = hits + 1, last_used = ? WHERE id = ?", (now, entry_id))

    def touch_many(self, touches: dict[int, tuple[int, float]]) -> None:
        """Several hits in one transaction: entry id -> (hits, last used)."""
        with self._transaction():
            self._db.executemany(
                "UPDATE entries SET hits = hits + ?, last_used = MAX(last_used, ?) WHERE id = ?",
                [(hits, used, entry_id) for entry_id, (hits, used) in touches.items()],
            )

    def expire(self, now: float, limit: int = -1) -> list[int]:
        """Delete up to `limit` expired entries (-1: all of them)."""
        return self._delete_where("id IN (SELECT id FROM entries WHERE expires <= ? LIMIT ?)", (now, limit))

    def evict(self, max_entries: int, max_bytes: int | None = None) -> list[int]:
        """Delete the least recently used entries while there are more than `max_entries`, or they hold more than `max_bytes`."""
        gone: list[int] = []
        while self.count > max_entries or (max_bytes is not None and self.nbytes > max_bytes and self.count):
            ids = self.evict_oldest(self.count - max_entries, 0 if max_bytes is None else self.nbytes - max_bytes)
            if not ids:
                break
            gone += ids
        return gone

    def evict_oldest(self, count: int, nbytes: int = 0) -> list[int]:
        """Delete at least `count` of the least recently used entries, and more until they held `nbytes`
        (at most one page of them, _EVICT_PAGE rows, per call)."""
        limit = min(_EVICT_PAGE, max(count, 1 if nbytes <= 0 else 32))
        with self._transaction():
            doomed: list[int] = []
            freed = 0
            rows = self._db.execute(f"SELECT id, {_ROW_BYTES} FROM entries ORDER BY last_used ASC, id ASC LIMIT ?", (limit,))
            for entry_id, size in rows.fetchall():
                if len(doomed) >= count and freed >= nbytes:
                    break
                doomed.append(entry_id)
                freed += size
            self._db.executemany("DELETE FROM entries WHERE id = ?", [(i,) for i in doomed])
        self.count -= len(doomed)
        self.nbytes -= freed
        return doomed

    def purge_tenant(self, tenant: str) -> list[int]:
        return self._delete_where("tenant = ?", (tenant,))

    def purge_key(self, key: str) -> list[int]:
        """Delete by exact key (hex digest) or by numeric entry id."""
        if key.isdigit():
            return self._delete_where("id = ? OR exact = ?", (int(key), key))
        return self._delete_where("exact = ?", (key,))

    def _delete_where(self, where: str, params: tuple[Any, ...]) -> list[int]:
        with self._transaction():
            rows = self._db.execute(f"SELECT id, {_ROW_BYTES} FROM entries WHERE {where}", params).fetchall()
            if rows:
                self._db.executemany("DELETE FROM entries WHERE id = ?", [(r[0],) for r in rows])
        self.count -= len(rows)
        self.nbytes -= sum(r[1] for r in rows)
        return [r[0] for r in rows]

    def vectors(self) -> tuple[list[int], list[str], np.ndarray]:
        """Every stored vector with its id and scope, for rebuilding the index."""
        ids, scopes, blobs = [], [], []
        for entry_id, scope, blob in self._db.execute(
            "SELECT id, scope, vector FROM entries WHERE vector IS NOT NULL ORDER BY id"
        ):
            ids.append(entry_id)
            scopes.append(scope)
            blobs.append(blob)
        if not blobs:
            return [], [], np.zeros((0, 0), dtype=np.float32)
        return ids, scopes, np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(blobs), -1)

    def vector_ids(self) -> set[int]:
        return {r[0] for r in self._db.execute("SELECT id FROM entries WHERE vector IS NOT NULL")}

    def vector_scopes(self) -> dict[int, str]:
        return dict(self._db.execute("SELECT id, scope FROM entries WHERE vector IS NOT NULL").fetchall())

    def stats(self) -> dict[str, Any]:
        entries, hits, tenants = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(hits), 0), COUNT(DISTINCT tenant) FROM entries"
        ).fetchone()
        by_tenant = dict(self._db.execute("SELECT tenant, COUNT(*) FROM entries GROUP BY tenant ORDER BY 2 DESC LIMIT 20"))
        return {
            "entries": entries,
            "hits": hits,
            "tenants": tenants,
            "entries_by_tenant": by_tenant,
            "bytes": self.path.stat().st_size if self.path.exists() else 0,
            "stored_bytes": self.nbytes,
        }
