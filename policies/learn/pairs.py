"""The (input, answer) pairs of learned templates: SQLite in the state directory, written in batches off the loop.

One row per kept answer (table `pairs`, schema below). Bounds, applied by the writer after each
batch: per template (tenant, app, name) the newest `max_pairs`; no pair past its `expires_at`
(collection time + the template's retention); per tenant at most its quota of bytes, the
tenant's oldest pairs dropped first. Local to one gateway: with several replicas each keeps its
own file (there is no Redis variant), and a trainer reads each replica's file.

A trainer reads with `PairReader` (newest first, a deterministic held-out split by `held_out`);
the serving process writes with `PairStore`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import orjson

log = logging.getLogger(__name__)

FILENAME = "learn_pairs.sqlite3"
SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS pairs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,   -- collection order: newest first is id DESC
    pair_id TEXT NOT NULL UNIQUE,           -- the request's uid: the held-out split hashes it
    tenant TEXT NOT NULL,
    app TEXT NOT NULL,
    template TEXT NOT NULL,
    template_version TEXT NOT NULL,         -- 16 hex of the template's definition when collected
    matched_by TEXT NOT NULL,               -- header | prefix | app
    ts REAL NOT NULL,                       -- unix seconds, collected
    expires_at REAL NOT NULL,               -- unix seconds: ts + the template's retention
    model TEXT NOT NULL,                    -- the model that answered (as the upstream named it)
    messages TEXT NOT NULL,                 -- JSON: the chat messages as sent upstream
    variable TEXT,                          -- the text after the fixed prefix (NULL: not identified)
    answer TEXT NOT NULL,
    params TEXT NOT NULL,                   -- JSON: the request's other fields (response_format, temperature, ...)
    input_tokens INTEGER,                   -- the upstream's usage (NULL: it reported none)
    output_tokens INTEGER,
    bytes INTEGER NOT NULL                  -- what the pair counts against the tenant's quota
);
CREATE INDEX IF NOT EXISTS pairs_template ON pairs(tenant, app, template, id);
CREATE INDEX IF NOT EXISTS pairs_tenant ON pairs(tenant, id, bytes);
CREATE INDEX IF NOT EXISTS pairs_expiry ON pairs(expires_at);
"""
_COLUMNS = ("pair_id", "tenant", "app", "template", "template_version", "matched_by", "ts", "expires_at", "model",
            "messages", "variable", "answer", "params", "input_tokens", "output_tokens", "bytes")  # fmt: skip
_ROW_OVERHEAD = 256  # bytes a pair counts for beyond its texts (ids, names, numbers, index entries)
_SPLIT_SALT = b"tierlane-learn-split:"
Key = tuple[str, str, str]  # (tenant, app, template)
_T = TypeVar("_T")


class PairStoreError(Exception):
    """The pair file cannot be used (written by a newer tierlane)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PairRow:
    """One pair to write, with the bounds its template and tenant had when it was collected."""

    pair_id: str
    tenant: str
    app: str
    template: str
    template_version: str
    matched_by: str
    ts: float
    expires_at: float
    model: str
    messages: str  # JSON
    variable: str | None
    answer: str
    params: str  # JSON
    input_tokens: int | None
    output_tokens: int | None
    max_pairs: int
    tenant_quota_bytes: int | None

    @property
    def bytes(self) -> int:
        texts = (self.messages, self.variable or "", self.answer, self.params)
        return _ROW_OVERHEAD + sum(len(t.encode("utf-8")) for t in texts)

    def values(self) -> tuple[Any, ...]:
        return (self.pair_id, self.tenant, self.app, self.template, self.template_version, self.matched_by, self.ts,
                self.expires_at, self.model, self.messages, self.variable, self.answer, self.params, self.input_tokens,
                self.output_tokens, self.bytes)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class Pair:
    """One stored pair as a trainer reads it."""

    pair_id: str
    tenant: str
    app: str
    template: str
    template_version: str
    matched_by: str
    ts: float
    model: str
    messages: list[dict[str, Any]]
    variable: str | None
    answer: str
    params: dict[str, Any]
    input_tokens: int | None
    output_tokens: int | None

    @property
    def held_out(self) -> bool:
        """In the default held-out split (10 %)."""
        return held_out(self.pair_id)


@dataclass(frozen=True, slots=True)
class TemplatePairs:
    """How many pairs one template holds."""

    tenant: str
    app: str
    template: str
    pairs: int
    bytes: int
    oldest: float | None
    newest: float | None


def held_out(pair_id: str, share: float = 0.1) -> bool:
    """Whether a pair is in the held-out split: by a hash of its id, so the same pair is always on the
    same side, whatever else was collected or dropped since."""
    digest = hashlib.sha256(_SPLIT_SALT + pair_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < share


def connect(path: Path, *, read_only: bool = False) -> sqlite3.Connection:
    """A connection to the pair file (created with its schema unless read_only)."""
    if read_only:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA busy_timeout=5000")  # the gateway and `tierlane edge learn-forget` may write at once
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        conn.close()
        raise PairStoreError(f"{path} was written by a newer tierlane (schema {version}, this one reads {SCHEMA_VERSION})")
    if not read_only:
        conn.executescript(SCHEMA)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    return conn


def forget(conn: sqlite3.Connection, template: str, tenant: str | None = None, app: str | None = None) -> int:
    """Delete a template's pairs (of one tenant, or one tenant's app); the number deleted. Blocking."""
    where, args = ["template = ?"], [template]
    for column, value in (("tenant", tenant), ("app", app)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    with conn:
        return int(conn.execute(f"DELETE FROM pairs WHERE {' AND '.join(where)}", args).rowcount)


def summarize(conn: sqlite3.Connection, now: float, tenant: str | None = None) -> list[TemplatePairs]:
    """Pairs and bytes per template, unexpired ones only. Blocking."""
    sql = ("SELECT tenant, app, template, COUNT(*), SUM(bytes), MIN(ts), MAX(ts) FROM pairs WHERE expires_at >= ?"
           + (" AND tenant = ?" if tenant is not None else "") + " GROUP BY tenant, app, template ORDER BY 1, 2, 3")  # fmt: skip
    args: tuple[Any, ...] = (now,) if tenant is None else (now, tenant)
    return [TemplatePairs(t, a, n, int(c), int(b or 0), o, w) for t, a, n, c, b, o, w in conn.execute(sql, args)]


class PairStore:
    """Keeps pairs: `add` queues one on the event loop, a single writer thread writes the queue in batches.

    NOTE: one worker thread owns the connection, so writes never run concurrently; `_lock` guards
    only the queue and the flag that says a drain is scheduled, both touched by the loop and the writer.
    """

    def __init__(self, path: Path, *, max_pending: int = 2048, wall: Any = time.time) -> None:
        self.path = path
        self.max_pending = max_pending
        self._wall = wall
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learn-pairs")
        self._lock = threading.Lock()
        self._pending: list[PairRow] = []
        self._scheduled = False
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self.written = 0  # pairs inserted since start
        self.pruned = 0  # pairs deleted by the bounds since start
        self.dropped = 0  # pairs refused because the queue was full (the disk is slower than the traffic)
        self.failed = 0  # pairs lost to a failed write
        # NOTE: replaced whole by the writer, never changed in place: readers on other threads
        # iterate the mapping they got without a lock.
        self.counts: dict[Key, int] = {}

    def add(self, row: PairRow) -> bool:
        """Queue a pair (never blocks); False when the queue is full or the store closed."""
        with self._lock:
            if self._closed or len(self._pending) >= self.max_pending:
                self.dropped += 1
                return False
            self._pending.append(row)
            if self._scheduled:
                return True
            self._scheduled = True
        self._executor.submit(self._drain)
        return True

    async def open(self) -> None:
        """Create the file and drop what expired while the gateway was stopped (on the writer thread)."""
        await self._run(self._sweep)

    async def flush(self) -> None:
        """Return once every pair queued before the call is written."""
        await self._run(self._drain)

    async def forget(self, template: str, tenant: str | None = None, app: str | None = None) -> int:
        """Delete a template's pairs, those still queued included; the number deleted."""

        def go() -> int:
            self._drain()
            deleted = forget(self._connection(), template, tenant, app)
            self._recount()
            return deleted

        return await self._run(go)

    async def summary(self, tenant: str | None = None) -> list[TemplatePairs]:
        """Pairs per template, after what is queued is written."""

        def go() -> list[TemplatePairs]:
            self._drain()
            return summarize(self._connection(), self._wall(), tenant)

        return await self._run(go)

    async def close(self) -> None:
        """Write what is queued, close the connection on its thread, stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            await self._run(self._drain)
            await self._run(self._disconnect)
        finally:
            self._executor.shutdown(wait=True)

    async def _run(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = connect(self.path)
            self._recount()
        return self._conn

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _drain(self) -> None:
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
                if not batch:
                    self._scheduled = False
                    return
            try:
                self._write(batch)
            except Exception:  # a failed batch is lost, never the writer: later batches are still written
                self.failed += len(batch)
                log.exception("writing %d learned pairs failed", len(batch))

    def _write(self, batch: list[PairRow]) -> None:
        conn = self._connection()
        keys: dict[Key, int] = {}
        quotas: dict[str, int | None] = {}
        with conn:
            before = conn.total_changes
            conn.executemany(f"INSERT OR IGNORE INTO pairs ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                             [row.values() for row in batch])  # fmt: skip
            self.written += conn.total_changes - before
            for row in batch:  # the newest row's bounds win: a policy reload applies from the next pair on
                keys[(row.tenant, row.app, row.template)] = row.max_pairs
                quotas[row.tenant] = row.tenant_quota_bytes
            before = conn.total_changes
            for (tenant, app, template), max_pairs in keys.items():
                conn.execute(
                    "DELETE FROM pairs WHERE id IN (SELECT id FROM pairs WHERE tenant = ? AND app = ? AND template = ? "
                    "ORDER BY id DESC LIMIT -1 OFFSET ?)", (tenant, app, template, max_pairs))  # fmt: skip
            expired = conn.execute("DELETE FROM pairs WHERE expires_at < ?", (self._wall(),)).rowcount
            for tenant, quota in quotas.items():
                if quota is not None:
                    _hold_quota(conn, tenant, quota)
            self.pruned += conn.total_changes - before
        self._recount(None if expired > 0 else set(quotas))

    def _sweep(self) -> None:
        conn = self._connection()
        with conn:
            self.pruned += conn.execute("DELETE FROM pairs WHERE expires_at < ?", (self._wall(),)).rowcount
        self._recount()

    def _recount(self, tenants: set[str] | None = None) -> None:
        """Count the pairs per template again: every tenant's, or only those of `tenants` (what a batch touched)."""
        assert self._conn is not None
        sql = "SELECT tenant, app, template, COUNT(*) FROM pairs"
        if tenants is None:
            self.counts = {(t, a, n): int(c) for t, a, n, c in self._conn.execute(sql + " GROUP BY tenant, app, template")}
            return
        counts = {key: n for key, n in self.counts.items() if key[0] not in tenants}
        for tenant in tenants:
            rows = self._conn.execute(sql + " WHERE tenant = ? GROUP BY tenant, app, template", (tenant,))
            counts.update({(t, a, n): int(c) for t, a, n, c in rows})
        self.counts = counts


def _hold_quota(conn: sqlite3.Connection, tenant: str, quota: int) -> None:
    """Delete the tenant's oldest pairs until its pairs take at most `quota` bytes."""
    total = int(conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM pairs WHERE tenant = ?", (tenant,)).fetchone()[0])
    if total <= quota:
        return
    doomed: list[tuple[int]] = []
    freed = 0
    for row_id, size in conn.execute("SELECT id, bytes FROM pairs WHERE tenant = ? ORDER BY id", (tenant,)).fetchall():
        doomed.append((row_id,))
        freed += size
        if total - freed <= quota:
            break
    conn.executemany("DELETE FROM pairs WHERE id = ?", doomed)


class PairReader:
    """Reads the pairs a gateway kept, for a trainer (another process; read-only, safe while the gateway writes)."""

    def __init__(self, path: Path, *, wall: Any = time.time) -> None:
        self.path = path
        self._wall = wall
        self._conn = connect(path, read_only=True)

    def __enter__(self) -> PairReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    def templates(self, tenant: str | None = None) -> list[TemplatePairs]:
        """Every template with pairs, and how many."""
        return summarize(self._conn, self._wall(), tenant)

    def pairs(
        self,
        tenant: str,
        app: str,
        template: str,
        *,
        split: Literal["all", "train", "held_out"] = "all",
        held_out_share: float = 0.1,
        version: str | None = None,
        page: int = 256,
    ) -> Iterator[Pair]:
        """A template's unexpired pairs, newest first; `split` keeps one side of `held_out(pair_id, held_out_share)`,
        `version` only those collected under one definition of the template."""
        last: int | None = None
        now = self._wall()
        while True:
            sql = ("SELECT id, pair_id, tenant, app, template, template_version, matched_by, ts, model, messages, variable, "
                   "answer, params, input_tokens, output_tokens FROM pairs WHERE tenant = ? AND app = ? AND template = ? "
                   "AND expires_at >= ?" + ("" if last is None else " AND id < ?") + " ORDER BY id DESC LIMIT ?")  # fmt: skip
            args: list[Any] = [tenant, app, template, now, *([] if last is None else [last]), page]
            rows = self._conn.execute(sql, args).fetchall()
            if not rows:
                return
            for row in rows:
                pair = Pair(pair_id=row[1], tenant=row[2], app=row[3], template=row[4], template_version=row[5],
                            matched_by=row[6], ts=row[7], model=row[8], messages=orjson.loads(row[9]), variable=row[10],
                            answer=row[11], params=orjson.loads(row[12]), input_tokens=row[13], output_tokens=row[14])  # fmt: skip
                if version is not None and pair.template_version != version:
                    continue
                if split != "all" and held_out(pair.pair_id, held_out_share) != (split == "held_out"):
                    continue
                yield pair
            last = rows[-1][0]


def forget_in(path: Path, template: str, tenant: str | None = None, app: str | None = None) -> int:
    """`forget` on a pair file no running store holds open here (a command, or a gateway that collects nothing). Blocking."""
    if not path.exists():
        return 0
    conn = connect(path)
    try:
        return forget(conn, template, tenant, app)
    finally:
        conn.close()


def summarize_in(path: Path, tenant: str | None = None, *, wall: Any = time.time) -> list[TemplatePairs]:
    """`summarize` of a pair file, read-only; [] where there is none. Blocking."""
    if not path.exists():
        return []
    with PairReader(path, wall=wall) as reader:
        return reader.templates(tenant)
