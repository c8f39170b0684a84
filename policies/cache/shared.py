"""The semantic cache shared by every replica through Redis or Valkey (`state.backend: redis`).

Answers and exact keys live in the store, so an entry one replica admits is served by all;
vectors travel on a stream that every replica follows into its own faiss index.

Keys (`<owner>` is the tenant, or `*` for a scope shared across tenants: the hash tag, so an
owner's keys share one cluster slot):

- `<prefix>{<owner>}:cache:e:<exact>`: the entry (a hash: id, scope, tenant, text, body, exp,
  v: the vector as float32 bytes, empty when the entry is exact-only; and hits), expiring after
  the entry's ttl;
- `<prefix>{<owner>}:cache:lru`: the owner's exact keys by last use (a sorted set); above the
  policy's `max_entries` (resolved for that tenant) the least recently used are evicted;
- `<prefix>cache:stream`: what every replica applies to its index: `add` (id, owner, exact,
  scope, tenant, expiry, vector), `del` (ids) and `purge` (a tenant), and to its error bound:
  `obs` (a judged semantic hit: bound scope, its parameters, entry id, score, wrong), capped at
  `state.cache_stream_max_len` (approximate trim), so it need not hold the `add` of every live
  entry.

Catch-up (the snapshot): a replica that starts takes the stream's last id, then SCANs the entry
hashes of its prefix and indexes every live one (with its `v`) as the `add` event would, then
follows the stream from that id in a background task (start() does not wait for it: until the
snapshot is done, entries are served by exact match only). A follower that resumes after a failed
read run and finds the stream trimmed past its position (or gone) takes a new snapshot; entries
deleted meanwhile then stay in its index until they expire (a lookup finds their rows gone).
Entries written before `v` was stored in the hash are exact-only on a replica that catches up
this way.

A replica that admits or purges applies the change to its own index at once; the others within
one stream read (a blocking XREAD, so well under a second). A purge deletes the entries in the
store first, so no replica serves them even before it has read the event.

Failure: every request-path operation is bounded by `state.op_timeout_ms`; when the store fails
or is slower, the lookup is a miss and nothing is stored (counted in `errors`), and the store is
left alone for a short while (`_BACKOFF_S`) so a request never waits on it twice. The clients
reconnect on their own; the follower retries, and resumes from its last position.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson
import redis.asyncio as aioredis

from policies.cache.backend import CacheUnavailable
from policies.cache.config import CacheConfig, ResolvedConfigs
from policies.cache.error_bound import BoundParams, ErrorBounds
from policies.cache.faiss_index import FaissIndex
from policies.cache.index import Neighbour
from policies.cache.matcher import decide_many, load
from policies.cache.scope import CacheKey, semantic_skip
from policies.cache.service import CacheHit, bound_allows, bound_gate, bound_score
from policies.embedding.embedder import DIMENSION, vector_space
from policies.policy import Policy
from policies.shared_state.redis_client import redis_client
from policies.shared_state.redis_mux import MuxClient
from policies.task_stop import cancel_and_wait

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_BACKOFF_S = 0.5  # after a failure the store is not asked again for this long
_BLOCK_MS = 1000  # the follower's XREAD wait
_READ_COUNT = 500
_SWEEP_EVERY_S = 30.0
_SHARED_OWNER = "*"
_SCAN_COUNT = 500  # entry keys per SCAN step of a snapshot (one pipelined HMGET each)
_SNAPSHOT_FIELDS = ["id", "scope", "tenant", "exp", "v"]
DEFAULT_VECTOR_SPACE = vector_space("fp32")


def vector_blob(vector: np.ndarray, space: str) -> bytes:
    """A vector as stored and streamed: float32 bytes, after a tag naming its embedding unless float32 MiniLM.

    The float32 space keeps the untagged form replicas have always written; a replica drops a
    vector of another space (the tag, or the size, does not match) and keeps the entry for exact repeats.
    """
    raw = np.ascontiguousarray(vector, dtype=np.float32).tobytes()
    return raw if space == DEFAULT_VECTOR_SPACE else _space_tag(space) + raw


def vector_from_blob(blob: bytes, space: str) -> np.ndarray | None:
    """The vector of a blob written in `space` (vector_blob), or None: exact-only, or another embedding's."""
    tag = b"" if space == DEFAULT_VECTOR_SPACE else _space_tag(space)
    if len(blob) != len(tag) + 4 * DIMENSION or not blob.startswith(tag):
        return None
    return np.frombuffer(blob, dtype=np.float32, offset=len(tag))


def _space_tag(space: str) -> bytes:
    return b"\x00space:" + space.encode() + b"\x00"

# KEYS: entry, lru. ARGV: id, now (ms), ttl (ms), max entries, entry key prefix, exact,
# scope, tenant, text, body, expiry (s), vector (float32 bytes; '' when not semantic).
# Returns the ids of the entries evicted.
_STORE_LUA = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'scope', ARGV[7], 'tenant', ARGV[8], 'text', ARGV[9],
           'body', ARGV[10], 'exp', ARGV[11], 'v', ARGV[12])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[6])
local gone = {}
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if over > 0 then
  for _, exact in ipairs(redis.call('ZRANGE', KEYS[2], 0, over - 1)) do
    local key = ARGV[5] .. exact
    local id = redis.call('HGET', key, 'id')
    if id then table.insert(gone, id) end
    redis.call('DEL', key)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, over - 1)
end
local left = redis.call('PTTL', KEYS[2])
if left == -1 or left < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
return gone
"""

# KEYS: lru. ARGV: entry key prefix, then the exact keys to delete ('' alone: all of the owner's).
# Returns the ids of the entries deleted.
_PURGE_LUA = """
local exacts = {}
if ARGV[2] == '' then exacts = redis.call('ZRANGE', KEYS[1], 0, -1) else
  for i = 2, #ARGV do table.insert(exacts, ARGV[i]) end
end
local gone = {}
for _, exact in ipairs(exacts) do
  local key = ARGV[1] .. exact
  local id = redis.call('HGET', key, 'id')
  if id then table.insert(gone, id) end
  redis.call('DEL', key)
  redis.call('ZREM', KEYS[1], exact)
end
return gone
"""


# KEYS: lru, entry. ARGV: now (ms), exact. A hit renews the entry's place in the LRU and counts on
# the entry, if it is still there (a HINCRBY alone would leave a hash of `hits` behind an entry
# evicted or purged meanwhile, never expiring).
_TOUCH_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[2])
  redis.call('HINCRBY', KEYS[2], 'hits', 1)
end
return 0
"""

_FIELDS = ("id", "scope", "text", "body", "exp")  # what a lookup reads of an entry


class StoreDown(CacheUnavailable):
    """The store failed, timed out, or is being left alone after a recent failure."""


@dataclass(slots=True)
class _Meta:
    """What a replica knows of one entry from the stream (the answer itself stays in the store)."""

    owner: str
    exact: str
    scope: str
    tenant: str
    expires: float


def _meta(owner: str, exact: str, scope: str, tenant: str, expires: float) -> _Meta:
    """A _Meta whose owner, scope and tenant are one string each, however many entries name them."""
    return _Meta(sys.intern(owner), exact, sys.intern(scope), sys.intern(tenant), expires)


# What a replica holds per entry it knows, besides the vector: the _Meta with its exact key and
# expiry, the id -> meta and exact -> id maps, its place in the vector LRU (measured,
# bench/cache_memory.py: 390 B an entry over 100,000).
_META_BYTES = 400


class SharedCache:
    """The `CacheBackend` over a redis.asyncio client; a local faiss index follows the stream.

    NOTE: the index and the id maps are touched only on `self._executor` (one thread), like the
    embedded cache's; the event loop only awaits it and the store.
    """

    def __init__(
        self,
        policy: Policy,
        client: MuxClient,
        follower: aioredis.Redis,
        *,
        key_prefix: str = "tierlane:",
        op_timeout_s: float = 0.1,
        stream_max_len: int = 100_000,
        vector_space: str = DEFAULT_VECTOR_SPACE,
    ) -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("state.key_prefix must not contain { or }: the tenant is the hash tag")
        self.policy = policy
        self.base = CacheConfig.from_section(policy.resolve("cache"))
        self.client = client
        self._follower = follower
        self._prefix = key_prefix
        self.vector_space = vector_space  # the embedding of this replica's vectors: others' are not searched
        self._stream = f"{key_prefix}cache:stream"
        self._timeout = op_timeout_s
        self._stream_max_len = stream_max_len
        self._store_script = client.script(_STORE_LUA)
        self._purge_script = client.script(_PURGE_LUA)
        self._touch_script = client.script(_TOUCH_LUA)
        self._origin = secrets.token_hex(8)  # this replica: its own events are applied when made
        self._configs = ResolvedConfigs(policy)
        # cache.max_error_rate: every replica applies every judged hit (the `obs` events) to its own
        self.bounds = ErrorBounds()
        self._index = FaissIndex(DIMENSION)
        self._meta: dict[int, _Meta] = {}
        self._by_exact: dict[str, int] = {}
        # The ids in the index, least recently added or found first: past `cache.max_memory_bytes` their
        # vectors leave this replica's index (the entries stay known, served here by exact match only).
        self._vector_lru: OrderedDict[int, None] = OrderedDict()
        self.vectors_dropped = 0  # vectors dropped for cache.max_memory_bytes
        self._last_id = "0-0"
        self._last_sweep = 0.0
        self._down_until = 0.0
        # exact keys this replica stored itself while a snapshot runs (worker thread only): see _load
        self._own_since_snapshot: set[str] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._follow_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.errors = 0  # store operations that failed or timed out
        self.skipped = 0  # lookups and admissions skipped because the store failed (fail open: misses)
        self._closing = False  # the follower ends at its next turn (close() also cancels it)
        self.applied = 0  # stream events applied
        self.snapshots = 0  # catch-ups from the entry hashes (at start; after the stream was trimmed past us)
        self.snapshot_entries = 0  # live entries those snapshots loaded, all together

    @classmethod
    def connect(
        cls, policy: Policy, url: str, *, key_prefix: str, connect_timeout_s: float, op_timeout_s: float, stream_max_len: int,
        vector_space: str = DEFAULT_VECTOR_SPACE,
    ) -> SharedCache:
        """Clients that connect lazily and reconnect on their own after the server comes back.

        The request path (lookups, stores, purges) shares one multiplexed connection
        (policies/shared_state/redis_mux.py); the follower has its own, since XREAD blocks it.
        """
        client = MuxClient(url, connect_timeout_s=connect_timeout_s, stale_after_s=max(1.0, 10 * op_timeout_s))
        # the follower blocks on the stream for _BLOCK_MS at a time
        follower = redis_client(url, connect_timeout_s=connect_timeout_s, read_timeout_s=_BLOCK_MS / 1000.0 + 1.0 + op_timeout_s)
        return cls(policy, client, follower, key_prefix=key_prefix, op_timeout_s=op_timeout_s, stream_max_len=stream_max_len,
                   vector_space=vector_space)

    async def start(self) -> None:
        """Start the follower (a snapshot of the live entries, then the stream); a store that is down is retried."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shared-cache")
        if self.base.verify.verifier is not None:
            await self._call(load, self.base.verify)  # read (and checked) now, not on the first lookup
        # NOTE: the scripts are loaded once here, not on a replica's first store: a NOSCRIPT
        # round (load, then run) took longer than op_timeout_ms under load, and that one
        # timeout switched the shared cache off for _BACKOFF_S. A store that is down now is
        # fine: the first store loads them then.
        for script in (self._store_script, self._purge_script, self._touch_script):
            try:
                async with asyncio.timeout(max(1.0, self._timeout * 10)):
                    await script.load()
            except Exception as exc:  # noqa: BLE001 - down or slow at start: loaded on first use instead
                logger.warning("shared cache: could not preload a script (%s); it is loaded on first use", exc)
        self._follow_task = asyncio.create_task(self._follow())

    async def close(self) -> None:
        self._closing = True
        if self._follow_task is not None:
            await cancel_and_wait(self._follow_task)
            self._follow_task = None
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._timeout * 2)
        await self.client.close()
        await self._follower.aclose()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def config_for(self, *, tenant: str, app: str, model: str, route: str | None) -> CacheConfig:
        """The cache policy resolved for one tenant/app/model/route."""
        return self._configs.resolve(tenant=tenant, app=app, model=model, route=route)

    # Keys.

    def _entry_prefix(self, owner: str) -> str:
        return f"{self._prefix}{{{owner}}}:cache:e:"

    def _lru(self, owner: str) -> str:
        return f"{self._prefix}{{{owner}}}:cache:lru"

    @staticmethod
    def _owner(key: CacheKey, config: CacheConfig) -> str:
        # The scope digest holds the same owner (scope.build_key), so an entry lives where its scope says.
        return _SHARED_OWNER if config.rules.share_across_tenants else key.tenant

    # The request path.

    async def lookup(
        self,
        key: CacheKey,
        vector: np.ndarray | None,
        config: CacheConfig,
        *,
        max_output_tokens: int | None = None,
        exact: bool = True,
        bound_scope: str | None = None,
        refused: list[CacheHit] | None = None,
    ) -> CacheHit | None:
        """The best verified stored answer for `key`, or None (also when the store fails: a miss);
        `bound_scope` and `refused` as SemanticCache.lookup's."""
        try:
            return await self._lookup(key, vector, config, max_output_tokens, exact, bound_scope or key.tenant, refused)
        except StoreDown:
            self.skipped += 1
            return None

    async def observe(self, scope: str, params: BoundParams, entry_id: int, score: float, *, wrong: bool) -> None:
        """A judged semantic hit, for the error bound of `scope` on this replica and, through the stream, every other."""
        await self._call(lambda: self.bounds.observe(scope, params, entry_id, score, wrong=wrong))
        await self._publish({"op": "obs", "scope": scope, "params": orjson.dumps(dataclasses.asdict(params)),
                             "id": entry_id, "score": repr(score), "wrong": int(wrong)})  # fmt: skip

    async def _lookup(
        self, key: CacheKey, vector: np.ndarray | None, config: CacheConfig, max_output_tokens: int | None, exact: bool,
        bound_scope: str, refused: list[CacheHit] | None = None,
    ) -> CacheHit | None:  # fmt: skip
        now = time.time()
        owner = self._owner(key, config)
        prefix = self._entry_prefix(owner)
        if exact and config.exact:
            row = await self._op(lambda: self.client.call("HMGET", prefix + key.exact, *_FIELDS))
            hit = self._accept(row, key, None, 1.0, now, max_output_tokens, owner=owner, exact_key=key.exact)
            if hit is not None:
                return hit
        if not config.semantic or vector is None or semantic_skip(key, config.max_text_chars):
            return None
        gate, checks = bound_gate(config)
        found = await self._call(self._search, key.scope, vector, config.candidates, gate)
        if not found:
            return None

        async def fetch() -> list[Any]:
            return await asyncio.gather(
                *(self.client.call("HMGET", self._entry_prefix(m.owner) + m.exact, *_FIELDS) for _, m, _ in found)
            )

        rows = await self._op(fetch)
        # Rows that could be served, then one batched cross-encoder call for them on the worker thread.
        live = [
            (entry_id, meta, neighbour, row)
            for (entry_id, meta, neighbour), row in zip(found, rows)
            if self._servable(row, key, entry_id, now)
        ]
        if not live:
            return None
        decisions = await self._call(
            lambda: decide_many(key.text, [(n.similarity, _text(row[2]), n.vector) for _, _, n, row in live],
                                threshold=gate, checks=checks, query_vector=vector, space=self.vector_space)
        )  # fmt: skip
        first_refused: CacheHit | None = None
        for (entry_id, meta, neighbour, row), decision in zip(live, decisions):
            if not bound_allows(self.bounds, bound_scope, config.bound, entry_id, decision):
                if decision.hit and first_refused is None and refused is not None:  # refused by the bound alone
                    first_refused = self._accept(row, key, entry_id, neighbour.similarity, now, max_output_tokens,
                                                 owner=meta.owner, exact_key=meta.exact, touch=False)  # fmt: skip
                    if first_refused is not None:
                        first_refused = dataclasses.replace(first_refused, score=bound_score(decision))
                continue
            hit = self._accept(row, key, entry_id, neighbour.similarity, now, max_output_tokens, owner=meta.owner,
                               exact_key=meta.exact)  # fmt: skip
            if hit is not None:
                return dataclasses.replace(hit, score=bound_score(decision))
        if first_refused is not None and refused is not None:
            refused.append(first_refused)
        return None

    @staticmethod
    def _servable(row: list[Any], key: CacheKey, entry_id: int | None, now: float) -> bool:
        stored_id, scope, _, body, expires = row
        if stored_id is None or body is None or _text(scope) != key.scope or float(expires) <= now:
            return False
        return entry_id is None or int(stored_id) == entry_id

    def _accept(
        self, row: list[Any], key: CacheKey, entry_id: int | None, similarity: float, now: float, max_output_tokens: int | None,
        *, owner: str, exact_key: str, touch: bool = True,
    ) -> CacheHit | None:  # fmt: skip
        """The hit a stored row gives (same scope, not expired, fits; a semantic row was verified by the caller), or None."""
        if not self._servable(row, key, entry_id, now):
            return None  # gone, another scope, expired, or replaced since this vector was indexed
        stored_id, _, _, body, _ = row
        payload = orjson.loads(body)
        usage = payload.get("usage")
        if max_output_tokens is not None and usage and int(usage.get("completion_tokens") or 0) > max_output_tokens:
            return None
        if touch:
            self._spawn(self._touch(owner, exact_key))
        return CacheHit(int(stored_id), exact_key, payload["response"], usage, similarity, entry_id is None)

    async def _touch(self, owner: str, exact_key: str) -> None:
        try:
            await self._op(lambda: self._touch_script(keys=[self._lru(owner), self._entry_prefix(owner) + exact_key],
                                                      args=[int(time.time() * 1000), exact_key]))  # fmt: skip
        except StoreDown:
            pass

    async def store(
        self,
        key: CacheKey,
        vector: np.ndarray | None,
        response: dict[str, Any],
        usage: dict[str, Any] | None,
        config: CacheConfig,
    ) -> int:
        """Admit one answer for every replica; returns its entry id (0: not stored, the store failed)."""
        if config.ttl_s <= 0:
            return 0  # never served again: nothing to keep
        now = time.time()
        owner = self._owner(key, config)
        entry_id = secrets.randbits(62) or 1
        semantic = vector is not None and config.semantic and not semantic_skip(key, config.max_text_chars)
        blob = vector_blob(vector, self.vector_space) if semantic and vector is not None else b""
        expires = now + config.ttl_s
        body = orjson.dumps({"response": response, "usage": usage})
        event: dict[Any, Any] = {"op": "add", "src": self._origin, "id": entry_id, "owner": owner, "exact": key.exact,
                 "scope": key.scope, "tenant": key.tenant, "exp": repr(expires), "v": blob}  # fmt: skip

        async def write() -> list[Any]:
            return list(await asyncio.gather(
                self._store_script(
                    keys=[self._entry_prefix(owner) + key.exact, self._lru(owner)],
                    args=[entry_id, int(now * 1000), max(1, int(config.ttl_s * 1000)), config.max_entries,
                          self._entry_prefix(owner), key.exact, key.scope, key.tenant, key.text, body, repr(expires),
                          blob],
                ),
                self._xadd(event),
            ))  # fmt: skip

        try:
            evicted, _ = await self._op(write)
        except StoreDown:
            self.skipped += 1
            return 0
        gone = [int(i) for i in evicted or []]
        await self._call(
            self._add_own, entry_id, _meta(owner, key.exact, key.scope, key.tenant, expires), vector if semantic else None
        )
        if gone:
            await self._call(self._remove, gone)
            await self._publish({"op": "del", "ids": _ids(gone)})
        return entry_id

    async def purge_tenant(self, tenant: str) -> int:
        """Delete every entry the tenant stored (its own and those it shared), on every replica."""
        shared = await self._call(self._shared_exacts, tenant)

        async def purge() -> list[Any]:
            calls = [self._purge_script(keys=[self._lru(tenant)], args=[self._entry_prefix(tenant), ""])]
            if shared:
                calls.append(
                    self._purge_script(keys=[self._lru(_SHARED_OWNER)], args=[self._entry_prefix(_SHARED_OWNER), *shared])
                )
            return await asyncio.gather(*calls)

        gone = [int(i) for ids in await self._op(purge) for i in ids or []]
        await self._call(self._purge_local, tenant, gone)
        await self._publish({"op": "purge", "tenant": tenant, "ids": _ids(gone)})
        return len(gone)

    async def purge_key(self, key: str) -> int:
        """Delete one entry by exact key (hex digest) or entry id, on every replica."""
        meta = await self._call(self._find, key)
        if meta is None:
            return 0
        owner, exact_key = meta
        ids = await self._op(lambda: self._purge_script(keys=[self._lru(owner)], args=[self._entry_prefix(owner), exact_key]))
        gone = [int(i) for i in ids or []]
        if gone:
            await self._call(self._remove, gone)
            await self._publish({"op": "del", "ids": _ids(gone)})
        return len(gone)

    async def catch_up(self, timeout_s: float) -> None:
        """Wait until this replica knows every entry announced so far: a snapshot taken and the stream
        read to the end it has now (a process that just opened the cache knows none yet; a purge by
        key, a tenant's entries in a shared scope and `stats` need them).

        StoreDown when the store does not answer; TimeoutError when not caught up within `timeout_s`.
        """
        try:
            async with asyncio.timeout(max(self._timeout, 1.0)):
                last = await self._follower.xrevrange(self._stream, "+", "-", count=1)
        except Exception as exc:
            raise StoreDown() from exc
        end = _stream_id(last[0][0]) if last else (0, 0)
        async with asyncio.timeout(timeout_s):
            while self.snapshots < 1 or _stream_id(self._last_id) < end:  # noqa: ASYNC110 - polls the follower, bounded
                await asyncio.sleep(0.02)

    async def stats(self) -> dict[str, Any]:
        local = await self._call(self._local_stats)
        return {**local, "backend": "redis", "errors": self.errors, "skipped": self.skipped,
                "events_applied": self.applied, "stream_position": self._last_id, "snapshots": self.snapshots,
                "snapshot_entries": self.snapshot_entries}  # fmt: skip

    # Plumbing.

    async def _op(self, make: Callable[[], Awaitable[_T]]) -> _T:
        """One store operation within the timeout; StoreDown when it fails (or failed just now)."""
        if time.monotonic() < self._down_until:
            raise StoreDown()
        try:
            async with asyncio.timeout(self._timeout):  # no task per call, unlike wait_for on 3.11
                return await make()
        except Exception as exc:  # any store failure (connection, timeout, script): the caller takes it as a miss
            self._failed(exc)
            raise StoreDown() from exc

    def _xadd(self, event: dict[Any, Any]) -> Awaitable[Any]:
        fields = [part for name, value in event.items() for part in (name, value)]
        return self.client.call("XADD", self._stream, "MAXLEN", "~", self._stream_max_len, "*", *fields)

    async def _publish(self, event: dict[Any, Any]) -> None:
        event["src"] = self._origin
        try:
            await self._op(lambda: self._xadd(event))
        except StoreDown:
            pass  # the store itself was purged first; replicas drop the vectors when they expire

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        self._down_until = time.monotonic() + _BACKOFF_S
        if self.errors == 1 or self.errors % 1000 == 0:
            logger.warning("shared cache store failed (%d failures so far): %r", self.errors, exc)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self._executor is None:
            raise RuntimeError("SharedCache.start() has not been awaited")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _follow(self) -> None:
        """Take a snapshot, then apply the stream's events from the last position read, for as long as the cache runs."""
        failures = 0
        snapshot = True  # at start: the stream may have been trimmed of older entries' adds
        next_check = time.monotonic() + _SWEEP_EVERY_S
        while not self._closing:
            try:
                # NOTE: after a failed run, a new snapshot only when the stream was trimmed past the
                # position (one XINFO), not after every failure: a blip of the store would otherwise
                # have every replica SCAN every entry at once, just as it comes back. The same check
                # every _SWEEP_EVERY_S catches a follower that fell behind by more than the stream keeps.
                if not snapshot and (failures or time.monotonic() >= next_check):
                    next_check = time.monotonic() + _SWEEP_EVERY_S
                    snapshot = await self._trimmed_past(self._last_id)
                if snapshot:
                    self._last_id = await self._snapshot()
                    snapshot = False
                reply: Any = await self._follower.xread({self._stream: self._last_id}, count=_READ_COUNT, block=_BLOCK_MS)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the store is down or restarting: retry from the same position
                failures += 1
                if failures == 1:
                    logger.warning("shared cache stream unreadable, retrying: %r", exc)
                await asyncio.sleep(min(1.0, 0.1 * failures))
                continue
            for _, events in reply or []:
                if events:
                    await self._call(self._apply, events)
                    self._last_id = _text(events[-1][0])
            if time.time() - self._last_sweep >= _SWEEP_EVERY_S:
                await self._call(self._sweep, time.time())

    async def _snapshot(self) -> str:
        """Index every live entry in the store; returns the stream position to follow from.

        The stream's last id is taken before the SCAN, so whatever changed after it is both (maybe)
        in what the SCAN reads and on the stream read next: adds are idempotent (the same id, or the
        newer entry for an exact key replacing the older), and the del/purge events after that id are
        applied afterwards, so every race ends in the store's state. The exception is this replica's
        own changes, applied when made and skipped on the stream: a row the SCAN read before this
        replica replaced it must not replace the newer entry (see _load); an own purge racing the
        SCAN may leave a vector whose row is gone, which a lookup rejects and the sweep drops.
        """
        await self._call(self._begin_snapshot)
        last = await self._follower.xrevrange(self._stream, "+", "-", count=1)
        position = _text(last[0][0]) if last else "0-0"
        pattern = _glob_escape(self._prefix) + "{*}:cache:e:*"
        loaded, cursor = 0, 0
        while True:
            cursor, keys = await self._follower.scan(cursor, match=pattern, count=_SCAN_COUNT)
            if keys:
                async with self._follower.pipeline(transaction=False) as pipe:
                    for key in keys:
                        pipe.hmget(key, _SNAPSHOT_FIELDS)
                    rows = await pipe.execute()
                loaded += await self._call(self._load, keys, rows)
            if not cursor:
                break
        await self._call(self._end_snapshot)
        self.snapshots += 1
        self.snapshot_entries += loaded
        logger.info("shared cache: snapshot loaded %d live entries; following the stream from %s", loaded, position)
        return position

    async def _trimmed_past(self, position: str) -> bool:
        """Whether events after `position` may be gone from the stream (trimmed, or the stream is gone)."""
        try:
            info = await self._follower.xinfo_stream(self._stream)
        except aioredis.ResponseError as exc:
            if "no such key" in str(exc).lower():
                # flushed, or a new store: the entries, if any, are only in the hashes. A stream that
                # never existed (nothing stored yet, position 0-0) is not that: without this, every
                # check would SCAN the whole keyspace again.
                return _stream_id(position) != (0, 0)
            raise
        first = info.get("first-entry")
        if first:
            return _stream_id(first[0]) > _stream_id(position)  # (even the very next one: a snapshot too many)
        return _stream_id(info.get("last-generated-id") or "0-0") > _stream_id(position)  # trimmed to nothing

    # Everything below runs on the worker thread.

    def _search(self, scope: str, vector: np.ndarray, k: int, threshold: float) -> list[tuple[int, _Meta, Neighbour]]:
        found = []
        for neighbour in self._index.search(scope, vector, k):
            meta = self._meta.get(neighbour.id)
            if neighbour.similarity >= threshold and meta is not None and meta.scope == scope:
                found.append((neighbour.id, meta, neighbour))
                if neighbour.id in self._vector_lru:
                    self._vector_lru.move_to_end(neighbour.id)
        return found

    def _add(self, entry_id: int, meta: _Meta, vector: np.ndarray | None) -> None:
        replaced = self._by_exact.get(meta.exact)
        if replaced is not None and replaced != entry_id:
            self._remove([replaced])
        self._meta[entry_id] = meta
        self._by_exact[meta.exact] = entry_id
        if vector is not None:
            self._index.add(entry_id, meta.scope, vector)
            self._vector_lru[entry_id] = None
            self._vector_lru.move_to_end(entry_id)
            self._bound_memory()

    def _bound_memory(self) -> None:
        """Drop the least recently added or found vectors while this replica's cache holds more than
        `cache.max_memory_bytes` (the store keeps their entries; every entry stays known, for purges)."""
        limit = self.base.max_memory_bytes
        if limit is None:
            return
        over = self._index.nbytes + len(self._meta) * _META_BYTES - limit
        if over <= 0:
            return
        per_vector = max(1, self._index.nbytes // max(1, len(self._index)))
        dropped = [self._vector_lru.popitem(last=False)[0] for _ in range(min(len(self._vector_lru), -(-over // per_vector)))]
        self._index.remove(dropped)
        self.vectors_dropped += len(dropped)

    def _add_own(self, entry_id: int, meta: _Meta, vector: np.ndarray | None) -> None:
        """An entry this replica stored (its event is skipped on the stream)."""
        if self._own_since_snapshot is not None:
            self._own_since_snapshot.add(meta.exact)
        self._add(entry_id, meta, vector)

    def _add_live(self, entry_id: int, meta: _Meta, blob: bytes, now: float) -> bool:
        """An `add` from the stream or a snapshot: kept unless expired; a vector of the wrong size, or of
        another embedding than this replica's (a fleet changing embedder.precision), is left out."""
        if meta.expires <= now:
            return False
        vector = vector_from_blob(blob, self.vector_space)
        self._add(entry_id, meta, vector)
        return True

    def _begin_snapshot(self) -> None:
        self._own_since_snapshot = set()

    def _end_snapshot(self) -> None:
        self._own_since_snapshot = None

    def _load(self, keys: list[bytes], rows: list[list[Any]]) -> int:
        """The snapshot's rows (id, scope, tenant, exp, v), each added like an `add` event; returns how many were live."""
        now, loaded = time.time(), 0
        own = self._own_since_snapshot or set()
        for key, row in zip(keys, rows):
            stored_id, scope, tenant, expires, blob = row
            if None in (stored_id, scope, tenant, expires):
                continue  # gone since the SCAN, or not an entry (a hits counter a touch left after its entry went)
            try:
                parsed = _parse_entry_key(_text(key), self._prefix)
                if parsed is None or parsed[1] in own:
                    continue  # not an entry key; or stored here since the snapshot began: newer than this row, or the same
                meta = _meta(parsed[0], parsed[1], _text(scope), _text(tenant), float(expires))
                loaded += self._add_live(int(stored_id), meta, blob or b"", now)
            except ValueError as exc:  # UnicodeDecodeError included
                logger.warning("shared cache: malformed entry %r skipped: %r", key, exc)
        return loaded

    def _remove(self, ids: list[int]) -> None:
        for entry_id in ids:
            meta = self._meta.pop(entry_id, None)
            if meta is not None and self._by_exact.get(meta.exact) == entry_id:
                del self._by_exact[meta.exact]
            self._vector_lru.pop(entry_id, None)
        self._index.remove(ids)

    def _purge_local(self, tenant: str, ids: list[int]) -> None:
        self._remove([*ids, *(i for i, m in self._meta.items() if m.tenant == tenant)])

    def _shared_exacts(self, tenant: str) -> list[str]:
        return [m.exact for m in self._meta.values() if m.tenant == tenant and m.owner == _SHARED_OWNER]

    def _find(self, key: str) -> tuple[str, str] | None:
        entry_id = int(key) if key.isdigit() else self._by_exact.get(key)
        meta = self._meta.get(entry_id) if entry_id is not None else None
        return (meta.owner, meta.exact) if meta is not None else None

    def _apply(self, events: list[tuple[Any, dict[bytes, bytes]]]) -> None:
        for _, fields in events:
            self.applied += 1
            if fields.get(b"src", b"").decode() == self._origin:
                continue  # applied when it was made
            op = fields.get(b"op", b"").decode()
            try:
                if op == "add":
                    meta = _meta(fields[b"owner"].decode(), fields[b"exact"].decode(), fields[b"scope"].decode(),
                                 fields[b"tenant"].decode(), float(fields[b"exp"]))  # fmt: skip
                    self._add_live(int(fields[b"id"]), meta, fields.get(b"v") or b"", time.time())
                elif op == "del":
                    self._remove(_parse_ids(fields.get(b"ids", b"")))
                elif op == "purge":
                    self._purge_local(fields[b"tenant"].decode(), _parse_ids(fields.get(b"ids", b"")))
                elif op == "obs":
                    params = BoundParams(**orjson.loads(fields[b"params"]))
                    self.bounds.observe(fields[b"scope"].decode(), params, int(fields[b"id"]), float(fields[b"score"]),
                                        wrong=fields[b"wrong"] == b"1")  # fmt: skip
            except (KeyError, ValueError, TypeError) as exc:
                logger.warning("shared cache: malformed %r event skipped: %r", op, exc)

    def _sweep(self, now: float) -> None:
        self._last_sweep = now
        self._remove([i for i, m in self._meta.items() if m.expires <= now])

    def _local_stats(self) -> dict[str, Any]:
        return {"entries_known": len(self._meta), "vectors": len(self._index), "vectors_dropped": self.vectors_dropped,
                "memory_bytes": self._index.nbytes + len(self._meta) * _META_BYTES}  # fmt: skip


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _ids(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids)


def _parse_ids(raw: bytes) -> list[int]:
    return [int(i) for i in raw.decode().split(",") if i]


def _glob_escape(text: str) -> str:
    """`text` matched literally by a SCAN/KEYS pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _parse_entry_key(key: str, prefix: str) -> tuple[str, str] | None:
    """(owner, exact) of `<prefix>{<owner>}:cache:e:<exact>`, or None for any other key."""
    if not key.startswith(prefix + "{"):
        return None
    owner, sep, exact = key[len(prefix) + 1 :].rpartition("}:cache:e:")
    return (owner, exact) if sep and owner and exact else None


def _stream_id(value: Any) -> tuple[int, int]:
    ms, _, seq = _text(value).partition("-")
    return int(ms), int(seq or 0)


async def open_shared_cache(
    policy: Policy, url: str, *, key_prefix: str, connect_timeout_s: float, op_timeout_s: float, stream_max_len: int,
    vector_space: str = DEFAULT_VECTOR_SPACE,
) -> SharedCache:
    """Build and start the shared cache (the component builder calls this with `state.backend: redis`)."""
    cache = SharedCache.connect(
        policy, url, key_prefix=key_prefix, connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s,
        stream_max_len=stream_max_len, vector_space=vector_space,
    )  # fmt: skip
    await cache.start()
    return cache
