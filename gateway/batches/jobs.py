"""Jobs of the Batch API and their lines, in the batch database; every API call scoped to one tenant.

A job is kept with its lines (copied from the input file when it is created) and counts of
their states. A line is `pending` until its result is recorded, together with its state and the
job's counts, in one transaction keyed by (job, line): a recorded line is never run again, so a
restart runs only the lines still pending. Identical lines (`batches.deduplicate`) name the first
of them (`dup_of`); they are never run, and take its result in the same transaction.

Statuses are OpenAI's (validating → in_progress → finalizing → completed | failed | expired;
cancelling → cancelled); the Anthropic routes show them as in_progress, canceling and ended.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.batches import results
from gateway.batches.database import Database, transaction
from gateway.batches.files import QuotaExceeded, insert_file
from gateway.batches.jsonl import Line

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "expired", "cancelled")
_STAMPS = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
           "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at", "cancelled": "cancelled_at"}
# the count column of each state a line ends in
_COUNTS = {"succeeded": "n_succeeded", "errored": "n_errored", "canceled": "n_canceled", "expired": "n_expired"}
_JOB_COLUMNS = ("id, tenant, app, key_id, api, endpoint, input_file_id, completion_window, status, created_at, expires_at, "
                "in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at, "
                "output_file_id, error_file_id, metadata, errors, headers, n_total, n_succeeded, n_errored, n_canceled, "
                "n_expired")
_ACTIVE_SQL = "(" + ", ".join(f"'{s}'" for s in ACTIVE) + ")"


@dataclass(slots=True)
class Job:
    """One job as stored."""

    id: str
    tenant: str
    app: str
    key_id: str
    api: str  # openai | anthropic
    endpoint: str
    input_file_id: str | None
    completion_window: str
    status: str
    created_at: float
    expires_at: float
    in_progress_at: float | None
    finalizing_at: float | None
    completed_at: float | None
    failed_at: float | None
    expired_at: float | None
    cancelling_at: float | None
    cancelled_at: float | None
    output_file_id: str | None
    error_file_id: str | None
    metadata: dict[str, Any] | None
    errors: list[dict[str, Any]] | None
    headers: dict[str, str]
    n_total: int
    n_succeeded: int
    n_errored: int
    n_canceled: int
    n_expired: int

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Job:
        values = list(row)
        for i in (20, 21, 22):  # metadata, errors, headers: JSON
            values[i] = None if values[i] is None else orjson.loads(values[i])
        return cls(*values)

    @property
    def pending(self) -> int:
        """Lines with no result yet (being answered, or waiting)."""
        return self.n_total - self.n_succeeded - self.n_errored - self.n_canceled - self.n_expired

    @property
    def ended_at(self) -> float | None:
        return self.completed_at or self.failed_at or self.expired_at or self.cancelled_at


@dataclass(frozen=True, slots=True)
class NewJob:
    """What creating a job takes."""

    tenant: str
    app: str
    key_id: str
    api: str
    endpoint: str
    completion_window: str
    window_s: float
    input_file_id: str | None = None
    metadata: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Limits:
    jobs: int  # jobs not ended, per tenant
    lines: int  # lines pending, per tenant


@dataclass(frozen=True, slots=True)
class PendingLine:
    idx: int
    custom_id: str
    line_id: str
    url: str
    body: bytes


class JobStore:
    """Jobs and lines; the runner's and the routes' one way to them."""

    def __init__(self, database: Database, file_ttl_s: float) -> None:
        self._db = database
        self.file_ttl_s = file_ttl_s

    async def create(self, new: NewJob, lines: list[Line], *, deduplicate: bool, limits: Limits) -> Job:
        """Keep a job and its lines (status validating), or QuotaExceeded past the tenant's limits."""
        return await self._db.run(self._create, new, lines, deduplicate, limits)

    def _create(self, new: NewJob, lines: list[Line], deduplicate: bool, limits: Limits) -> Job:
        prefix = "msgbatch_" if new.api == "anthropic" else "batch_"
        job_id = prefix + uuid.uuid4().hex[:24]
        first: dict[str, int] = {}
        rows = []
        for idx, line in enumerate(lines):
            dup_of = first.setdefault(line.key(), idx) if deduplicate else idx
            rows.append((job_id, idx, line.custom_id, "batch_req_" + uuid.uuid4().hex[:24], line.url, line.body,
                         None if dup_of == idx else dup_of))
        db = self._db.conn()
        now = time.time()
        with transaction(db):
            active, queued = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(n_total - n_succeeded - n_errored - n_canceled - n_expired), 0) FROM jobs "
                f"WHERE tenant = ? AND status IN {_ACTIVE_SQL}", (new.tenant,)).fetchone()
            if active >= limits.jobs:
                raise QuotaExceeded(f"tenant {new.tenant!r} has {active} batches not yet ended, its limit "
                                    f"(batches.max_active_jobs_per_tenant {limits.jobs}); wait for one to end or cancel one")
            if queued + len(lines) > limits.lines:
                raise QuotaExceeded(f"tenant {new.tenant!r} has {queued} batch requests waiting; {len(lines)} more would "
                                    f"pass its limit (batches.max_queued_lines_per_tenant {limits.lines})")
            db.execute(
                "INSERT INTO jobs (id, tenant, app, key_id, api, endpoint, input_file_id, completion_window, status, "
                "created_at, expires_at, metadata, headers, n_total) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'validating', ?, ?, ?, ?, ?)",
                (job_id, new.tenant, new.app, new.key_id, new.api, new.endpoint, new.input_file_id, new.completion_window,
                 now, now + new.window_s, None if new.metadata is None else orjson.dumps(new.metadata),
                 orjson.dumps(new.headers), len(lines)))
            db.executemany("INSERT INTO lines (job_id, idx, custom_id, line_id, url, body, dup_of) VALUES (?, ?, ?, ?, ?, ?, ?)",
                           rows)
        job = self._get(new.tenant, job_id)
        assert job is not None
        return job

    async def get(self, tenant: str, job_id: str) -> Job | None:
        return await self._db.run(self._get, tenant, job_id)

    def _get(self, tenant: str, job_id: str) -> Job | None:
        row = self._db.conn().execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE tenant = ? AND id = ?", (tenant, job_id)).fetchone()
        return None if row is None else Job.from_row(row)

    async def listing(self, tenant: str, api: str, *, after: str | None = None, before: str | None = None,
                      limit: int = 20) -> tuple[list[Job], bool] | None:
        """A page of the tenant's jobs of `api`, newest first, after (older than) or before (newer than) a job id;
        and whether more follow in that direction. None: the cursor names no job of the tenant."""
        return await self._db.run(self._listing, tenant, api, after, before, limit)

    def _listing(self, tenant: str, api: str, after: str | None, before: str | None,
                 limit: int) -> tuple[list[Job], bool] | None:
        db = self._db.conn()
        where = "tenant = ? AND api = ?"
        args: list[Any] = [tenant, api]
        cursor = after or before
        ascending = before is not None and after is None
        if cursor:
            row = db.execute("SELECT rowid FROM jobs WHERE tenant = ? AND api = ? AND id = ?", (tenant, api, cursor)).fetchone()
            if row is None:
                return None
            where += " AND rowid > ?" if ascending else " AND rowid < ?"
            args.append(row[0])
        rows = db.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE {where} ORDER BY rowid {'ASC' if ascending else 'DESC'} "
                          "LIMIT ?", (*args, limit + 1)).fetchall()
        jobs = [Job.from_row(row) for row in rows[:limit]]
        if ascending:
            jobs.reverse()
        return jobs, len(rows) > limit

    async def cancel(self, tenant: str, job_id: str) -> Job | None:
        """Ask a job not yet ended to stop (cancelling): lines being answered finish, the rest are canceled."""
        return await self._db.run(self._cancel, tenant, job_id)

    def _cancel(self, tenant: str, job_id: str) -> Job | None:
        db = self._db.conn()
        with transaction(db):
            db.execute("UPDATE jobs SET status = 'cancelling', cancelling_at = ? WHERE tenant = ? AND id = ? "
                       "AND status IN ('validating', 'in_progress')", (time.time(), tenant, job_id))
        return self._get(tenant, job_id)

    async def delete(self, tenant: str, job_id: str) -> bool:
        """Forget an ended job and its lines (its output files stay until deleted or expired)."""
        return await self._db.run(self._delete, tenant, job_id)

    def _delete(self, tenant: str, job_id: str) -> bool:
        db = self._db.conn()
        with transaction(db):
            gone = db.execute(f"DELETE FROM jobs WHERE tenant = ? AND id = ? AND status NOT IN {_ACTIVE_SQL}",
                              (tenant, job_id)).rowcount > 0
            if gone:
                db.execute("DELETE FROM lines WHERE job_id = ?", (job_id,))
        return gone

    async def rows(self, tenant: str, job_id: str, after_idx: int, limit: int) -> list[tuple[int, results.Row]]:
        """Lines of a job in order, after `after_idx`: (idx, (custom_id, line id, state, result))."""
        return await self._db.run(self._rows, tenant, job_id, after_idx, limit)

    def _rows(self, tenant: str, job_id: str, after_idx: int, limit: int) -> list[tuple[int, results.Row]]:
        found = self._db.conn().execute(
            "SELECT l.idx, l.custom_id, l.line_id, l.state, l.result FROM lines l JOIN jobs j ON j.id = l.job_id "
            "WHERE j.tenant = ? AND l.job_id = ? AND l.idx > ? ORDER BY l.idx LIMIT ?", (tenant, job_id, after_idx, limit))
        return [(idx, (custom_id, line_id, state, None if result is None else bytes(result)))
                for idx, custom_id, line_id, state, result in found]

    # The runner's side -------------------------------------------------------------------------

    async def active(self) -> list[Job]:
        """Every tenant's jobs not yet ended, oldest first."""
        return await self._db.run(self._active)

    def _active(self) -> list[Job]:
        rows = self._db.conn().execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE status IN {_ACTIVE_SQL} ORDER BY rowid")
        return [Job.from_row(row) for row in rows]

    async def start(self, job_id: str) -> None:
        """validating → in_progress; or failed, naming the lines whose url is not the job's endpoint."""
        await self._db.run(self._start, job_id)

    def _start(self, job_id: str) -> None:
        db = self._db.conn()
        endpoint = db.execute("SELECT endpoint FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
        wrong = db.execute("SELECT idx, custom_id, url FROM lines WHERE job_id = ? AND url != ? ORDER BY idx LIMIT 10",
                           (job_id, endpoint)).fetchall()
        now = time.time()
        with transaction(db):
            if not wrong:
                db.execute("UPDATE jobs SET status = 'in_progress', in_progress_at = ? WHERE id = ? AND status = 'validating'",
                           (now, job_id))
                return
            errors = [{"code": "invalid_url", "line": idx + 1, "param": "url",
                       "message": f"request {custom_id!r} is for {url}, but the batch's endpoint is {endpoint}"}
                      for idx, custom_id, url in wrong]
            db.execute("UPDATE jobs SET status = 'failed', failed_at = ?, errors = ? WHERE id = ? AND status = 'validating'",
                       (now, orjson.dumps(errors), job_id))
            # nothing of it runs: its lines leave the tenant's queue
            db.execute("UPDATE jobs SET n_canceled = n_total WHERE id = ?", (job_id,))
            db.execute("UPDATE lines SET state = 'canceled' WHERE job_id = ?", (job_id,))

    async def pending(self, job_id: str, after_idx: int, limit: int) -> list[PendingLine]:
        """Lines to run (not a duplicate of another), in order, after `after_idx`."""
        return await self._db.run(self._pending, job_id, after_idx, limit)

    def _pending(self, job_id: str, after_idx: int, limit: int) -> list[PendingLine]:
        rows = self._db.conn().execute(
            "SELECT idx, custom_id, line_id, url, body FROM lines WHERE job_id = ? AND state = 'pending' AND dup_of IS NULL "
            "AND idx > ? ORDER BY idx LIMIT ?", (job_id, after_idx, limit))
        return [PendingLine(idx, custom_id, line_id, url, bytes(body)) for idx, custom_id, line_id, url, body in rows]

    async def record(self, job_id: str, idx: int, state: str, result: bytes) -> int:
        """Record a line's result (and its duplicates') with their state and the job's counts, in one
        transaction; a line already recorded is left as it is. Returns the lines recorded."""
        return await self._db.run(self._record, job_id, idx, state, result)

    def _record(self, job_id: str, idx: int, state: str, result: bytes) -> int:
        db = self._db.conn()
        with transaction(db):
            n = db.execute("UPDATE lines SET state = ?, result = ? WHERE job_id = ? AND state = 'pending' "
                           "AND (idx = ? OR dup_of = ?)", (state, result, job_id, idx, idx)).rowcount
            db.execute(f"UPDATE jobs SET {_COUNTS[state]} = {_COUNTS[state]} + ? WHERE id = ?", (n, job_id))
        return n

    async def end_pending(self, job_id: str, state: str, running: list[int]) -> int:
        """Lines still pending, but for those `running` (and their duplicates), end as `state` (canceled, expired)."""
        return await self._db.run(self._end_pending, job_id, state, running)

    def _end_pending(self, job_id: str, state: str, running: list[int]) -> int:
        db = self._db.conn()
        keep = ", ".join("?" * len(running)) or "-1"  # NOTE: not NULL: `x NOT IN (NULL)` is never true
        with transaction(db):
            n = db.execute(f"UPDATE lines SET state = ? WHERE job_id = ? AND state = 'pending' AND idx NOT IN ({keep}) "
                           f"AND (dup_of IS NULL OR dup_of NOT IN ({keep}))", (state, job_id, *running, *running)).rowcount
            db.execute(f"UPDATE jobs SET {_COUNTS[state]} = {_COUNTS[state]} + ? WHERE id = ?", (n, job_id))
        return n

    async def finalizing(self, job_id: str) -> None:
        await self._db.run(self._set_status, job_id, "finalizing")

    def _set_status(self, job_id: str, status: str) -> None:
        db = self._db.conn()
        with transaction(db):
            db.execute(f"UPDATE jobs SET status = ?, {_STAMPS[status]} = ? WHERE id = ?", (status, time.time(), job_id))

    async def finish(self, job_id: str, status: str) -> None:
        """End a job as `status` (completed, expired, cancelled); an OpenAI job's output and error files
        are written in the same transaction."""
        await self._db.run(self._finish, job_id, status)

    def _finish(self, job_id: str, status: str) -> None:
        db = self._db.conn()
        with transaction(db):
            tenant, api = db.execute("SELECT tenant, api FROM jobs WHERE id = ?", (job_id,)).fetchone()
            output_id = error_id = None
            if api == "openai":
                output, errors = results.openai_files(self._all_rows(db, job_id))
                if output:
                    output_id = insert_file(db, tenant, "batch_output", f"{job_id}_output.jsonl", output, 0, self.file_ttl_s).id
                if errors:
                    error_id = insert_file(db, tenant, "batch_output", f"{job_id}_error.jsonl", errors, 0, self.file_ttl_s).id
            db.execute(f"UPDATE jobs SET status = ?, {_STAMPS[status]} = ?, output_file_id = ?, error_file_id = ? WHERE id = ?",
                       (status, time.time(), output_id, error_id, job_id))

    @staticmethod
    def _all_rows(db: sqlite3.Connection, job_id: str) -> list[results.Row]:
        found = db.execute("SELECT custom_id, line_id, state, result FROM lines WHERE job_id = ? ORDER BY idx", (job_id,))
        return [(custom_id, line_id, state, None if result is None else bytes(result))
                for custom_id, line_id, state, result in found]

    async def sweep(self, retention_s: float) -> None:
        """Delete expired files, and jobs (with their lines) that ended more than `retention_s` after they were made."""
        await self._db.run(self._sweep, retention_s)

    def _sweep(self, retention_s: float) -> None:
        db = self._db.conn()
        now = time.time()
        with transaction(db):
            db.execute("DELETE FROM files WHERE expires_at IS NOT NULL AND expires_at < ?", (int(now),))
            old = [row[0] for row in db.execute(
                f"SELECT id FROM jobs WHERE status NOT IN {_ACTIVE_SQL} AND created_at < ?", (now - retention_s,))]
            for job_id in old:
                db.execute("DELETE FROM lines WHERE job_id = ?", (job_id,))
                db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    async def totals(self, tenant: str | None = None) -> dict[str, Any]:
        """Jobs by status, and the lines of the jobs not yet ended by state: one tenant's, or all (the dashboard)."""
        return await self._db.run(self._totals, tenant)

    def _totals(self, tenant: str | None) -> dict[str, Any]:
        db = self._db.conn()
        where, args = ("WHERE tenant = ?", (tenant,)) if tenant is not None else ("", ())
        jobs = {status: int(n) for status, n in db.execute(f"SELECT status, COUNT(*) FROM jobs {where} GROUP BY status", args)}
        active = f"{where} {'AND' if where else 'WHERE'} status IN {_ACTIVE_SQL}"
        total, succeeded, errored, ended = db.execute(
            "SELECT COALESCE(SUM(n_total), 0), COALESCE(SUM(n_succeeded), 0), COALESCE(SUM(n_errored), 0), "
            f"COALESCE(SUM(n_canceled + n_expired), 0) FROM jobs {active}", args).fetchone()
        lines = {"total": int(total), "succeeded": int(succeeded), "errored": int(errored), "not_run": int(ended),
                 "pending": int(total) - int(succeeded) - int(errored) - int(ended)}
        return {"jobs": jobs, "lines": lines}
