"""Named upstreams grouped into pools: prefix/session affinity or least-outstanding balancing, flow control by priority
class, retries, fallback, breakers."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from email.utils import parsedate_to_datetime
from typing import Any, NamedTuple

import aiohttp
import orjson

from gateway.errors import (
    MAX_RETRY_AFTER_S,
    BadUpstreamResponse,
    GatewayError,
    InvalidRequest,
    RateLimited,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.settings import PoolSettings, Settings, UpstreamSettings
from gateway.upstream.adapt import adapt
from gateway.upstream.affinity import AffinityKey, Balancer
from gateway.upstream.breaker import CircuitBreaker
from gateway.upstream.flow import Gate, PoolFlow, Slot, snapshot
from gateway.upstream.held import ERROR_STATUSES, hold
from gateway.upstream.placement import Candidate, LocalPlacement, Placement, SharedPlacement
from gateway.upstream.server_load import STALE_INTERVALS, ServerLoad, current, keep_scraping
from gateway.upstream.sse import ErrorEvent, iter_events
from gateway.upstream.to_messages import to_messages, translated_headers
from policies.domain import Priority
from telemetry.flow_metrics import FlowClassStats, FlowMemberStats

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 529})  # 529: Anthropic's overload
# A member without chat (api.anthropic.com) also retries its 500 (`api_error`, a failure inside Anthropic);
# elsewhere a 500 may be a server's answer to a body it cannot take (llama.cpp's), which no retry changes.
MESSAGES_RETRY_STATUSES = RETRY_STATUSES | {500}
UNHEALTHY_STATUSES = frozenset({502, 503, 504, 529})  # answers that say the upstream itself is in trouble
# The half-open probe: GET {base_url}/models, given this long at most.
PROBE_TIMEOUT_S = 5.0
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
        "content-type", "accept-encoding", "content-encoding", "authorization", "api-key",
        "x-api-key", "cookie", "expect",
    }
)


def forwardable_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers minus hop-by-hop, credentials and tierlane's own controls."""
    named = {h.strip().lower() for h in headers.get("Connection", "").split(",") if h.strip()}
    out: dict[str, str] = {}
    for name, value in headers.items():
        low = name.lower()
        if low in HOP_BY_HOP or low in named or low.startswith("x-tierlane-") or low == "cache-control":
            continue
        out[name] = value
    return out


def retry_after_seconds(value: str | None) -> float | None:
    """An upstream's Retry-After (seconds or an HTTP date) as seconds in [0, MAX_RETRY_AFTER_S].

    None when absent or unusable (garbage, NaN, infinities): the header is then ignored.
    """
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError, IndexError):
            return None
    if not math.isfinite(seconds):
        return None
    return min(float(MAX_RETRY_AFTER_S), max(0.0, seconds))


@dataclass(slots=True, frozen=True)
class NativeRequest:
    """A front door's request as its client sent it, for a member that serves that API itself."""

    api: str  # "messages"
    path: str  # "/messages"
    body: dict[str, Any]


@dataclass(slots=True, eq=False)
class Upstream:
    """One OpenAI-compatible server and its connection pool."""

    settings: UpstreamSettings
    breaker: CircuitBreaker
    session: aiohttp.ClientSession | None = None
    inflight: int = 0
    wildcard: bool = False
    models: frozenset[str] = field(default_factory=frozenset)
    discovered: tuple[str, ...] = ()  # what a wildcard upstream's /models listed at start
    server_load: ServerLoad | None = None  # its own metrics' last reading (metrics_url)
    sent_at: list[float] = field(default_factory=list)  # monotonic send time of each of this replica's outstanding requests
    gate: Gate | None = None  # flow control: its budget and the requests waiting for it (flow.py)

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def load(self) -> int:
        """Requests on this server: the gateway's own, or the server's count where scraped and higher."""
        server = current(self.server_load, self.settings.metrics_interval_s)
        return self.inflight if server is None else max(self.inflight, server.requests)

    @property
    def shared_load(self) -> int:
        """The server's own count where scraped and current, plus this replica's requests sent since that
        scrape and still outstanding (the scrape could not count them yet); else (no metrics, or stale) this
        replica's outstanding requests. Every replica reads the scraped part alike; the part each adds is
        what it alone knows it sent since. The balancer's load bound reads this."""
        server = current(self.server_load, self.settings.metrics_interval_s)
        if server is None:
            return self.inflight
        return server.requests + sum(1 for t in self.sent_at if t > server.at)

    @property
    def kv_usage(self) -> float:
        server = current(self.server_load, self.settings.metrics_interval_s)
        return 0.0 if server is None or server.kv_usage is None else server.kv_usage

    def serves(self, model: str) -> bool:
        return self.wildcard or model in self.models


class _Failure(NamedTuple):
    """Why one try failed and whether the request may go out again.

    `retry`: the pool may try again (the next member at once). `same_member`: retrying the
    member that just failed is worth it, after `delay` seconds (backoff or Retry-After).
    """

    error: GatewayError
    retry: bool = False
    same_member: bool = False
    delay: float = 0.0


@dataclass(slots=True, eq=False)
class UpstreamReply:
    """An upstream's answer. For streams `response` is still open: call `release()` when done."""

    upstream: Upstream
    status: int
    response: aiohttp.ClientResponse | None = None
    body: Any = None
    attempts: int = 1
    native: bool = False  # the member served the client's own API: the reply is in that API's shape
    api: str = "chat"  # the API the member answered in: "messages" for a member without chat (translated, or native)
    sent_at: float = 0.0  # time.monotonic() when the request went out (the member's `sent_at` holds it until release)
    events: AsyncIterator[Any] | None = None  # a Messages stream read up to its first content (held.py)
    queued_s: float = 0.0  # how long the request waited for members at their budget (flow control)
    slot: Slot | None = None  # its place on the member, held until release
    _pool: UpstreamPool | None = None

    def stream_events(self) -> AsyncIterator[Any]:
        """The stream's events (`sse.iter_events`), those the pool read already first."""
        assert self.response is not None
        if self.events is not None:
            return self.events
        return iter_events(self.response.content, self.upstream.settings.max_response_bytes)

    def release(self, ok: bool = True, blame: bool | None = None) -> None:
        """Give the connection back (`ok`) or drop it; `blame` counts a failure on the breaker."""
        if self.response is not None:
            self.response.release() if ok else self.response.close()
            self.response = None
        if self._pool is not None:
            self._pool._finish(self.upstream, not (not ok if blame is None else blame), self.sent_at)
            self._pool = None
        if self.slot is not None:
            self.slot.release()
            self.slot = None


def _key_headers(cfg: UpstreamSettings, path: str) -> dict[str, str]:
    """How the member's own key goes: a member without chat (api.anthropic.com) takes it in
    `x-api-key` alone (Anthropic reads a Bearer token as OAuth and refuses an API key there); a chat
    member takes Bearer, and on its /messages (vLLM) the same key in `x-api-key` too."""
    assert cfg.api_key
    if "chat" not in cfg.apis:
        return {"x-api-key": cfg.api_key}
    if path == "/messages":
        return {"Authorization": f"Bearer {cfg.api_key}", "x-api-key": cfg.api_key}
    return {"Authorization": f"Bearer {cfg.api_key}"}


class UpstreamPool:
    """Every configured upstream, by pool; `send` picks one, retries and falls back."""

    def __init__(self, settings: Settings) -> None:
        self._upstreams: list[Upstream] = []
        self._by_pool: dict[str, list[Upstream]] = {}
        for cfg in settings.upstreams:
            upstream = Upstream(
                settings=cfg,
                breaker=CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s),
                wildcard="*" in cfg.models,
                models=frozenset(m for m in cfg.models if m != "*"),
            )
            self._upstreams.append(upstream)
            self._by_pool.setdefault(cfg.pool, []).append(upstream)
        self._pools: dict[str, PoolSettings] = {
            name: settings.pools.get(name, PoolSettings()) for name in self._by_pool
        }
        self._flows = {name: PoolFlow(name, self._pools[name].flow) for name in self._by_pool}
        for upstream in self._upstreams:
            cfg = upstream.settings
            upstream.gate = self._flows[cfg.pool].gate(cfg.name, cfg.max_concurrency, STALE_INTERVALS * cfg.metrics_interval_s)
        # prefix and session affinity, per pool of more than one member (one member has no choice to make)
        self._balancers: dict[str, Balancer] = {
            name: Balancer(self._pools[name].balance, self._pools[name].max_load_ratio)
            for name, members in self._by_pool.items() if len(members) > 1
        }
        # where sessions are placed (balanced pools): one table for every replica where the state is shared
        self._state = settings.state
        self._placement: Placement | None = None
        if any(self._places_sessions(name) for name in self._balancers):
            self._placement = LocalPlacement() if settings.state.backend != "redis" else None  # shared: at start
        for name, pool in settings.pools.items():
            unknown = [f for f in pool.fallback if f not in self._by_pool]
            if name in self._by_pool and unknown:
                raise ValueError(f"pool {name!r} falls back to unknown pool(s) {unknown}")
        self._watcher: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()
        self._scrapers: list[asyncio.Task[None]] = []
        self._wake: asyncio.Event | None = None

    def _places_sessions(self, pool: str) -> bool:
        balancer = self._balancers.get(pool)
        return (balancer is not None and balancer.mode in ("prefix_affinity", "session")
                and self._pools[pool].session_placement == "balanced")

    async def start(self) -> None:
        if self._placement is None and any(self._places_sessions(name) for name in self._balancers):
            state = self._state
            self._placement = SharedPlacement(state.url, key_prefix=state.key_prefix,
                                              connect_timeout_s=state.connect_timeout_ms / 1000.0,
                                              op_timeout_s=state.op_timeout_ms / 1000.0)
        for upstream in self._upstreams:
            cfg = upstream.settings
            upstream.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=cfg.max_connections, ttl_dns_cache=300),
                timeout=aiohttp.ClientTimeout(
                    total=cfg.total_timeout_s,
                    sock_connect=cfg.connect_timeout_s,
                    sock_read=cfg.read_timeout_s,
                ),
                json_serialize=lambda o: orjson.dumps(o).decode(),
                auto_decompress=True,
            )
        await asyncio.gather(*(self._discover(u) for u in self._upstreams if u.wildcard))
        if self._upstreams and self._watcher is None:
            self._wake = asyncio.Event()
            self._watcher = asyncio.create_task(self._watch_breakers(), name="tierlane-breaker-probes")
        for upstream in self._upstreams:
            cfg = upstream.settings
            if cfg.metrics_url is not None and upstream.session is not None:
                observe = upstream.gate.observe if upstream.gate is not None else None
                self._scrapers.append(asyncio.create_task(
                    keep_scraping(upstream.session, cfg.metrics_url, cfg.metrics_interval_s, upstream, observe),
                    name=f"tierlane-metrics-{upstream.name}"))

    async def _discover(self, upstream: Upstream) -> None:
        """Ask a wildcard upstream which models it serves, so `auto` has a name to send it."""
        assert upstream.session is not None
        headers = _key_headers(upstream.settings, "/models") if upstream.settings.api_key else {}
        if "chat" not in upstream.settings.apis:
            headers = translated_headers(headers)
        try:
            async with upstream.session.get(
                upstream.settings.base_url + "/models", headers=headers, timeout=aiohttp.ClientTimeout(total=3)
            ) as resp:
                data = orjson.loads(await resp.read()) if resp.status == 200 else {}
        except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
            log.info("upstream %s: model discovery failed (%s); auto needs a named model", upstream.name, exc)
            return
        items = data.get("data") if isinstance(data, dict) else None
        upstream.discovered = tuple(
            str(m["id"]) for m in items or () if isinstance(m, dict) and isinstance(m.get("id"), str)
        )

    async def close(self) -> None:
        tasks = [t for t in (self._watcher, *self._probes, *self._scrapers) if t is not None]
        self._watcher, self._wake = None, None
        self._scrapers.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._probes.clear()
        for upstream in self._upstreams:
            if upstream.session is not None:
                await upstream.session.close()
                upstream.session = None
        if self._placement is not None:
            await self._placement.close()

    # -- half-open probes: the gateway's own requests, never a client's -------------------
    async def _watch_breakers(self) -> None:
        """Start a probe for each breaker whose cooldown has passed; sleep until the next is due."""
        wake = self._wake
        assert wake is not None
        while True:
            wake.clear()
            due: list[float] = []
            for upstream in self._upstreams:
                if upstream.breaker.claim_probe():
                    task = asyncio.create_task(self._probe(upstream), name=f"tierlane-probe-{upstream.name}")
                    self._probes.add(task)
                    task.add_done_callback(self._probes.discard)
                    continue
                wait = upstream.breaker.due_in()
                if wait is not None:
                    due.append(max(wait, 0.005))
            try:
                await asyncio.wait_for(wake.wait(), min(due) if due else None)
            except TimeoutError:
                pass

    async def _probe(self, upstream: Upstream) -> None:
        """GET {base_url}/models with the upstream's key: any answer below 500 in time closes the breaker.

        A 4xx still proves the server is up and answering HTTP (an upstream without /models,
        or one that wants the client's own key); a 5xx, a timeout or no connection does not.
        """
        cfg = upstream.settings
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S, sock_connect=min(cfg.connect_timeout_s, PROBE_TIMEOUT_S))
        ok = False
        try:
            if upstream.session is not None:
                async with upstream.session.get(cfg.base_url + "/models", headers=headers, timeout=timeout) as resp:
                    ok = resp.status < 500
                    log.info("upstream %s: breaker probe answered %d", upstream.name, resp.status)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.info("upstream %s: breaker probe failed: %r", upstream.name, exc)
        except Exception:
            log.exception("upstream %s: breaker probe failed", upstream.name)
        upstream.breaker.end_probe(ok)
        if ok:
            log.warning("upstream %s: breaker closed after a successful probe", upstream.name)
        if self._wake is not None:
            self._wake.set()

    # -- what the rest of the gateway asks --------------------------------------------------
    def has_upstreams(self) -> bool:
        return bool(self._upstreams)

    def pool_names(self) -> list[str]:
        return list(self._by_pool)

    def pool_for_model(self, model: str) -> str | None:
        """The first pool with an upstream that names `model` explicitly, else one serving any."""
        for name, members in self._by_pool.items():
            if any(model in u.models for u in members):
                return name
        for name, members in self._by_pool.items():
            if any(u.wildcard for u in members):
                return name
        return None

    def default_model(self, pool: str | None) -> str | None:
        """The first model a pool's upstreams name: what `auto` requests sent there ask for."""
        members = self._by_pool.get(pool or "", ())
        for upstream in members:
            for name in upstream.settings.models:
                if name != "*":
                    return name
        for upstream in members:
            if upstream.discovered:
                return upstream.discovered[0]
        return None

    def model_names(self) -> list[str]:
        return sorted({m for u in self._upstreams for m in (*u.models, *u.discovered)})

    def healthy(self) -> bool:
        return any(u.breaker.available() for u in self._upstreams)

    def flow_stats(self) -> tuple[list[FlowClassStats], list[FlowMemberStats]]:
        """Flow control's figures per pool and class, and each member's budget (telemetry/flow_metrics.py)."""
        return snapshot(list(self._flows.values()))

    def status(self) -> list[dict[str, Any]]:
        return [
            {"name": u.name, "pool": u.settings.pool, "breaker": u.breaker.state, "inflight": u.inflight}
            for u in self._upstreams
        ]

    # -- sending ---------------------------------------------------------------------------
    def serves_natively(self, pool: str, api: str) -> bool:
        """Whether any upstream `pool` may send a request to (fallbacks included) declares `api`: then a
        request of that API carries its own body too, for the members that serve it (`send(native=...)`)."""
        return any(api in u.settings.apis for name in self._chain(pool) for u in self._by_pool[name])

    def _chain(self, pool: str) -> list[str]:
        chain, todo = [], [pool]
        while todo:
            name = todo.pop(0)
            if name in chain or name not in self._by_pool:
                continue
            chain.append(name)
            todo.extend(self._pools[name].fallback)
        return chain

    def wants_affinity(self, pool: str) -> bool:
        """Whether `pool` (or a pool it falls back to) picks members by prefix or session: worth a key."""
        return any(b.mode != "least_outstanding" for name in self._chain(pool) if (b := self._balancers.get(name)))

    def balancer(self, pool: str) -> Balancer | None:
        return self._balancers.get(pool)

    def _pick(
        self, members: Iterable[Upstream], model: str, tried: set[int], barred: Collection[int] = (),
        balancer: Balancer | None = None, key: AffinityKey | None = None,
    ) -> Upstream | None:
        """The member for a request: serving `model`, breaker closed, untried ones first; among them the
        pool's balancer's choice (prefix or session affinity), else the least busy."""
        candidates = [u for u in members if u.serves(model) and u.breaker.allow() and id(u) not in barred]
        fresh = [u for u in candidates if id(u) not in tried] or candidates
        if not fresh:
            return None
        if balancer is not None:
            chosen = balancer.choose(fresh, key)
            assert isinstance(chosen, Upstream)
            return chosen
        least = min(u.load for u in fresh)
        return random.choice([u for u in fresh if u.load == least])

    def _finish(self, upstream: Upstream, ok: bool, sent_at: float) -> None:
        upstream.inflight -= 1
        try:
            upstream.sent_at.remove(sent_at)
        except ValueError:
            pass
        if ok:
            upstream.breaker.success()
        else:
            upstream.breaker.failure()
            if upstream.breaker.opened_at is not None:
                balancer = self._balancers.get(upstream.settings.pool)
                if balancer is not None:
                    balancer.forget(upstream)  # a member that left: its cache is not counted on (its sessions walk on)
                if self._wake is not None:
                    self._wake.set()  # the watcher schedules this breaker's probe

    async def send(
        self,
        pool: str,
        path: str,
        body: dict[str, Any],
        *,
        headers: Mapping[str, str],
        model: str,
        stream: bool,
        client_authorization: str | None = None,
        affinity: AffinityKey | None = None,
        session: str | None = None,
        tenant: str | None = None,
        native: NativeRequest | None = None,
        priority: Priority = "interactive",
    ) -> UpstreamReply:
        """POST `body` to `path` on an upstream of `pool` (then its fallbacks) and return its reply.

        `affinity` (the prompt's tenant-salted prefix blocks and its (tenant, session)) lets a pool's
        balancer pick the member that holds them; the member a request went to is noted as holding its
        prefix; a session goes where the placement table puts it (balanced pools), else walks its ranking. `session` goes as
        `prompt_cache_key` to members that take one, and `tenant`'s salt as `cache_salt` to those that take it.

        `native`: the client's own request (its API, path and body) for a member that serves that API
        itself (`upstreams[].apis`); the others get `body` at `path`. Decided per member tried, so a
        fallback that does not serve it translates only when it is the one that answers
        (`reply.native` says which). A member whose `apis` leave out chat gets a chat `body` as a
        Messages request with the cache breakpoints placed (to_messages; `reply.api` is then "messages").

        `priority`: the request's class, where the member picked is at its concurrency budget (flow.py): it
        waits its turn there (`reply.queued_s`), or is answered UpstreamBusy (429) when it may not.

        A 2xx reply to a stream comes back with the response open; anything else is read whole.
        """
        # the body as sent, serialised once per distinct set of member settings that change it (adapt)
        payloads: dict[tuple[int | None, str, bool, bool, str], bytes] = {}
        last_error: GatewayError = UpstreamUnavailable(f"no healthy upstream serves model {model!r}")
        attempts = 0
        queued = 0.0
        for pool_name in self._chain(pool):
            tried: set[int] = set()
            members = self._by_pool[pool_name]
            budget = 1 + max(u.settings.retries for u in members)
            failed: dict[int, _Failure] = {}  # the last failure of each member tried
            barred: set[int] = set()  # members not worth a second try for this request
            balancer = self._balancers.get(pool_name)
            turn = await self._place(pool_name, members, model, balancer, affinity)
            for _ in range(budget):
                upstream = self._pick(members, model, tried, barred, balancer, turn)
                if upstream is None:
                    break
                before = failed.get(id(upstream))
                if before is not None and before.delay > 0:
                    # Backoff (or the upstream's Retry-After) only before trying the same member
                    # again: another member is a different host and is tried at once.
                    await asyncio.sleep(before.delay)
                    upstream = self._pick(members, model, tried, barred, balancer, turn)  # breakers may have moved
                    if upstream is None:
                        break
                tried.add(id(upstream))
                attempts += 1
                cfg = upstream.settings
                as_native = native is not None and native.api in cfg.apis
                wire = native.api if native is not None and as_native else "chat" if "chat" in cfg.apis else "messages"
                member_path = native.path if native is not None and as_native else path
                member_headers = headers
                key = (cfg.max_output_tokens, cfg.system_messages, cfg.sends_prompt_cache_key, cfg.cache_salt,
                       "native" if as_native else wire)
                sent = payloads.get(key)
                if sent is None:
                    # NOTE: the client's own body goes to a member that serves its API as it was sent
                    sent = payloads[key] = (orjson.dumps(native.body) if native is not None and as_native
                                            else self._payload(body, cfg, path, wire, session, tenant))
                if not as_native and wire == "messages":
                    # NOTE: a native Messages request keeps the client's `anthropic-*` headers (its body was
                    # written for them); one the gateway translated goes with the gateway's own
                    member_path, member_headers = "/messages", translated_headers(headers)
                # NOTE: placement picked the member; flow control decides when it is sent there
                slot = await upstream.gate.acquire(priority, tenant, queued) if upstream.gate is not None else None
                queued += slot.waited_s if slot is not None else 0.0
                try:
                    reply, failure = await self._attempt(upstream, member_path, sent, member_headers, stream,
                                                         client_authorization, wire == "messages", slot)
                except BaseException:
                    if slot is not None:
                        slot.release()  # once: a reply that took it released it already
                    raise
                if reply is not None:
                    reply.attempts = attempts
                    reply.queued_s = queued
                    reply.native = as_native
                    reply.api = wire
                    if balancer is not None:
                        balancer.record(upstream, affinity, upstream.settings.kv_capacity_tokens)
                    return reply
                assert failure is not None
                last_error = failure.error
                if not failure.retry:
                    break
                failed[id(upstream)] = failure
                if not failure.same_member:
                    barred.add(id(upstream))
        raise last_error

    @staticmethod
    def _payload(body: dict[str, Any], cfg: UpstreamSettings, path: str, wire: str, session: str | None,
                 tenant: str | None) -> bytes:
        """`body` as the member takes it: adapted, and for a member without chat as a Messages request."""
        adapted = adapt(body, cfg, path, session, tenant)
        if wire != "messages":
            return orjson.dumps(adapted)
        if path != "/chat/completions":
            raise InvalidRequest(f"upstream {cfg.name!r} serves only the Messages API: it takes chat requests, not "
                                 f"{path}", code="unsupported_operation")
        return orjson.dumps(to_messages(adapted, cfg.max_output_tokens))

    async def _place(self, pool: str, members: list[Upstream], model: str, balancer: Balancer | None,
                     affinity: AffinityKey | None) -> AffinityKey | None:
        """`affinity` with the member the placement table names for its session's turn (balanced pools)."""
        if (affinity is None or affinity.session is None or balancer is None or self._placement is None
                or not self._places_sessions(pool)):
            return affinity
        candidates = [u for u in members if u.serves(model) and u.breaker.allow()]
        if not candidates:
            return affinity
        allowed = {id(u) for u in balancer.within_bound(candidates)}
        order = balancer.preference(candidates, affinity)
        levels = sorted({rank for _, rank in order})
        placed = await self._placement.place(
            pool, affinity.session, [Candidate(u.name, id(u) in allowed, levels.index(rank)) for u, rank in order],
            self._pools[pool].session_ttl_s)
        if placed is None:
            return affinity
        if placed.moved:
            balancer.moves += 1
        return replace(affinity, placed=placed.member)

    async def _attempt(
        self,
        upstream: Upstream,
        path: str,
        payload: bytes,
        headers: Mapping[str, str],
        stream: bool,
        client_authorization: str | None,
        holds: bool = False,
        slot: Slot | None = None,
    ) -> tuple[UpstreamReply | None, _Failure | None]:
        """One try. Returns (reply, None) or (None, why it failed and whether to try again).

        `holds`: a 2xx stream is a Messages one, read up to its first content here (held.py)."""
        cfg = upstream.settings
        assert upstream.session is not None, "UpstreamPool.start() was not awaited"
        out_headers = dict(headers)
        out_headers["Content-Type"] = "application/json"
        if cfg.pass_client_auth and client_authorization:
            out_headers["Authorization"] = client_authorization
        elif cfg.api_key:
            out_headers.update(_key_headers(cfg, path))
        upstream.inflight += 1
        reply = UpstreamReply(upstream=upstream, status=0, sent_at=time.monotonic(), slot=slot, _pool=self)
        upstream.sent_at.append(reply.sent_at)
        backoff = min(cfg.backoff_max_s, cfg.backoff_base_s * (2 ** random.random()))
        try:
            resp = await upstream.session.post(cfg.base_url + path, data=payload, headers=out_headers)
        except aiohttp.ConnectionTimeoutError:
            # No connection within connect_timeout_s: nothing was sent, so another member is
            # tried at once; this one (black-holing, or overloaded) not again for this request.
            reply.release(ok=False)
            log.warning("upstream %s: no connection within %ss", upstream.name, cfg.connect_timeout_s)
            error: GatewayError = UpstreamTimeout(f"upstream {upstream.name!r} did not accept a connection in time")
            return None, _Failure(error, retry=True, same_member=False)
        except TimeoutError:
            # The request went out and no answer came in time: a generation is not idempotent,
            # so it is not sent again.
            reply.release(ok=False)
            return None, _Failure(UpstreamTimeout(f"upstream {upstream.name!r} did not answer in time"))
        except aiohttp.ClientConnectorError as exc:
            # Refused, unresolvable, unreachable: nothing was sent. Another member at once; this
            # one again only after the backoff.
            reply.release(ok=False)
            log.warning("upstream %s: could not connect: %s", upstream.name, exc)
            error = UpstreamUnavailable(f"upstream {upstream.name!r} is unreachable")
            return None, _Failure(error, retry=True, same_member=True, delay=backoff)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            reply.release(ok=False)
            log.warning("upstream %s: connection failed: %s", upstream.name, exc)
            error = UpstreamUnavailable(f"upstream {upstream.name!r} is unreachable")
            return None, _Failure(error, retry=True, same_member=True, delay=backoff)
        except BaseException:
            reply.release(ok=False)
            raise
        reply.status = resp.status
        if resp.status in (RETRY_STATUSES if "chat" in cfg.apis else MESSAGES_RETRY_STATUSES):
            wait = retry_after_seconds(resp.headers.get("Retry-After"))
            error = await _error_from(resp, upstream, wait)
            resp.release()
            # 429 says "slow down", not "broken": it does not count against the breaker.
            reply.release(ok=resp.status == 429)
            if wait is not None and wait > cfg.max_retry_after_s:
                # Too long to wait here: another member may take it, else the client hears it.
                return None, _Failure(error, retry=True, same_member=False)
            return None, _Failure(error, retry=True, same_member=True, delay=max(backoff, wait or 0.0))
        try:
            if stream and 200 <= resp.status < 300:
                reply.response = resp
                if holds:
                    reply.events = await hold(iter_events(resp.content, cfg.max_response_bytes))
                return reply, None
            reply.body = await _read_json(resp, cfg.max_response_bytes)
        except ErrorEvent as exc:
            # an error before any content reached the client: a failed try, as the status it stands for
            status = ERROR_STATUSES.get(exc.kind or "")
            resp.close()
            reply.release(ok=False, blame=status is not None and status != 429)
            if status is None:
                return None, _Failure(exc)
            error = _status_error(status, upstream, f": {exc.detail} (an error event before the answer's first content)", None)
            return None, _Failure(error, retry=True, same_member=True, delay=backoff)
        except TimeoutError:
            resp.close()
            reply.release(ok=False)
            return None, _Failure(UpstreamTimeout(f"upstream {upstream.name!r} did not answer in time"))
        except (aiohttp.ClientError, OSError):
            resp.close()
            reply.release(ok=False)
            return None, _Failure(UpstreamError(f"upstream {upstream.name!r} broke off its answer"))
        except GatewayError as exc:
            resp.close()
            reply.release(ok=False)
            return None, _Failure(exc)
        except BaseException:
            resp.close()
            reply.release(ok=False)
            raise
        # NOTE: an upstream that answers a request with an error (llama.cpp's server says 500 for
        # a body it cannot validate) is up; only gateway-class statuses count against its
        # breaker, or one tenant's bad requests would open it for every tenant.
        reply.release(ok=resp.status not in UNHEALTHY_STATUSES)
        return reply, None


async def _read_json(resp: aiohttp.ClientResponse, limit: int) -> Any:
    length = resp.content_length
    if length is not None and length > limit:
        raise UpstreamError("the upstream answer exceeded the response size limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise UpstreamError("the upstream answer exceeded the response size limit")
        chunks.append(chunk)
    try:
        return orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError:
        raise BadUpstreamResponse("the upstream sent malformed JSON") from None


async def _error_from(resp: aiohttp.ClientResponse, upstream: Upstream, wait: float | None) -> GatewayError:
    try:
        raw = await resp.content.read(65536)
        message = orjson.loads(raw).get("error", {}).get("message")
    except Exception:  # noqa: BLE001 - any unreadable error body gets the generic message
        message = None
    detail = f": {message}" if message else ""
    return _status_error(resp.status, upstream, detail, wait)


def _status_error(status: int, upstream: Upstream, detail: str, wait: float | None) -> GatewayError:
    """What a retryable failure status is to the client once no member is left to try."""
    if status == 429:
        return RateLimited(f"upstream {upstream.name!r} is rate limited{detail}", retry_after=wait)
    if status in (503, 529):
        return UpstreamUnavailable(f"upstream {upstream.name!r} is unavailable{detail}", retry_after=wait)
    return UpstreamError(f"upstream {upstream.name!r} answered {status}{detail}")
