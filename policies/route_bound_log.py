"""Where the routing quality bound's observations are kept: a log every replica folds in one order.

The bound's state (policies/route_bound.py) is a pure fold over its observations, so keeping it
means keeping the observations in order, and sharing it means every replica folding the same
order. Two logs:

- `LocalBoundLog` (`state.backend: embedded`): `<state_dir>/route_bound.log` (one JSON line per
  observation, applied as it is written) beside `route_bound.snapshot.json`; at start the
  snapshot is restored and the lines after it applied; every `compact_every` lines, and at close,
  the snapshot is rewritten (atomically) and the log emptied. A torn last line (a crash mid-write)
  is skipped.
- `SharedBoundLog` (`state.backend: redis`): the stream `<prefix>route:obs` (capped at about
  `stream_max_len` events) and the snapshot hash `<prefix>route:snapshot` {id, state}. A replica
  does not apply its own observation when it makes it: it XADDs it, and its follower applies
  every event, its own included, in stream order, so all replicas hold one state. At start: the
  snapshot, then the stream after its id, then the follower. Every `snapshot_every` events a
  replica offers its snapshot; a script keeps it only if its id is later than the one stored.
  A replica whose snapshot position was trimmed from the stream starts from what is left and
  says so in the log (with the defaults that needs 100,000 judgements between two snapshots of
  every 1,000).

Writing or reading the shared log never waits on the request path: observations come from the
shadow stage, in the background; a store that fails loses that observation (counted in
`errors`), never the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

from policies.route_bound import QualityBound, RouteBounds
from policies.task_stop import cancel_and_wait

log = logging.getLogger(__name__)

LOG_FILE = "route_bound.log"
SNAPSHOT_FILE = "route_bound.snapshot.json"


def _event(scope: str, region: int, params: QualityBound, score: float, disagree: bool) -> dict[str, Any]:
    return {"s": scope, "r": region, "p": params.as_dict(), "x": score, "d": int(disagree)}


def _apply(bounds: RouteBounds, event: dict[str, Any]) -> None:
    bounds.observe(str(event["s"]), int(event["r"]), QualityBound.from_dict(event["p"]), float(event["x"]),
                   disagree=bool(event["d"]))  # fmt: skip


class LocalBoundLog:
    """This process's observations on disk: kept across restarts."""

    def __init__(self, directory: Path, bounds: RouteBounds | None = None, *, compact_every: int = 2000) -> None:
        self.bounds = bounds or RouteBounds()
        self._dir = directory
        self._compact_every = compact_every
        self._lines = 0
        self._fh: Any = None
        # a write and a compaction (on a worker thread) never interleave: a line written between the
        # snapshot and the truncation would be lost, one written after close() would fail
        self._writing = asyncio.Lock()
        self.errors = 0
        self.restored = 0  # observations applied from the log at start (after the snapshot)

    @property
    def log_path(self) -> Path:
        return self._dir / LOG_FILE

    @property
    def snapshot_path(self) -> Path:
        return self._dir / SNAPSHOT_FILE

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        if self.snapshot_path.is_file():
            try:
                self.bounds.restore(json.loads(self.snapshot_path.read_text(encoding="utf-8")))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("route bound snapshot %s unreadable, starting without it: %s", self.snapshot_path, exc)
        if self.log_path.is_file():
            with self.log_path.open(encoding="utf-8") as fh:
                for line in fh:
                    try:
                        _apply(self.bounds, json.loads(line))
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn last line
                    self.restored += 1
                    self._lines += 1
        self._fh = self.log_path.open("a", encoding="utf-8")

    async def record(self, scope: str, region: int, params: QualityBound, score: float, *, disagree: bool) -> None:
        async with self._writing:
            self.bounds.observe(scope, region, params, score, disagree=disagree)
            if self._fh is None:
                return
            try:
                self._fh.write(json.dumps(_event(scope, region, params, score, disagree), separators=(",", ":")) + "\n")
                self._fh.flush()
                self._lines += 1
                if self._lines >= self._compact_every:
                    await asyncio.to_thread(self._compact)
            except OSError as exc:
                self.errors += 1
                log.warning("route bound log %s not written: %s", self.log_path, exc)

    def _compact(self) -> None:
        tmp = self.snapshot_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.bounds.snapshot(), separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, self.snapshot_path)
        if self._fh is not None:
            self._fh.close()
        self._fh = self.log_path.open("w", encoding="utf-8")
        self._lines = 0

    async def close(self) -> None:
        async with self._writing:
            if self._fh is None:
                return
            try:
                await asyncio.to_thread(self._compact)
            except OSError as exc:
                log.warning("route bound snapshot not written at close: %s", exc)
            self._fh.close()
            self._fh = None


# Keep a snapshot only when its stream id is later than the stored one's.
_SNAPSHOT_LUA = """
local cur = redis.call('HGET', KEYS[1], 'id')
if cur then
  local a, b = string.match(cur, '(%d+)-(%d+)')
  local c, d = string.match(ARGV[1], '(%d+)-(%d+)')
  a, b, c, d = tonumber(a), tonumber(b), tonumber(c), tonumber(d)
  if c < a or (c == a and d <= b) then return 0 end
end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'state', ARGV[2])
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
        from policies.redis_client import redis_client
        from policies.redis_mux import MuxClient

        # writes share one multiplexed connection (policies/redis_mux.py); the follower has its own, XREAD blocks it
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

    async def record(self, scope: str, region: int, params: QualityBound, score: float, *, disagree: bool) -> None:
        body = json.dumps(_event(scope, region, params, score, disagree), separators=(",", ":"))
        try:
            async with asyncio.timeout(max(1.0, 10 * self._timeout)):
                await self._client.call("XADD", self._stream, "MAXLEN", "~", self._max_len, "*", "e", body)
        except Exception as exc:  # noqa: BLE001 - a lost observation must never surface to anyone
            self.errors += 1
            log.warning("route bound observation not written to the shared store: %r", exc)

    async def _restore(self) -> None:
        raw = await self._follower.hgetall(self._snapshot_key)
        fields = {_text(k): v for k, v in (raw or {}).items()}
        if "id" in fields and "state" in fields:
            # off the loop: a snapshot holds up to max_states x window judgements
            await asyncio.to_thread(lambda: self.bounds.restore(json.loads(fields["state"])))
            self._last_id = _text(fields["id"])
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
                _apply(self.bounds, json.loads(fields.get(b"e") or fields.get("e")))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("route bound: an unreadable observation %s skipped: %s", self._last_id, exc)
                continue
            self.applied += 1
            self._since_snapshot += 1

    async def _offer_snapshot(self) -> None:
        self._since_snapshot = 0
        # off the loop; nothing is applied meanwhile (the follower is the one waiting here)
        state = await asyncio.to_thread(lambda: json.dumps(self.bounds.snapshot(), separators=(",", ":")))
        await self._client.call("EVAL", _SNAPSHOT_LUA, 1, self._snapshot_key, self._last_id, state)

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
