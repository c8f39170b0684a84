"""The SQLite file that holds the Batch API's files, jobs and lines (state_dir/batches.sqlite3).

One connection, owned by one worker thread: every read and write runs there, never on the event
loop, and one at a time, so a quota check and the insert it admits see no other write between them.
A line's result is committed with its state in one transaction (WAL, synchronous NORMAL: a
committed result survives the process being killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ParamSpec, TypeVar

from gateway.errors import GatewayError

P = ParamSpec("P")
T = TypeVar("T")

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER, lines INTEGER NOT NULL DEFAULT 0,
    content BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, app TEXT NOT NULL, key_id TEXT NOT NULL, api TEXT NOT NULL,
    endpoint TEXT NOT NULL, input_file_id TEXT, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    created_at REAL NOT NULL, expires_at REAL NOT NULL, in_progress_at REAL, finalizing_at REAL, completed_at REAL,
    failed_at REAL, expired_at REAL, cancelling_at REAL, cancelled_at REAL, output_file_id TEXT, error_file_id TEXT,
    metadata TEXT, errors TEXT, headers TEXT NOT NULL DEFAULT '{}',
    n_total INTEGER NOT NULL, n_succeeded INTEGER NOT NULL DEFAULT 0, n_errored INTEGER NOT NULL DEFAULT 0,
    n_canceled INTEGER NOT NULL DEFAULT 0, n_expired INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, api);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status);
CREATE TABLE IF NOT EXISTS lines (
    job_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, line_id TEXT NOT NULL, url TEXT NOT NULL,
    body BLOB NOT NULL, dup_of INTEGER, state TEXT NOT NULL DEFAULT 'pending', result BLOB,
    PRIMARY KEY (job_id, idx)
);
CREATE INDEX IF NOT EXISTS lines_pending ON lines (job_id, state, idx);
CREATE INDEX IF NOT EXISTS lines_dup ON lines (job_id, dup_of) WHERE dup_of IS NOT NULL;
"""


class StoreFailed(GatewayError):
    status = 503
    type = "server_error"
    code = "batch_store_unavailable"


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an error)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


class Database:
    """The file and the one thread that touches it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # NOTE: one worker thread owns the connection, so it is never used concurrently.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierlane-batches")
        self._db: sqlite3.Connection | None = None

    async def open(self) -> None:
        await self.run(self._open)

    def _open(self) -> None:
        self._db = db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise StoreFailed(f"{self.path} was written by a newer tierlane (schema {version}, this one reads {SCHEMA_VERSION})")
        with transaction(db):
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreFailed("the batch store is closed")
        return self._db

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args)` on the store's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def close(self) -> None:
        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await self.run(shut)
        self._executor.shutdown(wait=True)
