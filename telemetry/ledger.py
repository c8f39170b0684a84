"""The usage ledger: one SQLite (WAL) row per request, written in groups by a thread of its own.

Durability: a row is committed at most `commit_window_s` (default 200 ms) after it was appended,
with `synchronous=NORMAL`, which in WAL mode survives a crash of the process. So `kill -9` loses
at most the rows appended during the last commit window (plus the commit in flight); `close()`
(called on shutdown and SIGTERM) commits everything appended before it.

Robustness: no row can stop the ledger. A group that fails to commit (whatever the error) is
retried row by row, so one bad row costs only itself; dropped rows are logged and counted in
`failed` (exported on /metrics). Should the writer thread die all the same (a bug), the next
`append`, `flush` or `close` notices, logs it loudly and starts a new writer.
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
# A dead writer is restarted at most this often, so a writer that cannot even open the file
# does not turn every append into a restart.
RESTART_BACKOFF_S = 1.0
# flush() looks at the writer this often while it waits, to restart it should it have died.
FLUSH_POLL_S = 0.1
# flush() gives up after this many restarts of a writer that keeps dying while it waits.
FLUSH_MAX_RESTARTS = 3
# Dropped rows whose request ids one log line names.
LOGGED_IDS = 10


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
        self.failed = 0  # rows dropped: their write failed, or their writer died with them
        self.restarts = 0  # writers restarted after one died
        # NOTE: the queue is the only state shared with the writer thread; the SQLite
        # connection is created and used by that thread alone.
        self._queue: queue.SimpleQueue[LedgerRow | _Flush | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._urgent = threading.Event()
        self._error: BaseException | None = None
        # Guards (re)starting the writer: append() runs on the event loop, flush() on workers.
        self._lock = threading.Lock()
        self._closing = False
        self._next_restart = 0.0

    def start(self) -> None:
        """Create the file and schema and start the writer; blocks until it is ready."""
        with self._lock:
            if self._thread is not None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._closing = False
            self._error = None
            ready = threading.Event()
            self._thread = self._spawn(ready)
        ready.wait()
        # NOTE: annotated so that the reset above does not narrow it: the writer thread sets it.
        error: BaseException | None = self._error
        if error is not None:
            self._thread = None  # nothing to restart: the caller learns it cannot meter
            raise RuntimeError(f"cannot open the ledger at {self.path}: {error}") from error

    def append(self, row: LedgerRow) -> None:
        self._queue.put(row)
        thread = self._thread
        if thread is not None and not thread.is_alive():
            self._revive()

    def pending(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Block until everything appended so far is committed (or dropped as failed).

        False when the ledger is not started or the timeout passed; a writer that died before
        or during the wait is restarted, and flush gives up (False) if it keeps dying.
        """
        if self._thread is None:
            return False
        self._revive()
        done = threading.Event()
        self._queue.put(_Flush(done))
        self._urgent.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        restarts = self.restarts
        while True:
            wait = FLUSH_POLL_S if deadline is None else min(FLUSH_POLL_S, max(0.0, deadline - time.monotonic()))
            if done.wait(wait):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            # NOTE: annotated so that the check on entry does not narrow it: close() clears it.
            thread: threading.Thread | None = self._thread
            if thread is None:  # closed meanwhile
                return done.is_set()
            if not thread.is_alive():
                # NOTE: a writer that dies with our marker in hand sets it on the way out; one
                # that dies before taking it leaves it queued for the writer started here.
                if self.restarts - restarts >= FLUSH_MAX_RESTARTS:
                    log.error("ledger flush gave up: the writer died %d times while it waited", FLUSH_MAX_RESTARTS)
                    return done.is_set()
                self._revive()

    def close(self, timeout: float | None = 30.0) -> None:
        """Commit everything appended so far and stop the writer."""
        if self._thread is None:
            return
        self._revive(force=True)  # a dead writer would leave the queued rows unwritten
        with self._lock:
            self._closing = True
            thread = self._thread
        self._queue.put(_Stop())
        self._urgent.set()
        if thread is not None:
            thread.join(timeout)
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

    def _spawn(self, ready: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(ready,), name="tierlane-ledger", daemon=True)
        thread.start()
        return thread

    def _revive(self, *, force: bool = False) -> bool:
        """Start a new writer if the current one died; True if one was started."""
        with self._lock:
            thread = self._thread
            if thread is None or thread.is_alive() or self._closing:
                return False
            now = time.monotonic()
            if not force and now < self._next_restart:
                return False
            self._next_restart = now + RESTART_BACKOFF_S
            self.restarts += 1
            log.critical(
                "the ledger writer thread died (%d rows waiting); starting a new one (restart %d)",
                self._queue.qsize(),
                self.restarts,
            )
            self._thread = self._spawn(threading.Event())
            return True

    def _run(self, ready: threading.Event) -> None:
        try:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
            self._error = exc
            log.error("cannot open the ledger at %s: %s", self.path, exc)
            ready.set()
            return
        ready.set()
        try:
            self._loop(conn)
        except BaseException:
            # NOTE: not re-raised: the death is logged here, and the next append, flush or
            # close starts a new writer.
            log.critical("the ledger writer thread died", exc_info=True)
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
            unwritten = len(batch)
            try:
                for start in range(0, len(batch), MAX_BATCH):
                    group = batch[start : start + MAX_BATCH]
                    self._write(conn, group)
                    unwritten -= len(group)
            except BaseException:
                self.failed += unwritten  # the writer is dying with these rows
                raise
            finally:
                # NOTE: even when dying: a flush() must never wait on a marker nobody will set.
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
        """Commit a group in one transaction; if that fails, each row on its own. Never raises for a row."""
        if not batch:
            return
        try:
            # NOTE: inside the try: building a row's values can fail too (`day` of a NaN ts).
            values = [_values(row) for row in batch]
            conn.execute("BEGIN")
            conn.executemany(_INSERT, values)
            conn.execute("COMMIT")
            self.written += len(batch)
            return
        except Exception:
            # Not only sqlite3.Error: a token count past 2**63 raises OverflowError, a bad
            # timestamp ValueError. The group is rolled back and every row tried on its own.
            log.warning("ledger write of %d rows failed; writing them one by one", len(batch), exc_info=True)
            _rollback(conn)
        dropped: list[str] = []
        for row in batch:
            try:
                conn.execute(_INSERT, _values(row))  # autocommit: a transaction of its own
            except Exception:
                if not dropped:
                    log.exception("ledger row %r cannot be written", row.request_id)
                dropped.append(str(row.request_id))
                _rollback(conn)
            else:
                self.written += 1
        if dropped:
            self.failed += len(dropped)
            log.error(
                "ledger: dropped %d of %d rows that cannot be written (request ids %s)",
                len(dropped),
                len(batch),
                ", ".join(dropped[:LOGGED_IDS]) + (", ..." if len(dropped) > LOGGED_IDS else ""),
            )


def _rollback(conn: sqlite3.Connection) -> None:
    """End a failed transaction, if one is still open."""
    try:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass
