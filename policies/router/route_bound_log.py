"""Where the routing quality bound's observations are kept: a log every replica folds in one order.

The bound's state (policies/router/route_bound.py) is a pure fold over its observations, so keeping it
means keeping the observations in order, and sharing it means every replica folding the same
order. Two logs:

- `LocalBoundLog` (`state.backend: embedded`): `<state_dir>/route_bound.log` (one JSON line per
  observation, numbered, applied as it is written) beside `route_bound.states/`, one small file
  per (scope, region) state holding the number of the last line folded into it. At start the
  state files are read and the log's lines applied, except a line a state's file already holds
  (a crash between a snapshot and the log's truncation loses nothing and counts nothing twice).
  Every `compact_every` lines, and at close, the states changed since the last snapshot are
  written, each to its own file (atomically), a few at a time on a worker thread, and the log
  emptied: the work is O(changed), and the event loop (the route stage takes the bound's lock)
  waits at most a few milliseconds at a time. A torn last line (a crash mid-write) is skipped.
- `SharedBoundLog` (`state.backend: redis`): the stream `<prefix>route:obs` (capped at about
  `stream_max_len` events), the hash `<prefix>route:states` (a record per state, keyed by its
  [tenant, app, region]), the hash `<prefix>route:state_at` (the stream id of the last event each
  record holds) and `<prefix>route:snapshot` {id, v}. A replica does not apply its own
  observation when it makes it: it XADDs it, and its follower applies every event, its own
  included, in stream order, so all replicas hold one state. At start: the state records, then
  the stream after the snapshot id (an event a record already holds is skipped), then the
  follower. Every `snapshot_every` events a replica writes the states changed since its last
  snapshot, a few per script call (a record is kept only if its event id is later than the one
  stored), then offers its position as the snapshot id (kept only if later). A replica whose
  snapshot position was trimmed from the stream starts from what is left and says so in the
  log (with the defaults that needs 100,000 judgements between two snapshots of every 1,000).

Older formats are still read: `route_bound.snapshot.json` (and log lines without a number), and
the shared snapshot's single `state` field; their scopes were `tenant/app` joined, split at the
first `/`. Their states are all written in the new format at the next snapshot, which then
removes the old one.

Writing or reading the shared log never waits on the request path: observations come from the
shadow stage, in the background; a store that fails loses that observation (counted in
`errors`), never the request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from policies.router.route_bound import At, QualityBound, RouteBounds, Scope
from policies.task_stop import cancel_and_wait

log = logging.getLogger(__name__)

LOG_FILE = "route_bound.log"
SNAPSHOT_FILE = "route_bound.snapshot.json"  # the older format: every state in one file
STATES_DIR = "route_bound.states"
# states per step of a snapshot: each step holds the bound's lock, and the interpreter, a few ms
SNAPSHOT_CHUNK = 16


def _event(scope: Scope, region: int, params: QualityBound, score: float, disagree: bool) -> dict[str, Any]:
    return {"t": scope.tenant, "a": scope.app, "r": region, "p": params.as_dict(), "x": score, "d": int(disagree)}


def _scope(event: dict[str, Any]) -> Scope:
    if "t" in event:
        return Scope(str(event["t"]), str(event["a"]))
    return Scope.from_text(str(event["s"]))  # the older format


def _apply(bounds: RouteBounds, event: dict[str, Any], at: At) -> bool:
    return bounds.observe(_scope(event), int(event["r"]), QualityBound.from_dict(event["p"]), float(event["x"]),
                          disagree=bool(event["d"]), at=at)  # fmt: skip


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _parse_all(texts: list[Any]) -> list[dict[str, Any]]:
    return [json.loads(text) for text in texts]


def _key_text(scope: Scope, region: int) -> str:
    return _dumps([scope.tenant, scope.app, region])


def _state_file(scope: Scope, region: int) -> str:
    return hashlib.sha256(_key_text(scope, region).encode()).hexdigest()[:40] + ".json"


class LocalBoundLog:
    """This process's observations on disk: kept across restarts."""

    def __init__(self, directory: Path, bounds: RouteBounds | None = None, *, compact_every: int = 2000) -> None:
        self.bounds = bounds or RouteBounds()
        self._dir = directory
        self._compact_every = compact_every
        self._lines = 0
        self._seq = 0  # the number of the last line written (or restored)
        self._legacy = False  # restored from the older single-file snapshot: removed once the states are written
        self._fh: Any = None
        # a write and a compaction never interleave: a line written between the snapshot and the
        # truncation would be lost, one written after close() would fail
        self._writing = asyncio.Lock()
        self.errors = 0
        self.restored = 0  # observations applied from the log at start (after the snapshot)

    @property
    def log_path(self) -> Path:
        return self._dir / LOG_FILE

    @property
    def snapshot_path(self) -> Path:
        return self._dir / SNAPSHOT_FILE

    @property
    def states_dir(self) -> Path:
        return self._dir / STATES_DIR

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        self.states_dir.mkdir(parents=True, exist_ok=True)
        records = []
        for path in sorted(self.states_dir.glob("*.json")):
            try:
                records.append(json.loads(path.read_text(encoding="utf-8")))
            except (ValueError, OSError) as exc:  # written atomically: only a damaged disk gets here
                log.warning("route bound state %s unreadable, skipped: %s", path, exc)
        if self.snapshot_path.is_file():  # the older format, and the state files written since (newer) over it
            try:
                records = list(json.loads(self.snapshot_path.read_text(encoding="utf-8"))["states"]) + records
                self._legacy = True  # every state is written again, then the older file goes
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("route bound snapshot %s unreadable, starting without it: %s", self.snapshot_path, exc)
        skipped = self.bounds.restore_records(records, changed=self._legacy) if records else 0
        if skipped:
            log.warning("route bound: %d unreadable state records in %s skipped", skipped, self._dir)
        self._seq = self.bounds.at[0]
        unnumbered = 0  # the older format's lines: after its snapshot (whose states are at 0), numbered in order
        if self.log_path.is_file():
            with self.log_path.open(encoding="utf-8") as fh:
                for line in fh:
                    try:
                        event = json.loads(line)
                        number = event.get("q")
                        seq = unnumbered + 1 if number is None else int(number)
                        unnumbered += number is None
                        applied = _apply(self.bounds, event, (seq, 0))
                    except (ValueError, KeyError, TypeError, AttributeError):
                        continue  # a torn last line
                    self._seq = max(self._seq, seq)
                    self.restored += applied
                    self._lines += 1
        self._fh = self.log_path.open("a", encoding="utf-8")

    async def record(self, scope: Scope, region: int, params: QualityBound, score: float, *, disagree: bool) -> None:
        async with self._writing:
            self._seq += 1
            self.bounds.observe(scope, region, params, score, disagree=disagree, at=(self._seq, 0))
            if self._fh is None:
                return
            try:
                self._fh.write(_dumps({**_event(scope, region, params, score, disagree), "q": self._seq}) + "\n")
                self._fh.flush()
                self._lines += 1
                if self._lines >= self._compact_every:
                    await self._compact()
            except OSError as exc:
                self.errors += 1
                log.warning("route bound log %s not written: %s", self.log_path, exc)

    async def _compact(self) -> None:
        """The states changed since the last compaction to their files, a few per step on a worker
        thread (the loop gets the interpreter back between steps), then the log starts again."""
        while await asyncio.to_thread(self._write_some):
            pass
        if self._legacy:
            self.snapshot_path.unlink(missing_ok=True)
            self._legacy = False
        if self._fh is not None:
            self._fh.close()
        self._fh = self.log_path.open("w", encoding="utf-8")
        self._lines = 0

    def _write_some(self) -> bool:
        records, dropped = self.bounds.take_changes(SNAPSHOT_CHUNK)
        try:
            for (scope, region), record in records:
                path = self.states_dir / _state_file(scope, region)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(_dumps(record), encoding="utf-8")
                os.replace(tmp, path)
            for (scope, region), _ in dropped:
                (self.states_dir / _state_file(scope, region)).unlink(missing_ok=True)
        except BaseException:
            self.bounds.give_back([key for key, _ in records], dropped)
            raise
        return bool(records or dropped)

    async def close(self) -> None:
        async with self._writing:
            if self._fh is None:
                return
            try:
                await self._compact()
            except OSError as exc:
                log.warning("route bound snapshot not written at close: %s", exc)
            self._fh.close()
            self._fh = None


_LATER_LUA = """
local function later(x, y)
  local a, b = string.match(x, '(%d+)-(%d+)')
  local c, d = string.match(y, '(%d+)-(%d+)')
  a, b, c, d = tonumber(a), tonumber(b), tonumber(c), tonumber(d)
  return a > c or (a == c and b > d)
end
"""
# State records (ARGV: field, stream id, body, ...; an empty body: the state was dropped), each kept
# only when its stream id is later than the stored one's: a replica behind never undoes one ahead.
_STATES_LUA = _LATER_LUA + """
local kept = 0
for i = 1, #ARGV, 3 do
  local cur = redis.call('HGET', KEYS[2], ARGV[i])
  if not cur or later(ARGV[i + 1], cur) then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
    if ARGV[i + 2] == '' then redis.call('HDEL', KEYS[1], ARGV[i]) else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2]) end
    kept = kept + 1
  end
end
return kept
"""
# The snapshot's position, once the states up to it are written: kept only when later than the
# stored one's. ARGV[2] == '1': the writer wrote every state, the older single-field snapshot goes.
_SNAPSHOT_LUA = _LATER_LUA + """
local cur = redis.call('HGET', KEYS[1], 'id')
if cur and not later(ARGV[1], cur) then return 0 end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'v', '2')
if ARGV[2] == '1' then redis.call('HDEL', KEYS[1], 'state') end
return 1
"""
_BLOCK_MS = 1000
_READ_COUNT = 500


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SharedBoundLog:
    """Every replica's observations in one Redis/Valkey stream, folded in stream order by each."""

    def __init__(self, client: Any, follower: Any, *, key_prefix: str = "tierlane:", op_timeout_s: float = 0.1,
                 stream_max_len: int = 100_000, snapshot_every: int = 1000, bounds: RouteBounds | None = None) -> None:  # fmt: skip
        self.bounds = bounds or RouteBounds()
        self._client = client
        self._follower = follower
        self._stream = f"{key_prefix}route:obs"
        self._snapshot_key = f"{key_prefix}route:snapshot"
        self._states_key = f"{key_prefix}route:states"
        self._positions_key = f"{key_prefix}route:state_at"
        self._legacy = False
        self._timeout = op_timeout_s
        self._max_len = stream_max_len
        self._snapshot_every = snapshot_every
        self._last_id = "0-0"
        self._since_snapshot = 0
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self.errors = 0
        self.applied = 0

    @classmethod
    def connect(cls, url: str, *, key_prefix: str, connect_timeout_s: float, op_timeout_s: float,
                stream_max_len: int) -> SharedBoundLog:  # fmt: skip
        from policies.shared_state.redis_client import redis_client
        from policies.shared_state.redis_mux import MuxClient

        # writes share one multiplexed connection (policies/shared_state/redis_mux.py); the follower has its own, XREAD blocks it
        client = MuxClient(url, connect_timeout_s=connect_timeout_s, stale_after_s=max(1.0, 10 * op_timeout_s))
        follower = redis_client(url, connect_timeout_s=connect_timeout_s, read_timeout_s=_BLOCK_MS / 1000.0 + 1.0 + op_timeout_s)
        return cls(client, follower, key_prefix=key_prefix, op_timeout_s=op_timeout_s, stream_max_len=stream_max_len)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._follow())

    async def caught_up(self, timeout_s: float) -> bool:
        """Whether the snapshot and the stream present at start were applied within `timeout_s` (tests, /readyz)."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def record(self, scope: Scope, region: int, params: QualityBound, score: float, *, disagree: bool) -> None:
        body = _dumps(_event(scope, region, params, score, disagree))
        try:
            async with asyncio.timeout(max(1.0, 10 * self._timeout)):
                await self._client.call("XADD", self._stream, "MAXLEN", "~", self._max_len, "*", "e", body)
        except Exception as exc:  # noqa: BLE001 - a lost observation must never surface to anyone
            self.errors += 1
            log.warning("route bound observation not written to the shared store: %r", exc)

    async def _restore(self) -> None:
        snapshot_id, version = await self._follower.hmget(self._snapshot_key, ["id", "v"])
        restored = False
        if snapshot_id is not None and version is not None and _text(version) == "2":
            records: list[dict[str, Any]] = []
            cursor = 0
            while True:  # in chunks, each parsed off the loop: the states hold up to max_states x window judgements
                cursor, chunk = await self._follower.hscan(self._states_key, cursor, count=64)
                records.extend(await asyncio.to_thread(_parse_all, list(chunk.values())))
                if not cursor:
                    break
            await asyncio.to_thread(self.bounds.restore_records, records)
            restored = True
        elif snapshot_id is not None:
            state = await self._follower.hget(self._snapshot_key, "state")
            if state is not None:  # the older format: every state in one field
                await asyncio.to_thread(lambda: self.bounds.restore(json.loads(state), changed=True))
                self._legacy = restored = True
        if restored:
            self._last_id = _text(snapshot_id)
            first = await self._follower.xrange(self._stream, count=1)
            if first and _id_key(_text(first[0][0])) > _id_key(self._last_id):
                log.warning("route bound: the stream was trimmed past the snapshot (%s); starting from what is left",
                            self._last_id)  # fmt: skip
        while True:  # the stream present now, in chunks
            events = await self._follower.xrange(self._stream, min=f"({self._last_id}", count=_READ_COUNT)
            if not events:
                break
            self._apply(events)

    def _apply(self, events: list[Any]) -> None:
        for event_id, fields in events:
            self._last_id = _text(event_id)
            try:
                _apply(self.bounds, json.loads(fields.get(b"e") or fields.get("e")), _id_key(self._last_id))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("route bound: an unreadable observation %s skipped: %s", self._last_id, exc)
                continue
            self.applied += 1
            self._since_snapshot += 1

    async def _offer_snapshot(self) -> None:
        """The states changed since this replica's last snapshot, a few per call (taken and encoded
        off the loop), then its position; nothing is applied meanwhile (the follower waits here)."""
        self._since_snapshot = 0
        upto = self._last_id
        while True:
            keys, dropped, args = await asyncio.to_thread(self._encode_some)
            if not args:
                break
            try:
                await self._client.call("EVAL", _STATES_LUA, 2, self._states_key, self._positions_key, *args)
            except BaseException:
                self.bounds.give_back(keys, dropped)
                raise
        await self._client.call("EVAL", _SNAPSHOT_LUA, 1, self._snapshot_key, upto, "1" if self._legacy else "0")
        self._legacy = False

    def _encode_some(self) -> tuple[list[Any], list[Any], list[str]]:
        records, dropped = self.bounds.take_changes(SNAPSHOT_CHUNK)
        args: list[str] = []
        for (scope, region), record in records:
            args += [_key_text(scope, region), f"{record['at'][0]}-{record['at'][1]}", _dumps(record)]
        for (scope, region), at in dropped:
            args += [_key_text(scope, region), f"{at[0]}-{at[1]}", ""]
        return [key for key, _ in records], dropped, args

    async def _follow(self) -> None:
        failures = 0
        restored = False
        while True:
            try:
                if not restored:
                    await self._restore()
                    restored = True
                    self._ready.set()
                reply: Any = await self._follower.xread({self._stream: self._last_id}, count=_READ_COUNT, block=_BLOCK_MS)
                for _, events in reply or []:
                    self._apply(events)
                if self._since_snapshot >= self._snapshot_every:
                    await self._offer_snapshot()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the store is down or restarting: retry from the same position
                failures += 1
                if failures == 1:
                    log.warning("route bound stream unreadable, retrying: %r", exc)
                await asyncio.sleep(min(1.0, 0.1 * failures))

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        try:
            async with asyncio.timeout(1.0):
                if self._since_snapshot:
                    await self._offer_snapshot()
        except Exception as exc:  # noqa: BLE001 - the next replica folds the stream instead
            log.warning("route bound snapshot not offered at close: %r", exc)
        await self._client.close()
        await self._follower.aclose()


def _id_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms or 0), int(seq or 0)


BoundLog = LocalBoundLog | SharedBoundLog
