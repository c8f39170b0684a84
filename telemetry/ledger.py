"""The usage ledger: one SQLite (WAL) row per request, written in groups by a thread of its own.

Durability: a row is committed at most `commit_window_s` (default 200 ms) after it was appended,
with `synchronous=NORMAL`, which in WAL mode survives a crash of the process. So `kill -9` loses
at most the rows appended during the last commit window (plus the commit in flight); `close()`
(called on shutdown and SIGTERM) commits everything appended before it.

Robustness: no row can stop the ledger. A group that fails to commit (whatever the error) is
retried row by row, so one bad row costs only itself; dropped rows are logged and counted in
`failed` (exported on /metrics). Should the writer thread die all the same (a bug), the next
`append`, `flush` or `close` notices, logs it loudly and starts a new writer.

Rollups: in the same transaction as its rows, the writer adds them to pre-aggregated UTC-aligned
buckets: per tenant and lane of 15 minutes, 1 hour and 1 day (`rollup_lane`), per tenant, app,
model and lane of 1 hour and 1 day (`rollup`), and histograms per tenant of 1 hour and 1 day
(`rollup_hist`: latency, TTFT, edge confidence, cache similarity, escalation and route reasons).
`ledger_meta.rollup_through` is the highest row id they include: the rollups hold exactly the
rows up to it, so a reader that finds it equal to `MAX(id)` can trust them (the dashboard reads
them, telemetry/dashboard.py). Rows written before the rollups existed (or by an older version
in between) are rolled up by the writer in chunks of CATCH_UP_ROWS, whenever it is idle and after
each group it commits; until it has caught up, readers total the raw rows instead.

Retention (telemetry/retention.py): with a `Retention`, the writer also deletes rows older than
it once the rollups include them, a few thousand at a time between its commits, so the file
stops growing; readers then read that span from the rollups alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from telemetry.retention import PRUNE_INTERVAL_S, Retention, prune_step, read_horizons

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
# The WAL is cut back to this after a checkpoint (it otherwise keeps its largest size for ever).
WAL_SIZE_LIMIT = 64 * 1024 * 1024


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
    # Added with the dashboard; older files get them by ALTER TABLE (`_migrate`).
    route_reason: str | None = None  # why the router chose the lane (RouteDecision.reason)
    confidence: float | None = None  # the cascade's confidence in an edge answer (EdgeCheck)
    escalated: bool = False  # the edge answer failed its check and the upstream answered instead
    edge_tokens: int = 0  # edge tokens spent on the request (input + output of the checked answer)
    escalation_reason: str | None = None  # EdgeCheck.reason of an escalated request
    cache_similarity: float | None = None  # similarity of the cache entry that answered (hits)
    trace_id: str | None = None  # 32 hex digits of the request's trace, when it has one
    api: str = "chat"  # the wire API it came in through: chat, completions, embeddings, messages, responses
    tier: str | None = None  # upstream tier ("cost" | "strong") of an `auto` request, where the policy has tiers
    # counterfactual cost - cost: had it gone to the strong tier / to the model the client named
    # (telemetry/billing.py); NULL in rows written before, which read as the saved_* sum
    saved_vs_strong: float | None = None
    saved_vs_named: float | None = None
    # a semantic hit's score where the cache's error bound applies to it: the verifier's
    # probability, or the cosine with the verifier off (policies/cache/error_bound.py)
    cache_score: float | None = None
    # one conversation's key (an agent session, a Responses chain), within the tenant; NULL when none
    session: str | None = None
    cache_write_tokens: int = 0  # input tokens written to the provider's prompt cache (priced as writes)
    # operation `judge` (a shadow re-ask, gateway/pipeline/shadow.py): the tenant and app of the request
    # judged (tenant/app are the payer's: the operator's own line unless shadow.bill_judging_to: tenant)
    judged_tenant: str | None = None
    judged_app: str | None = None
    # observation masking (trim.agent_context): its mode, the tokens it cleared (or would have, in
    # shadow mode), the cached prefix a step rewrote, and the net saving priced at the cache prices
    mask_mode: str | None = None
    masked_tokens: int = 0
    mask_write_tokens: int = 0
    saved_mask: float = 0.0
    # its priority class (interactive, standard, batch); rows written before read as interactive, what
    # every request was then. Raw rows only: per-class figures cover the rows kept (not the rollups)
    priority: str = "interactive"

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
    route_score REAL,
    route_reason TEXT,
    confidence REAL,
    escalated INTEGER NOT NULL DEFAULT 0,
    edge_tokens INTEGER NOT NULL DEFAULT 0,
    escalation_reason TEXT,
    cache_similarity REAL,
    trace_id TEXT,
    tier TEXT,
    saved_vs_strong REAL,
    saved_vs_named REAL,
    cache_score REAL,
    session TEXT,
    cache_write_tokens INTEGER NOT NULL DEFAULT 0,
    mask_mode TEXT,
    masked_tokens INTEGER NOT NULL DEFAULT 0,
    mask_write_tokens INTEGER NOT NULL DEFAULT 0,
    saved_mask REAL NOT NULL DEFAULT 0,
    judged_tenant TEXT,
    judged_app TEXT,
    priority TEXT NOT NULL DEFAULT 'interactive'
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
CREATE INDEX IF NOT EXISTS requests_tenant_day ON requests (tenant, app, day);
CREATE INDEX IF NOT EXISTS requests_request_id ON requests (request_id);
"""

# Columns added after the first release, with their declarations: `_migrate` adds those an
# existing file lacks (ALTER TABLE ... ADD COLUMN; the defaults fill the old rows).
ADDED_COLUMNS: dict[str, str] = {
    "route_reason": "TEXT",
    "confidence": "REAL",
    "escalated": "INTEGER NOT NULL DEFAULT 0",
    "edge_tokens": "INTEGER NOT NULL DEFAULT 0",
    "escalation_reason": "TEXT",
    "cache_similarity": "REAL",
    "trace_id": "TEXT",
    "api": "TEXT NOT NULL DEFAULT 'chat'",
    "tier": "TEXT",
    "saved_vs_strong": "REAL",
    "saved_vs_named": "REAL",
    "cache_score": "REAL",
    "session": "TEXT",
    "cache_write_tokens": "INTEGER NOT NULL DEFAULT 0",
    "mask_mode": "TEXT",
    "masked_tokens": "INTEGER NOT NULL DEFAULT 0",
    "mask_write_tokens": "INTEGER NOT NULL DEFAULT 0",
    "saved_mask": "REAL NOT NULL DEFAULT 0",
    "judged_tenant": "TEXT",
    "judged_app": "TEXT",
    "priority": "TEXT NOT NULL DEFAULT 'interactive'",
}

# Rollup tables: name -> (keys, bucket lengths in seconds, longest first). Buckets are aligned to
# UTC. Every time zone in use today is a whole number of quarters off UTC, so its local hours and
# days are unions of quarter, hour and day buckets: the narrow table keeps quarters for the series
# in such zones; the wide one (every key) keeps hours and days, its ragged ends read as raw rows.
ROLLUP_TABLES: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "rollup_lane": (("tenant", "lane"), (86400, 3600, 900)),
    "rollup": (("tenant", "app", "model", "lane"), (86400, 3600)),
}
HIST_LEVELS: tuple[int, ...] = (86400, 3600)
# Bumped whenever the rollups change shape or meaning: a writer then rebuilds them from the rows.
# A file whose old rows were pruned cannot be rebuilt (the writer refuses to open it): a new
# version must then migrate the old rollups instead.
ROLLUP_VERSION = 4
# A judging re-ask's row (operation `judge`, gateway/pipeline/shadow.py) is spend, not a request:
# the request measures leave it out, the judge_* ones count it.
REQUEST = "operation != 'judge'"
JUDGING = "operation = 'judge'"
# Rollup column -> what one ledger row adds to it (an SQL expression over `requests`). A reader
# that totals raw rows uses the same expressions, so rollups and raw rows always agree.
ROLLUP_MEASURES: dict[str, str] = {
    "requests": REQUEST,
    "errors": f"status >= 400 AND {REQUEST}",
    "rejected": f"status = 429 AND {REQUEST}",
    "input_tokens": f"CASE WHEN {REQUEST} THEN input_tokens ELSE 0 END",
    "output_tokens": f"CASE WHEN {REQUEST} THEN output_tokens ELSE 0 END",
    "cached_input_tokens": "cached_input_tokens",
    "cache_write_tokens": "cache_write_tokens",
    "trimmed_tokens": "trimmed_tokens",
    "estimated_requests": "estimated",
    "cost": f"CASE WHEN {REQUEST} THEN cost ELSE 0.0 END",
    "saved_cache": "saved_cache",
    "saved_edge": "saved_edge",
    "saved_trim": "saved_trim",
    "saved_vs_strong": "COALESCE(saved_vs_strong, saved_cache + saved_edge + saved_trim)",
    "saved_vs_named": "COALESCE(saved_vs_named, saved_cache + saved_edge + saved_trim)",
    "cache_hits": "cache_status = 'hit'",
    "cache_lookups": "cache_status IN ('hit', 'miss')",
    "local": "lane IN ('cache', 'edge') AND status < 400",
    "edge_requests": "lane = 'edge'",
    "escalated": "escalated",
    "edge_tokens": "edge_tokens",
    "ok": f"status < 400 AND {REQUEST}",
    "latency_ms": f"CASE WHEN status < 400 AND {REQUEST} THEN latency_ms ELSE 0.0 END",
    "ttft_n": "status < 400 AND ttft_ms IS NOT NULL",
    "ttft_ms": "CASE WHEN status < 400 THEN COALESCE(ttft_ms, 0.0) ELSE 0.0 END",
    "confidence_n": "confidence IS NOT NULL",
    "confidence": "COALESCE(confidence, 0.0)",
    "judge_requests": JUDGING,
    "judge_input_tokens": f"CASE WHEN {JUDGING} THEN input_tokens ELSE 0 END",
    "judge_output_tokens": f"CASE WHEN {JUDGING} THEN output_tokens ELSE 0 END",
    "judge_cost": f"CASE WHEN {JUDGING} THEN cost ELSE 0.0 END",
}
REAL_MEASURES = frozenset({"cost", "judge_cost", "saved_cache", "saved_edge", "saved_trim", "saved_vs_strong",
                           "saved_vs_named",
                           "latency_ms", "ttft_ms", "confidence"})

# Histograms: bins of 1/16 of a doubling for times (a bin's upper edge is 4.4% above its lower
# one), twentieths for values in 0..1; reasons are kinds of their own with one bin (0).
LOG_BINS_PER_DOUBLING = 16
UNIT_BINS = 20
REASON_MAX_CHARS = 64


def log_bin(column: str) -> str:
    """The SQL bin of a time in ms: bin b holds [2**(b/16), 2**((b+1)/16)); 0 and below go to 2**-10 ms."""
    return f"CAST(floor({LOG_BINS_PER_DOUBLING} * log2(max({column}, 0.001))) AS INTEGER)"


def unit_bin(column: str) -> str:
    """The SQL bin of a value in 0..1: bin b holds [b/20, (b+1)/20) (1.0 in the last; clamped)."""
    return f"CAST(min({UNIT_BINS - 1}, max(0, floor({column} * {UNIT_BINS}))) AS INTEGER)"


# kind -> (bin expression, which rows count); over `requests`, like ROLLUP_MEASURES.
ROLLUP_HISTOGRAMS: dict[str, tuple[str, str]] = {
    "latency_ms": (log_bin("latency_ms"), f"status < 400 AND {REQUEST}"),
    "ttft_ms": (log_bin("ttft_ms"), "status < 400 AND ttft_ms IS NOT NULL"),
    "confidence_served": (unit_bin("confidence"), "confidence IS NOT NULL AND NOT escalated"),
    "confidence_escalated": (unit_bin("confidence"), "confidence IS NOT NULL AND escalated"),
    "cache_similarity": (unit_bin("cache_similarity"), "cache_similarity IS NOT NULL"),
}
# Reason counts, as histogram kinds `prefix + reason` with the single bin 0.
REASON_KINDS: dict[str, tuple[str, str]] = {
    "escalation:": (f"substr(COALESCE(escalation_reason, 'unknown'), 1, {REASON_MAX_CHARS})", "escalated"),
    "route:": (f"substr(route_reason, 1, {REASON_MAX_CHARS})", "route_reason IS NOT NULL"),
}


def bucket_sql(ts: str, level: str) -> str:
    """The start of the UTC-aligned bucket of length `level` holding `ts` (floor, exact at the edges)."""
    q = f"CAST({ts} / {level} AS INTEGER) * {level}"
    return f"({q} - CASE WHEN {q} > {ts} THEN {level} ELSE 0 END)"


def hist_source_sql(where: str, join: str = "") -> str:
    """(ts, tenant, kind, bin) of every histogram entry of the `requests` rows matching `where`
    (`join`: tables joined before `requests`, e.g. "spans s CROSS JOIN ")."""
    head = "SELECT requests.ts AS ts, requests.tenant AS tenant"
    parts = [
        f"{head}, '{kind}' AS kind, {expr} AS bin FROM {join}requests WHERE ({where}) AND {cond}"
        for kind, (expr, cond) in ROLLUP_HISTOGRAMS.items()
    ]
    parts += [
        f"{head}, '{prefix}' || {expr} AS kind, 0 AS bin FROM {join}requests WHERE ({where}) AND {cond}"
        for prefix, (expr, cond) in REASON_KINDS.items()
    ]
    return " UNION ALL ".join(parts)


def _rollup_table(name: str, keys: tuple[str, ...]) -> str:
    measures = ", ".join(f"{m} {'REAL' if m in REAL_MEASURES else 'INTEGER'} NOT NULL DEFAULT 0" for m in ROLLUP_MEASURES)
    key_columns = ", ".join(f"{k} TEXT NOT NULL" for k in keys)
    return (f"CREATE TABLE IF NOT EXISTS {name} (level INTEGER NOT NULL, start INTEGER NOT NULL, {key_columns}, {measures}, "
            f"PRIMARY KEY (level, start, {', '.join(keys)})) WITHOUT ROWID")  # fmt: skip


_META_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO ledger_meta (key, value) VALUES ('rollup_through', 0);
CREATE INDEX IF NOT EXISTS requests_errors ON requests (ts) WHERE status >= 400;
"""
_ROLLUP_TABLES_SQL = (
    *(_rollup_table(name, keys) for name, (keys, _) in ROLLUP_TABLES.items()),
    "CREATE TABLE IF NOT EXISTS rollup_hist (level INTEGER NOT NULL, start INTEGER NOT NULL, tenant TEXT NOT NULL, "
    "kind TEXT NOT NULL, bin INTEGER NOT NULL, n INTEGER NOT NULL, PRIMARY KEY (level, start, tenant, kind, bin)) WITHOUT ROWID",
)
ROLLUP_TABLE_NAMES = (*ROLLUP_TABLES, "rollup_hist")


def _levels_cte(levels: tuple[int, ...]) -> str:
    return "levels(level) AS (VALUES " + ", ".join(f"({level})" for level in levels) + ")"


def _roll_sql(name: str, keys: tuple[str, ...], levels: tuple[int, ...]) -> str:
    return f"""
WITH {_levels_cte(levels)}
INSERT INTO {name} (level, start, {", ".join(keys)}, {", ".join(ROLLUP_MEASURES)})
SELECT levels.level, {bucket_sql("requests.ts", "levels.level")}, {", ".join(keys)},
       {", ".join(f"SUM({expr})" for expr in ROLLUP_MEASURES.values())}
FROM requests CROSS JOIN levels
WHERE requests.id > :lo AND requests.id <= :hi
GROUP BY {", ".join(str(i) for i in range(1, len(keys) + 3))}
ON CONFLICT (level, start, {", ".join(keys)}) DO UPDATE SET
    {", ".join(f"{m} = {m} + excluded.{m}" for m in ROLLUP_MEASURES)}
"""


_ROLLS = tuple(_roll_sql(name, keys, levels) for name, (keys, levels) in ROLLUP_TABLES.items())
_ROLL_HIST = f"""
WITH {_levels_cte(HIST_LEVELS)}, src AS ({hist_source_sql("requests.id > :lo AND requests.id <= :hi")})
INSERT INTO rollup_hist (level, start, tenant, kind, bin, n)
SELECT levels.level, {bucket_sql("src.ts", "levels.level")}, src.tenant, src.kind, src.bin, COUNT(*)
FROM src CROSS JOIN levels
WHERE true
GROUP BY 1, 2, 3, 4, 5
ON CONFLICT (level, start, tenant, kind, bin) DO UPDATE SET n = n + excluded.n
"""
# Rows rolled up per transaction when a writer catches up an existing ledger.
CATCH_UP_ROWS = 50_000

_INSERT = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"


def _values(row: LedgerRow) -> tuple[Any, ...]:
    return tuple(getattr(row, name) for name in COLUMNS)


@dataclass(slots=True)
class _Flush:
    done: threading.Event


@dataclass(slots=True)
class _Prune:
    done: threading.Event


class _Stop:
    pass


class Ledger:
    """Appends are non-blocking (a queue put); the writer thread commits them in groups."""

    def __init__(
        self,
        path: Path,
        *,
        commit_window_s: float = DEFAULT_COMMIT_WINDOW_S,
        retention: Retention | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.commit_window_s = commit_window_s
        self.retention = retention if retention is not None and retention.prunes else None
        self._wall = wall
        self.written = 0
        self.failed = 0  # rows dropped: their write failed, or their writer died with them
        self.restarts = 0  # writers restarted after one died
        # NOTE: the queue is the only state shared with the writer thread; the SQLite
        # connection is created and used by that thread alone.
        self._queue: queue.SimpleQueue[LedgerRow | _Flush | _Prune | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._urgent = threading.Event()
        self._error: BaseException | None = None
        # Guards (re)starting the writer: append() runs on the event loop, flush() on workers.
        self._lock = threading.Lock()
        self._closing = False
        self._next_restart = 0.0
        # The rollups' watermark as the writer knows it (writer thread only); None: not kept up.
        self._rolled: int | None = None
        self._next_prune = 0.0  # monotonic time of the next pruning pass (writer thread only)

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

    def prune(self, timeout: float | None = 30.0) -> bool:
        """Commit what was appended, then apply the retention to the end (blocking); False when not
        started or the timeout passed. The writer also does this on its own, a step at a time."""
        if self._thread is None:
            return False
        self._revive()
        done = threading.Event()
        self._queue.put(_Prune(done))
        self._urgent.set()
        return done.wait(timeout)

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

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[sqlite3.Connection | None]:
        """A read-only connection in one read transaction (every query sees the same rows); None
        when there is no ledger file yet. Blocking: use it on a worker thread."""
        if not self.path.exists():
            yield None
            return
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10.0, isolation_level=None)
        try:
            conn.row_factory = sqlite3.Row
            prepare(conn)
            conn.execute("BEGIN")
            yield conn
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
            conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            prepare(conn)
            conn.executescript(_SCHEMA)
            _migrate(conn)
            self._rolled = _start_rollups(conn)
            # NOTE: not at start-up, where the gateway has enough to do: the first pass one interval in
            self._next_prune = time.monotonic() + PRUNE_INTERVAL_S
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
            if self._lagging(conn) or self._prune_due():
                # background work (catching up, pruning): a step whenever nothing waits
                try:
                    first = self._queue.get_nowait()
                except queue.Empty:
                    self._background(conn)
                    continue
            else:
                try:
                    first = self._queue.get(timeout=self._until_prune())
                except queue.Empty:
                    continue
            # NOTE: the writer sleeps out the commit window instead of waking for every row:
            # a per-row wake-up makes each append a GIL hand-off that the event loop pays for.
            # flush(), prune() and close() cut the wait short through `_urgent`.
            if isinstance(first, LedgerRow):
                self._urgent.wait(self.commit_window_s)
            self._urgent.clear()
            waiters: list[threading.Event] = []
            prunes: list[threading.Event] = []
            stop = False
            batch: list[LedgerRow] = []
            for item in [first, *self._drain_all()]:
                if isinstance(item, LedgerRow):
                    batch.append(item)
                elif isinstance(item, _Flush):
                    waiters.append(item.done)
                elif isinstance(item, _Prune):
                    prunes.append(item.done)
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
            if prunes:
                try:
                    while self._prune_once(conn):
                        pass
                finally:
                    for done in prunes:
                        done.set()
            if stop:
                return
            if self._lagging(conn) or self._prune_due():
                self._background(conn)

    def _lagging(self, conn: sqlite3.Connection) -> bool:
        return self._rolled is not None and self._rolled < _max_id(conn)

    def _prune_due(self) -> bool:
        return self.retention is not None and self._rolled is not None and time.monotonic() >= self._next_prune

    def _until_prune(self) -> float | None:
        """How long an idle writer may wait for rows before its next pruning pass (None: for ever)."""
        if self.retention is None or self._rolled is None:
            return None
        return max(0.0, self._next_prune - time.monotonic())

    def _background(self, conn: sqlite3.Connection) -> None:
        if self._lagging(conn):
            self._catch_up(conn)
        elif self._prune_due():
            self._prune_once(conn)

    def _prune_once(self, conn: sqlite3.Connection) -> bool:
        """One pruning step; when nothing is left (or it failed), the next pass is PRUNE_INTERVAL_S away."""
        retention, through = self.retention, self._rolled
        if retention is None or through is None:
            return False
        try:
            more = prune_step(conn, retention, self._wall(), through)
        except Exception:
            # NOTE: nothing is lost: the rows stay until a later pass deletes them.
            log.exception("ledger pruning failed; trying again in %.0f s", PRUNE_INTERVAL_S)
            _rollback(conn)
            more = False
        if not more:
            self._next_prune = time.monotonic() + PRUNE_INTERVAL_S
        return more

    def _catch_up(self, conn: sqlite3.Connection) -> None:
        """Add the next CATCH_UP_ROWS rows past the rollups' watermark to them (one transaction)."""
        through = self._rolled
        if through is None:
            return
        try:
            conn.execute("BEGIN IMMEDIATE")
            upto = min(_max_id(conn), through + CATCH_UP_ROWS)
            _roll(conn, through, upto)
            conn.execute("COMMIT")
        except Exception:
            # NOTE: the rollups stay behind (readers then total raw rows): correct, only slower.
            log.exception("ledger rollups cannot catch up; the dashboard reads raw rows until a restart")
            _rollback(conn)
            self._rolled = None
            return
        self._rolled = upto
        if upto == _max_id(conn):
            log.info("ledger rollups caught up (%d rows)", upto)

    def _drain_all(self) -> list[LedgerRow | _Flush | _Prune | _Stop]:
        items: list[LedgerRow | _Flush | _Prune | _Stop] = []
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
            self._commit(conn, batch)
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
                self._commit(conn, [row])  # a transaction of its own
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

    def _commit(self, conn: sqlite3.Connection, rows: list[LedgerRow]) -> None:
        """Insert rows and, when the rollups are current, add them there, in one transaction."""
        values = [_values(row) for row in rows]
        conn.execute("BEGIN IMMEDIATE")
        last = _max_id(conn)
        conn.executemany(_INSERT, values)
        rolled = self._rolled
        if rolled is not None and rolled == last:
            rolled = _max_id(conn)
            _roll(conn, last, rolled)
        conn.execute("COMMIT")
        self._rolled = rolled


def prepare(conn: sqlite3.Connection) -> None:
    """SQL math functions for a SQLite built without them (the histogram bins use log2 and floor)."""
    try:
        conn.execute("SELECT log2(2.0), floor(1.5)").fetchone()
    except sqlite3.OperationalError:
        conn.create_function("log2", 1, lambda x: None if x is None else math.log2(x), deterministic=True)
        conn.create_function("floor", 1, lambda x: None if x is None else math.floor(x), deterministic=True)


def _max_id(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT COALESCE(MAX(id), 0) FROM requests").fetchone()[0])


def _migrate(conn: sqlite3.Connection) -> None:
    """Add the columns an older ledger file lacks (ADDED_COLUMNS)."""
    present = {row[1] for row in conn.execute("PRAGMA table_info(requests)")}
    for name, declaration in ADDED_COLUMNS.items():
        if name not in present:
            conn.execute(f"ALTER TABLE requests ADD COLUMN {name} {declaration}")
            log.info("ledger: added column %s to %s", name, "requests")


def _start_rollups(conn: sqlite3.Connection) -> int:
    """Create the rollups (rebuilt from nothing when their version changed or they include rows that
    are gone, unless rows were pruned: they are the only record of those) and return their watermark."""
    conn.executescript(_META_SCHEMA)
    version = conn.execute("SELECT value FROM ledger_meta WHERE key = 'rollup_version'").fetchone()
    through = int(conn.execute("SELECT value FROM ledger_meta WHERE key = 'rollup_through'").fetchone()[0])
    last = _max_id(conn)
    pruned = read_horizons(conn).rows_from > 0
    if pruned and version is not None and int(version[0]) != ROLLUP_VERSION:
        raise RuntimeError(f"the ledger's rollups are version {version[0]}, this gateway's {ROLLUP_VERSION}, and the rows "
                           "they were built from are past retention: they cannot be rebuilt")  # fmt: skip
    if pruned and through > last:
        # NOTE: pruning keeps the newest row, so only a hand-edited file gets here: keep the history.
        log.error("the ledger lost rows its rollups include (past row %d); keeping the rollups", last)
        conn.execute("UPDATE ledger_meta SET value = ? WHERE key = 'rollup_through'", (last,))
        through = last
    if version is None or int(version[0]) != ROLLUP_VERSION or through > last:
        if version is not None:
            log.warning("ledger rollups are outdated or include rows that are gone: rebuilding them")
        conn.execute("BEGIN IMMEDIATE")
        for name in ROLLUP_TABLE_NAMES:
            conn.execute(f"DROP TABLE IF EXISTS {name}")
        for create in _ROLLUP_TABLES_SQL:
            conn.execute(create)
        conn.execute("INSERT OR REPLACE INTO ledger_meta (key, value) VALUES ('rollup_version', ?)", (ROLLUP_VERSION,))
        conn.execute("UPDATE ledger_meta SET value = 0 WHERE key = 'rollup_through'")
        conn.execute("COMMIT")
        through = 0
    if through < last:
        log.info("ledger rollups are %d rows behind; catching up in the background", last - through)
    return through


def _roll(conn: sqlite3.Connection, lo: int, hi: int) -> None:
    """Add the rows with ids in (lo, hi] to the rollups and move the watermark to hi (inside a transaction)."""
    if hi > lo:
        for sql in _ROLLS:
            conn.execute(sql, {"lo": lo, "hi": hi})
        conn.execute(_ROLL_HIST, {"lo": lo, "hi": hi})
    conn.execute("UPDATE ledger_meta SET value = ? WHERE key = 'rollup_through'", (hi,))


def _rollback(conn: sqlite3.Connection) -> None:
    """End a failed transaction, if one is still open."""
    try:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass
