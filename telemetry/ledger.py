"""The usage ledger: one SQLite (WAL) row per request, written in groups by a thread of its own.

Durability: a row is committed at most `commit_window_s` (default 200 ms) after it was appended,
with `synchronous=NORMAL`, which in WAL mode survives a crash of the process. So `kill -9` loses
at most the rows appended during the last commit window (plus the commit in flight); `close()`
(called on shutdown and SIGTERM) commits everything appended before it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILENAME = "ledger.sqlite3"
DEFAULT_COMMIT_WINDOW_S = 0.2
MAX_BATCH = 5_000


@dataclass(slots=True, kw_only=True)
class LedgerRow:
    """One request's usage, cost and outcome, as stored."""

    request_id: str
    ts: float  # unix seconds when the request was received
    tenant: str
    app: str
    lane: str
    model: str  # the model that answered (the target), or the requested one on a cache hit
    requested_model: str
    operation: str
    stream: bool
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    estimated: bool
    trimmed_tokens: int
    cost: float
    saved_cache: float
    saved_edge: float
    saved_trim: float
    status: int
    complete: bool
    error_code: str | None
    latency_ms: float
    ttft_ms: float | None
    cache_status: str
    route_score: float | None

    @property
    def day(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self.ts))


COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LedgerRow)) + ("day",)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    request_id TEXT NOT NULL,
    ts REAL NOT NULL,
    day TEXT NOT NULL,
    tenant TEXT NOT NULL,
    app TEXT NOT NULL,
    lane TEXT NOT NULL,
    model TEXT NOT NULL,
    requested_model TEXT NOT NULL,
    operation TEXT NOT NULL,
    stream INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cached_input_tokens INTEGER NOT NULL,
    estimated INTEGER NOT NULL,
    trimmed_tokens INTEGER NOT NULL,
    cost REAL NOT NULL,
    saved_cache REAL NOT NULL,
    saved_edge REAL NOT NULL,
    saved_trim REAL NOT NULL,
    status INTEGER NOT NULL,
    complete INTEGER NOT NULL,
    error_code TEXT,
    latency_ms REAL NOT NULL,
    ttft_ms REAL,
    cache_status TEXT NOT NULL,
    route_score REAL
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
CREATE INDEX IF NOT EXISTS requests_tenant_day ON requests (tenant, app, day);
CREATE INDEX IF NOT EXISTS requests_request_id ON requests (request_id);
"""

_INSERT = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"


def _values(row: LedgerRow) -> tuple[Any, ...]:
    return tuple(getattr(row, name) for name in COLUMNS)


@dataclass(slots=True)
class _Flush:
    done: threading.Event


class _Stop:
    pass


class Ledger:
    """Appends are non-blocking (a queue put); the writer thread commits them in groups."""

    def __init__(self, path: Path, *, commit_window_s: float = DEFAULT_COMMIT_WINDOW_S) -> None:
        self.path = path
        self.commit_window_s = commit_window_s
        self.written = 0
        self.failed = 0
        # NOTE: the queue is the only state shared with the writer thread; the SQLite
        # connection is created and used by that thread alone.
        self._queue: queue.SimpleQueue[LedgerRow | _Flush | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._urgent = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> None:
        """Create the file and schema and start the writer; blocks until it is ready."""
        if self._thread is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="tierlane-ledger", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"cannot open the ledger at {self.path}: {self._error}") from self._error

    def append(self, row: LedgerRow) -> None:
        self._queue.put(row)

    def pending(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Block until everything appended so far is committed."""
        if self._thread is None or not self._thread.is_alive():
            return False
        done = threading.Event()
        self._queue.put(_Flush(done))
        self._urgent.set()
        return done.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Commit everything appended so far and stop the writer."""
        if self._thread is None:
            return
        self._queue.put(_Stop())
        self._urgent.set()
        self._thread.join(timeout)
        self._thread = None

    def read(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """Run a read-only query on a fresh connection (safe from any thread, alongside the writer)."""
        if not self.path.exists():
            return []
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10.0)
        try:
            conn.row_factory = sqlite3.Row
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(conn)
        finally:
            conn.close()

    def _loop(self, conn: sqlite3.Connection) -> None:
        while True:
            first = self._queue.get()
            # NOTE: the writer sleeps out the commit window instead of waking for every row:
            # a per-row wake-up makes each append a GIL hand-off that the event loop pays for.
            # flush() and close() cut the wait short through `_urgent`.
            if not isinstance(first, (_Flush, _Stop)):
                self._urgent.wait(self.commit_window_s)
            self._urgent.clear()
            waiters: list[threading.Event] = []
            stop = isinstance(first, _Stop)
            if isinstance(first, _Flush):
                waiters.append(first.done)
            batch = [first] if isinstance(first, LedgerRow) else []
            for item in self._drain_all():
                if isinstance(item, LedgerRow):
                    batch.append(item)
                elif isinstance(item, _Flush):
                    waiters.append(item.done)
                else:
                    stop = True
            for start in range(0, len(batch), MAX_BATCH):
                self._write(conn, batch[start : start + MAX_BATCH])
            for done in waiters:
                done.set()
            if stop:
                return

    def _drain_all(self) -> list[LedgerRow | _Flush | _Stop]:
        items: list[LedgerRow | _Flush | _Stop] = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def _write(self, conn: sqlite3.Connection, batch: list[LedgerRow]) -> None:
        if not batch:
            return
        try:
            conn.execute("BEGIN")
            conn.executemany(_INSERT, [_values(row) for row in batch])
            conn.execute("COMMIT")
            self.written += len(batch)
        except sqlite3.Error:
            self.failed += len(batch)
            log.exception("ledger write of %d rows failed", len(batch))
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
