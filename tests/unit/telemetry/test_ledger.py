"""The ledger: rows are committed in groups off the event loop and survive SIGTERM; kill -9 loses at most one window."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

from telemetry.ledger import FILENAME, Ledger, LedgerRow

REPO = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).with_name("ledger_child.py")


def row(i: int) -> LedgerRow:
    return LedgerRow(
        request_id=f"r{i}", ts=1_780_000_000.0 + i, tenant="acme", app="web", lane="upstream",
        model="gpt-4o-mini", requested_model="gpt-4o-mini", operation="chat", stream=False,
        input_tokens=10, output_tokens=i, cached_input_tokens=0, estimated=False, trimmed_tokens=0,
        cost=0.5, saved_cache=0.0, saved_edge=0.0, saved_trim=0.0, status=200, complete=True,
        error_code=None, latency_ms=1.0, ttft_ms=None, cache_status="off", route_score=None,
    )  # fmt: skip


def count(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
    finally:
        conn.close()


def test_rows_are_committed_by_the_writer_thread_in_wal_mode(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / FILENAME, commit_window_s=0.05)
    ledger.start()
    main = threading.get_ident()
    for i in range(250):
        ledger.append(row(i))
    assert ledger.flush()
    assert count(tmp_path / FILENAME) == 250
    assert ledger._thread is not None and ledger._thread.ident != main
    [mode] = ledger.read("PRAGMA journal_mode")
    assert mode[0] == "wal"
    [total] = ledger.read("SELECT SUM(output_tokens) AS s FROM requests")
    assert total["s"] == sum(range(250))
    ledger.close()


def test_close_commits_rows_appended_just_before(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / FILENAME, commit_window_s=30.0)  # would not commit on its own for 30 s
    ledger.start()
    for i in range(10):
        ledger.append(row(i))
    ledger.close()
    assert count(tmp_path / FILENAME) == 10


def _child(tmp_path: Path, window: float, batch: int, batches: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path), str(window), str(batch), str(batches)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_sigterm_flushes_every_metered_row(tmp_path: Path) -> None:
    proc = _child(tmp_path, window=30.0, batch=40, batches=1)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "metered 40"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert count(tmp_path / FILENAME) == 40


def test_kill_9_loses_at_most_the_last_commit_window(tmp_path: Path) -> None:
    window = 0.2
    proc = _child(tmp_path, window=window, batch=30, batches=2)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "metered 30"
    # The child waits three windows before the second batch: the first must be committed by then.
    assert proc.stdout.readline().strip() == "metered 60"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    survived = count(tmp_path / FILENAME)
    assert 30 <= survived <= 60
