"""How long the ledger keeps its raw rows and its hour buckets, and the pruning that enforces it.

Raw rows (`requests`) are kept for `Retention.rows_s` (telemetry.ledger_retention_hours); older
ones, once the rollups include them, are deleted, and so are the 15-minute rollup buckets of the
same span. Hour buckets are kept for `Retention.hours_s` (telemetry.ledger_hourly_retention_days);
day buckets for ever. Totals therefore never change when rows go: they are read from the rollups.

Two watermarks in `ledger_meta` say what readers may rely on (`Horizons`): `rows_from`, an UTC
hour before which only the rollups count (raw rows there may linger until deleted and are
ignored), and `hours_from`, an UTC day before which only day buckets count. Each moves forward
only, in its own transaction, before anything under it is deleted, so a reader in any snapshot
sees either the rows or the buckets that hold them. A range's end before `rows_from` is read to
its UTC hour (before `hours_from`, its UTC day), since nothing finer is left there; the sums of
adjacent ranges still add up, as every end moves the same way. What the rollups do not hold is
gone past `rows_from`: request-level listings (recent errors, sessions, per-tier totals) and
exact percentiles (the histograms remain).

Pruning runs on the ledger's writer thread in transactions of at most PRUNE_ROWS rows or one
day of buckets, between its group commits. It never deletes the row with the highest id, so
SQLite never hands out an id twice (the rollups' watermark `rollup_through` is an id). Deleted
pages go to SQLite's free list and are reused by new rows, so the file stops growing at about
(retention + 1 hour) of rows plus the rollups (it does not shrink: `VACUUM` offline does that).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass

from telemetry.timefmt import iso_time

log = logging.getLogger(__name__)

HOUR = 3600
DAY = 86400
# Rows deleted per transaction: short enough that an append waits at most a few milliseconds.
PRUNE_ROWS = 1_000
# How often the writer looks for something to prune once a pass found nothing.
PRUNE_INTERVAL_S = 300.0
# (table, level) of the buckets each watermark drops: quarters go with the raw rows, hours later.
QUARTER_BUCKETS: tuple[tuple[str, int], ...] = (("rollup_lane", 900),)
HOUR_BUCKETS: tuple[tuple[str, int], ...] = (("rollup_lane", HOUR), ("rollup", HOUR), ("rollup_hist", HOUR))
META_KEYS = ("rows_from", "hours_from")


@dataclass(slots=True, frozen=True, kw_only=True)
class Retention:
    """How long raw rows and hour buckets are kept, in seconds (None: for ever)."""

    rows_s: float | None = None
    hours_s: float | None = None

    @property
    def prunes(self) -> bool:
        return self.rows_s is not None


@dataclass(slots=True, frozen=True)
class Horizons:
    """What a ledger file still holds: raw rows from `rows_from`, hour buckets from `hours_from`
    (unix seconds; 0: from the first), and the highest row id the rollups include (`through`)."""

    rows_from: float = 0.0
    hours_from: float = 0.0
    through: int = 0

    def snap(self, ts: float) -> float:
        """Where a range's end at `ts` is read: itself while raw rows are kept there, else its UTC hour or day."""
        if ts >= self.rows_from:
            return ts
        level = HOUR if ts >= self.hours_from else DAY
        return float(math.floor(ts / level) * level)

    def moved(self, ts: float) -> bool:
        return self.snap(ts) != ts


def read_horizons(conn: sqlite3.Connection) -> Horizons:
    """The horizons of the file `conn` reads (a file no writer has opened since the rollups came: none)."""
    try:
        meta = {str(r[0]): int(r[1]) for r in conn.execute("SELECT key, value FROM ledger_meta")}
    except sqlite3.OperationalError:
        return Horizons()
    return Horizons(float(meta.get("rows_from", 0)), float(meta.get("hours_from", 0)), meta.get("rollup_through", 0))


def cuts(retention: Retention, now: float, current: Horizons, oldest: float | None) -> Horizons:
    """The horizons the retention asks for at `now`: whole UTC hours (rows) and days (hour buckets),
    never behind the current ones, and hour buckets never dropped where raw rows are kept. Rows move
    only when the oldest row (`oldest`: its ts) is past retention: a young ledger reads to the second."""
    rows_from = current.rows_from
    if retention.rows_s is not None and oldest is not None:
        cut = float(math.floor((now - retention.rows_s) / HOUR) * HOUR)
        rows_from = max(rows_from, cut) if oldest < cut else rows_from
    hours_from = current.hours_from
    if retention.hours_s is not None:
        wanted = min(now - retention.hours_s, rows_from)
        hours_from = max(hours_from, float(math.floor(wanted / DAY) * DAY))
    return Horizons(rows_from, hours_from, current.through)


def prune_step(conn: sqlite3.Connection, retention: Retention, now: float, through: int) -> bool:
    """One short transaction of pruning (rows up to id `through` are in the rollups); False when
    nothing was left to do. Moves the watermarks first, then deletes under them."""
    current = read_horizons(conn)
    wanted = cuts(retention, now, current, conn.execute("SELECT MIN(ts) FROM requests").fetchone()[0])
    if wanted.rows_from > current.rows_from or wanted.hours_from > current.hours_from:
        with _transaction(conn):
            for key in META_KEYS:
                conn.execute("INSERT OR REPLACE INTO ledger_meta (key, value) VALUES (?, ?)", (key, int(getattr(wanted, key))))
        log.info("ledger retention: raw rows before %s and hour buckets before %s are now read from the rollups",
                 iso_time(wanted.rows_from), iso_time(wanted.hours_from))  # fmt: skip
        return True
    if current.rows_from <= 0:
        return False
    with _transaction(conn):
        # NOTE: the newest row stays whatever its age: SQLite gives a new row MAX(id) + 1, and an id
        # the rollups already count must never come back.
        deleted = conn.execute(
            "DELETE FROM requests WHERE id IN (SELECT id FROM requests WHERE ts < ? AND id <= ? "
            "AND id < (SELECT MAX(id) FROM requests) ORDER BY ts LIMIT ?)",
            (current.rows_from, through, PRUNE_ROWS),
        ).rowcount
    if deleted:
        return True
    buckets = [(t, lv, current.rows_from) for t, lv in QUARTER_BUCKETS]
    buckets += [(t, lv, current.hours_from) for t, lv in HOUR_BUCKETS if current.hours_from > 0]
    return any(_drop_day_of_buckets(conn, table, level, before) for table, level, before in buckets)


def _drop_day_of_buckets(conn: sqlite3.Connection, table: str, level: int, before: float) -> bool:
    """Delete one day's worth of `table`'s buckets of `level` that start before `before`."""
    with _transaction(conn):
        oldest = conn.execute(f"SELECT MIN(start) FROM {table} WHERE level = ?", (level,)).fetchone()[0]
        if oldest is None or oldest >= before:
            return False
        conn.execute(f"DELETE FROM {table} WHERE level = ? AND start < ?", (level, min(before, oldest + DAY)))
    return True


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT on an autocommit connection, rolled back on any error."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
