"""The semantic cache shared by every replica through Redis or Valkey (`state.backend: redis`).

Answers and exact keys live in the store, so an entry one replica admits is served by all;
vectors travel on a stream that every replica follows into its own faiss index.

Keys (`<owner>` is the tenant, or `*` for a scope shared across tenants: the hash tag, so an
owner's keys share one cluster slot):

- `<prefix>{<owner>}:cache:e:<exact>`: the entry (a hash: id, scope, tenant, text, body, exp),
  expiring after the entry's ttl;
- `<prefix>{<owner>}:cache:lru`: the owner's exact keys by last use (a sorted set); above the
  policy's `max_entries` (resolved for that tenant) the least recently used are evicted;
- `<prefix>cache:stream`: what every replica applies to its index: `add` (id, owner, exact,
  scope, tenant, expiry, vector), `del` (ids) and `purge` (a tenant), capped at
  `state.cache_stream_max_len` (approximate trim). A replica reads it from the start when it
  starts, then follows it from its last position in a background task.

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
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson
import redis.asyncio as aioredis

from policies.cache.backend import CacheUnavailable
from policies.cache.config import CacheConfig, ResolvedConfigs
from policies.cache.faiss_index import FaissIndex
from policies.cache.index import Neighbour
from policies.cache.matcher import decide
from policies.cache.scope import CacheKey
from policies.cache.service import CacheHit
from policies.cache.verifier import PairText, load_verifier
from policies.embedder import DIMENSION
from policies.policy import Policy
from policies.redis_client import redis_client

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_BACKOFF_S = 0.5  # after a failure the store is not asked again for this long
_BLOCK_MS = 1000  # the follower's XREAD wait
_READ_COUNT = 500
_SWEEP_EVERY_S = 30.0
_SHARED_OWNER = "*"

# KEYS: entry, lru. ARGV: id, now (ms), ttl (ms), max entries, entry key prefix, exact,
# scope, tenant, text, body, expiry (s). Returns the ids of the entries evicted.
_STORE_LUA = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'scope', ARGV[7], 'tenant', ARGV[8], 'text', ARGV[9],
           'body', ARGV[10], 'exp', ARGV[11])
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


class SharedCache:
    """The `CacheBackend` over a redis.asyncio client; a local faiss index follows the stream.

    NOTE: the index and the id maps are touched only on `self._executor` (one thread), like the
    embedded cache's; the event loop only awaits it and the store.
    """

    def __init__(
        self,
        policy: Policy,
        client: aioredis.Redis,
        follower: aioredis.Redis,
        *,
        key_prefix: str = "tierlane:",
        op_timeout_s: float = 0.1,
        stream_max_len: int = 100_000,
    ) -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("state.key_prefix must not contain { or }: the tenant is the hash tag")
        self.policy = policy
        self.base = CacheConfig.from_section(policy.resolve("cache"))
        self.client = client
        self._follower = follower
        self._prefix = key_prefix
        self._stream = f"{key_prefix}cache:stream"
        self._timeout = op_timeout_s
        self._stream_max_len = stream_max_len
        self._store_script = client.register_script(_STORE_LUA)
        self._purge_script = client.register_script(_PURGE_LUA)
        self._origin = secrets.token_hex(8)  # this replica: its own events are applied when made
        self._configs = ResolvedConfigs(policy)
        self._index = FaissIndex(DIMENSION)
        self._meta: dict[int, _Meta] = {}
        self._by_exact: dict[str, int] = {}
        self._last_id = "0-0"
        self._last_sweep = 0.0
        self._down_until = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._follow_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.errors = 0  # store operations that failed or timed out
        self.skipped = 0  # lookups and admissions skipped because the store failed (fail open: misses)
        self.applied = 0  # stream events applied

    @classmethod
    def connect(
        cls, policy: Policy, url: str, *, key_prefix: str, connect_timeout_s: float, op_timeout_s: float, stream_max_len: int
    ) -> SharedCache:
        """Clients that connect lazily and reconnect on their own after the server comes back."""
        client = redis_client(url, connect_timeout_s=connect_timeout_s, read_timeout_s=op_timeout_s)
        # the follower blocks on the stream for _BLOCK_MS at a time
        follower = redis_client(url, connect_timeout_s=connect_timeout_s, read_timeout_s=_BLOCK_MS / 1000.0 + 1.0 + op_timeout_s)
        return cls(policy, client, follower, key_prefix=key_prefix, op_timeout_s=op_timeout_s, stream_max_len=stream_max_len)

    async def start(self) -> None:
        """Start following the stream from its start (the catch-up); a store that is down is retried."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shared-cache")
        if self.base.verify.verifier is not None:
            await self._call(load_verifier, self.base.verify.verifier)  # read (and checked) now, not on the first lookup
        # NOTE: the scripts are loaded once here, not on a replica's first store: a NOSCRIPT
        # round (load, then run) took longer than op_timeout_ms under load, and that one
        # timeout switched the shared cache off for _BACKOFF_S. A store that is down now is
        # fine: the first store loads them then.
        for script in (self._store_script, self._purge_script):
            try:
                await asyncio.wait_for(self.client.script_load(script.script), timeout=max(1.0, self._timeout * 10))
            except Exception as exc:  # noqa: BLE001 - down or slow at start: loaded on first use instead
                logger.warning("shared cache: could not preload a script (%s); it is loaded on first use", exc)
        self._follow_task = asyncio.create_task(self._follow())

    async def close(self) -> None:
        if self._follow_task is not None:
            self._follow_task.cancel()
            await asyncio.gather(self._follow_task, return_exceptions=True)
            self._follow_task = None
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._timeout * 2)
        await self.client.aclose()
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
    ) -> CacheHit | None:
        """The best verified stored answer for `key`, or None (also when the store fails: a miss)."""
        try:
            return await self._lookup(key, vector, config, max_output_tokens, exact)
        except StoreDown:
            self.skipped += 1
            return None

    async def _lookup(
        self, key: CacheKey, vector: np.ndarray | None, config: CacheConfig, max_output_tokens: int | None, exact: bool
    ) -> CacheHit | None:
        now = time.time()
        owner = self._owner(key, config)
        prefix = self._entry_prefix(owner)
        if exact and config.exact:
            row = await self._op(lambda: self.client.hmget(prefix + key.exact, ["id", "scope", "text", "body", "exp"]))
            hit = self._accept(row, key, None, 1.0, now, max_output_tokens, owner=owner, exact_key=key.exact)
            if hit is not None:
                return hit
        if not config.semantic or vector is None or len(key.text) > config.max_text_chars:
            return None
        found = await self._call(self._search, key.scope, vector, config.candidates, config.threshold)
        if not found:
            return None

        async def fetch() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for _, meta, _ in found:
                    pipe.hmget(self._entry_prefix(meta.owner) + meta.exact, ["id", "scope", "text", "body", "exp"])
                return list(await pipe.execute())

        rows = await self._op(fetch)
        query = PairText(key.text, config.verify)  # extracted once, reused for every candidate
        for (entry_id, meta, neighbour), row in zip(found, rows):
            hit = self._accept(
                row, key, entry_id, neighbour.similarity, now, max_output_tokens, owner=meta.owner, exact_key=meta.exact,
                config=config, verify=(query, vector, neighbour.vector),
            )
            if hit is not None:
                return hit
        return None

    def _accept(
        self, row: list[Any], key: CacheKey, entry_id: int | None, similarity: float, now: float, max_output_tokens: int | None,
        *, owner: str, exact_key: str, config: CacheConfig | None = None,
        verify: tuple[PairText, np.ndarray, np.ndarray | None] | None = None,
    ) -> CacheHit | None:  # fmt: skip
        """The hit a stored row gives (same scope, not expired, fits, verified when semantic), or None."""
        stored_id, scope, text, body, expires = row
        if stored_id is None or body is None or _text(scope) != key.scope or float(expires) <= now:
            return None
        if entry_id is not None and int(stored_id) != entry_id:
            return None  # replaced since this vector was indexed; the replacement has its own
        if config is not None:
            query, query_vector, candidate_vector = verify or (PairText(key.text, config.verify), None, None)
            decision = decide(similarity, query, _text(text), threshold=config.threshold, checks=config.verify,
                              query_vector=query_vector, candidate_vector=candidate_vector)  # fmt: skip
            if not decision.hit:
                return None
        payload = orjson.loads(body)
        usage = payload.get("usage")
        if max_output_tokens is not None and usage and int(usage.get("completion_tokens") or 0) > max_output_tokens:
            return None
        self._spawn(self._touch(owner, exact_key))
        return CacheHit(int(stored_id), exact_key, payload["response"], usage, similarity, entry_id is None)

    async def _touch(self, owner: str, exact_key: str) -> None:
        async def touch() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.zadd(self._lru(owner), {exact_key: int(time.time() * 1000)}, xx=True)
                pipe.hincrby(self._entry_prefix(owner) + exact_key, "hits", 1)
                await pipe.execute()

        try:
            await self._op(touch)
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
        semantic = vector is not None and config.semantic and len(key.text) <= config.max_text_chars
        blob = np.ascontiguousarray(vector, dtype=np.float32).tobytes() if semantic and vector is not None else b""
        expires = now + config.ttl_s
        body = orjson.dumps({"response": response, "usage": usage})
        event: dict[Any, Any] = {"op": "add", "src": self._origin, "id": entry_id, "owner": owner, "exact": key.exact,
                 "scope": key.scope, "tenant": key.tenant, "exp": repr(expires), "v": blob}  # fmt: skip

        async def write() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                await self._store_script(
                    keys=[self._entry_prefix(owner) + key.exact, self._lru(owner)],
                    args=[entry_id, int(now * 1000), max(1, int(config.ttl_s * 1000)), config.max_entries,
                          self._entry_prefix(owner), key.exact, key.scope, key.tenant, key.text, body, repr(expires)],
                    client=pipe,
                )  # fmt: skip
                pipe.xadd(self._stream, event, maxlen=self._stream_max_len, approximate=True)
                return list(await pipe.execute())

        try:
            evicted, _ = await self._op(write)
        except StoreDown:
            self.skipped += 1
            return 0
        gone = [int(i) for i in evicted or []]
        await self._call(self._add, entry_id, _Meta(owner, key.exact, key.scope, key.tenant, expires), vector if semantic else None)
        if gone:
            await self._call(self._remove, gone)
            await self._publish({"op": "del", "ids": _ids(gone)})
        return entry_id

    async def purge_tenant(self, tenant: str) -> int:
        """Delete every entry the tenant stored (its own and those it shared), on every replica."""
        shared = await self._call(self._shared_exacts, tenant)

        async def purge() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                await self._purge_script(keys=[self._lru(tenant)], args=[self._entry_prefix(tenant), ""], client=pipe)
                if shared:
                    await self._purge_script(
                        keys=[self._lru(_SHARED_OWNER)], args=[self._entry_prefix(_SHARED_OWNER), *shared], client=pipe
                    )
                return list(await pipe.execute())

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

    async def stats(self) -> dict[str, Any]:
        local = await self._call(self._local_stats)
        return {**local, "backend": "redis", "errors": self.errors, "skipped": self.skipped,
                "events_applied": self.applied, "stream_position": self._last_id}  # fmt: skip

    # Plumbing.

    async def _op(self, make: Callable[[], Awaitable[_T]]) -> _T:
        """One store operation within the timeout; StoreDown when it fails (or failed just now)."""
        if time.monotonic() < self._down_until:
            raise StoreDown()
        try:
            return await asyncio.wait_for(make(), self._timeout)
        except Exception as exc:  # any store failure (connection, timeout, script): the caller takes it as a miss
            self._failed(exc)
            raise StoreDown() from exc

    async def _publish(self, event: dict[Any, Any]) -> None:
        event["src"] = self._origin
        try:
            await self._op(lambda: self.client.xadd(self._stream, event, maxlen=self._stream_max_len, approximate=True))
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
        """Apply the stream's events from the last position read, for as long as the cache runs."""
        failures = 0
        while True:
            try:
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

    # Everything below runs on the worker thread.

    def _search(self, scope: str, vector: np.ndarray, k: int, threshold: float) -> list[tuple[int, _Meta, Neighbour]]:
        found = []
        for neighbour in self._index.search(scope, vector, k):
            meta = self._meta.get(neighbour.id)
            if neighbour.similarity >= threshold and meta is not None and meta.scope == scope:
                found.append((neighbour.id, meta, neighbour))
        return found

    def _add(self, entry_id: int, meta: _Meta, vector: np.ndarray | None) -> None:
        replaced = self._by_exact.get(meta.exact)
        if replaced is not None and replaced != entry_id:
            self._remove([replaced])
        self._meta[entry_id] = meta
        self._by_exact[meta.exact] = entry_id
        if vector is not None:
            self._index.add(entry_id, meta.scope, vector)

    def _remove(self, ids: list[int]) -> None:
        for entry_id in ids:
            meta = self._meta.pop(entry_id, None)
            if meta is not None and self._by_exact.get(meta.exact) == entry_id:
                del self._by_exact[meta.exact]
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
                    blob = fields.get(b"v") or b""
                    vector = np.frombuffer(blob, dtype=np.float32) if len(blob) == 4 * DIMENSION else None
                    meta = _Meta(fields[b"owner"].decode(), fields[b"exact"].decode(), fields[b"scope"].decode(),
                                 fields[b"tenant"].decode(), float(fields[b"exp"]))  # fmt: skip
                    if meta.expires > time.time():
                        self._add(int(fields[b"id"]), meta, vector)
                elif op == "del":
                    self._remove(_parse_ids(fields.get(b"ids", b"")))
                elif op == "purge":
                    self._purge_local(fields[b"tenant"].decode(), _parse_ids(fields.get(b"ids", b"")))
            except (KeyError, ValueError) as exc:
                logger.warning("shared cache: malformed %r event skipped: %r", op, exc)

    def _sweep(self, now: float) -> None:
        self._last_sweep = now
        self._remove([i for i, m in self._meta.items() if m.expires <= now])

    def _local_stats(self) -> dict[str, Any]:
        return {"entries_known": len(self._meta), "vectors": len(self._index)}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _ids(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids)


def _parse_ids(raw: bytes) -> list[int]:
    return [int(i) for i in raw.decode().split(",") if i]


async def open_shared_cache(
    policy: Policy, url: str, *, key_prefix: str, connect_timeout_s: float, op_timeout_s: float, stream_max_len: int
) -> SharedCache:
    """Build and start the shared cache (the component builder calls this with `state.backend: redis`)."""
    cache = SharedCache.connect(
        policy, url, key_prefix=key_prefix, connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s,
        stream_max_len=stream_max_len,
    )  # fmt: skip
    await cache.start()
    return cache
