"""No row stops the ledger: a bad row is dropped alone and counted, a dead writer restarted, the losses on /metrics."""

from __future__ import annotations

import dataclasses
import math
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from telemetry import ledger as ledger_module
from telemetry.ledger import FILENAME, Ledger, LedgerRow
from telemetry.prometheus import PromMetrics
from tests.unit.telemetry.test_ledger import count, row


def bad_row(i: int, **fields: Any) -> LedgerRow:
    return dataclasses.replace(row(i), request_id=f"bad{i}", **fields)


# Each breaks the INSERT of its row in a different way.
BAD_FIELDS: dict[str, dict[str, Any]] = {
    "overflowing integer": {"input_tokens": 10**20},  # OverflowError binding it
    "NaN timestamp": {"ts": math.nan},  # ValueError computing `day`
    "huge timestamp": {"ts": 1e300},  # OverflowError computing `day`
    "NULL in a NOT NULL column": {"tenant": None},  # sqlite3.IntegrityError
    "unbindable type": {"app": ["web"]},  # sqlite3.ProgrammingError
}


@pytest.mark.parametrize("fields", BAD_FIELDS.values(), ids=BAD_FIELDS.keys())
def test_a_bad_row_is_dropped_alone_and_the_writer_goes_on(tmp_path: Path, fields: dict[str, Any]) -> None:
    ledger = Ledger(tmp_path / FILENAME, commit_window_s=0.05)
    ledger.start()
    try:
        for i in range(20):
            ledger.append(row(i))
            if i == 10:
                ledger.append(bad_row(i, **fields))
        assert ledger.flush(timeout=5.0)
        assert count(tmp_path / FILENAME) == 20  # the good rows of the same group were kept
        assert (ledger.written, ledger.failed) == (20, 1)
        for i in range(20, 30):
            ledger.append(row(i))
        assert ledger.flush(timeout=5.0)
        assert count(tmp_path / FILENAME) == 30
        assert ledger._thread is not None and ledger._thread.is_alive()
    finally:
        ledger.close()


class WriterBug(BaseException):
    """Stands for a bug that escapes every `except Exception` in the writer."""


class FragileLedger(Ledger):
    """A real ledger whose writer thread dies on its first group."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.kills = 1

    def _write(self, conn: sqlite3.Connection, batch: list[LedgerRow]) -> None:
        if self.kills:
            self.kills -= 1
            raise WriterBug("the writer thread dies")
        super()._write(conn, batch)


def test_a_dead_writer_releases_flush_and_is_restarted_by_append(tmp_path: Path) -> None:
    ledger = FragileLedger(tmp_path / FILENAME, commit_window_s=0.05)
    ledger.start()
    try:
        first = ledger._thread
        assert first is not None
        ledger.append(row(0))
        # The writer dies with row 0 and this flush's marker: the marker is still set, so flush returns
        # True at once; had it waited for a marker nobody sets, False at its timeout (a generous bound).
        assert ledger.flush(timeout=60.0)
        first.join(5.0)
        assert not first.is_alive()
        assert ledger.failed == 1
        for i in range(1, 10):
            ledger.append(row(i))  # the first append notices the dead writer and starts another
        assert ledger.restarts == 1
        assert ledger.flush(timeout=5.0)
        assert count(tmp_path / FILENAME) == 9
    finally:
        ledger.close()


class HeldClock:
    """The ledger's `time`: monotonic time that stands still while held, then runs on from there.

    Held, the appends below all come "within a second of the last restart" however slow the
    machine; let go, flush waits out the rest of the backoff in real time.
    """

    def __init__(self) -> None:
        self.held: float | None = time.monotonic()
        self.behind = 0.0

    def monotonic(self) -> float:
        return self.held if self.held is not None else time.monotonic() - self.behind

    def let_go(self) -> None:
        assert self.held is not None
        self.behind, self.held = time.monotonic() - self.held, None

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_flush_restarts_a_writer_that_append_did_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = HeldClock()
    monkeypatch.setattr(ledger_module, "time", clock)
    ledger = FragileLedger(tmp_path / FILENAME, commit_window_s=0.05)
    ledger.kills = 2
    ledger.start()
    try:
        for i in range(2):
            ledger.append(row(i))  # the second append restarts the writer the first one's death left
            thread = ledger._thread
            assert thread is not None
            thread.join(5.0)  # dies on its own after one commit window
            assert not thread.is_alive()
        # Within a second of the last restart append leaves the dead writer alone (no restart
        # storm); flush must not wait on it for nothing: it restarts it once the backoff is over
        # (False, had it waited for the dead writer until its timeout, a generous bound).
        ledger.append(row(2))
        assert ledger.restarts == 1
        clock.let_go()
        assert ledger.flush(timeout=60.0)
        assert (ledger.restarts, ledger.failed, count(tmp_path / FILENAME)) == (2, 2, 1)
    finally:
        ledger.close()


def test_dropped_rows_are_exported_on_metrics(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / FILENAME, commit_window_s=0.05)
    ledger.start()
    try:
        metrics = PromMetrics(ledger_pending=ledger.pending, ledger_failed=lambda: ledger.failed)
        assert b"tierlane_ledger_rows_failed_total 0.0" in metrics.render()
        ledger.append(row(0))
        ledger.append(bad_row(1, input_tokens=10**20))
        ledger.append(bad_row(2, ts=math.nan))
        assert ledger.flush(timeout=5.0)
        body = metrics.render().decode()
        assert "# TYPE tierlane_ledger_rows_failed_total counter" in body
        assert "tierlane_ledger_rows_failed_total 2.0" in body
        assert "tierlane_ledger_pending_rows 0.0" in body
    finally:
        ledger.close()
