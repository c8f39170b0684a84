"""Files of the Batch API (OpenAI's /v1/files): input files a job reads, output and error files it writes.

Every read and write is scoped to one tenant: another tenant's file id is simply not found.
A tenant's files together are held to `batches.max_bytes_per_tenant`.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.batches.database import Database, transaction
from gateway.errors import GatewayError, NotFound


class QuotaExceeded(GatewayError):
    """A tenant's files, lines queued or jobs running are at its bound."""

    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"


@dataclass(frozen=True, slots=True)
class StoredFile:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None
    lines: int  # requests an input file holds (0 for output files)


_COLUMNS = "id, tenant, purpose, filename, bytes, created_at, expires_at, lines"


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex[:24]


def not_found(file_id: str) -> NotFound:
    return NotFound(f"no file with id '{file_id}' was found", param="file_id")


def insert_file(db: sqlite3.Connection, tenant: str, purpose: str, filename: str, content: bytes, lines: int,
                ttl_s: float) -> StoredFile:
    """Insert a file (inside the caller's transaction)."""
    now = int(time.time())
    stored = StoredFile(new_file_id(), tenant, purpose, filename, len(content), now, now + int(ttl_s), lines)
    db.execute(f"INSERT INTO files ({_COLUMNS}, content) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
               (stored.id, tenant, purpose, filename, stored.bytes, now, stored.expires_at, lines, content))
    return stored


class FileStore:
    """Per-tenant files in the batch database."""

    def __init__(self, database: Database, ttl_s: float) -> None:
        self._db = database
        self.ttl_s = ttl_s

    async def put(self, tenant: str, purpose: str, filename: str, content: bytes, lines: int, max_tenant_bytes: int) -> StoredFile:
        """Keep an uploaded file, or QuotaExceeded when the tenant's files would pass `max_tenant_bytes`."""
        return await self._db.run(self._put, tenant, purpose, filename, content, lines, max_tenant_bytes)

    def _put(self, tenant: str, purpose: str, filename: str, content: bytes, lines: int, max_tenant_bytes: int) -> StoredFile:
        db = self._db.conn()
        with transaction(db):
            held = int(db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ?", (tenant,)).fetchone()[0])
            if held + len(content) > max_tenant_bytes:
                raise QuotaExceeded(
                    f"tenant {tenant!r} holds {held} bytes of files; {len(content)} more would pass its quota "
                    f"(batches.max_bytes_per_tenant {max_tenant_bytes}); DELETE files no longer needed", param="file")
            return insert_file(db, tenant, purpose, filename, content, lines, self.ttl_s)

    async def get(self, tenant: str, file_id: str) -> StoredFile:
        found = await self._db.run(self._get, tenant, file_id)
        if found is None:
            raise not_found(file_id)
        return found

    def _get(self, tenant: str, file_id: str) -> StoredFile | None:
        row = self._db.conn().execute(f"SELECT {_COLUMNS} FROM files WHERE tenant = ? AND id = ?", (tenant, file_id)).fetchone()
        return None if row is None else StoredFile(*row)

    async def content(self, tenant: str, file_id: str) -> bytes:
        found = await self._db.run(self._content, tenant, file_id)
        if found is None:
            raise not_found(file_id)
        return found

    def _content(self, tenant: str, file_id: str) -> bytes | None:
        row = self._db.conn().execute("SELECT content FROM files WHERE tenant = ? AND id = ?", (tenant, file_id)).fetchone()
        return None if row is None else bytes(row[0])

    async def delete(self, tenant: str, file_id: str) -> None:
        if not await self._db.run(self._delete, tenant, file_id):
            raise not_found(file_id)

    def _delete(self, tenant: str, file_id: str) -> bool:
        db = self._db.conn()
        with transaction(db):
            return db.execute("DELETE FROM files WHERE tenant = ? AND id = ?", (tenant, file_id)).rowcount > 0

    async def listing(self, tenant: str, *, purpose: str | None, after: str | None, limit: int,
                      ascending: bool) -> tuple[list[StoredFile], bool]:
        """A page of the tenant's files by creation (`after` a file id), and whether more follow."""
        return await self._db.run(self._listing, tenant, purpose, after, limit, ascending)

    def _listing(self, tenant: str, purpose: str | None, after: str | None, limit: int,
                 ascending: bool) -> tuple[list[StoredFile], bool]:
        db = self._db.conn()
        where: list[str] = ["tenant = ?"]
        args: list[Any] = [tenant]
        if purpose:
            where.append("purpose = ?")
            args.append(purpose)
        if after:
            row = db.execute("SELECT rowid FROM files WHERE tenant = ? AND id = ?", (tenant, after)).fetchone()
            if row is None:
                raise not_found(after)
            where.append("rowid > ?" if ascending else "rowid < ?")
            args.append(row[0])
        order = "ASC" if ascending else "DESC"
        rows = db.execute(f"SELECT {_COLUMNS} FROM files WHERE {' AND '.join(where)} ORDER BY rowid {order} LIMIT ?",
                          (*args, limit + 1)).fetchall()
        return [StoredFile(*row) for row in rows[:limit]], len(rows) > limit
