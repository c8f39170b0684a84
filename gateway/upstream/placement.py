"""Which member a session is placed on: the best placed at its first turn (its prefix, then load), kept after.

A session walking its rendezvous ranking (affinity.py) lands on the same member from every replica
without anything shared, but the hash does not balance a few sessions: twelve agent sessions on
three llama.cpp servers put 27, 24 and 4 of 55 requests on the members (bench/prefix_affinity.py),
and a server holding six conversations in a KV cache sized for four evicts them in turn, so later
turns prefill again behind each other. Here a session's first turn goes to the member ranked first
by the pool's balancer (Balancer.preference: in prefix_affinity mode the member already sent the
most of its prompt, a tool list other sessions share, weighed against its load as a request without
a session is; with nothing matched the least loaded, by the scraped server load, then this
replica's requests in flight: what least-outstanding would pick), ties broken by the fewest
sessions used within `session_ttl_s`, then the session's ranking; every later
turn goes where the table says, as long as that member takes requests and is within the load
bound; otherwise it is placed again the same way and the move is written down, so the turns after
it follow it instead of going back. (Fewest sessions first would count sessions that have ended
until their TTL runs out and send new ones to a busy member.)

The table is this process's own (`LocalPlacement`) or, with `state.backend: redis`, one table for
every replica in Redis/Valkey (`SharedPlacement`: one script call per request, placing atomically,
so two replicas placing one new session at once agree). Several replicas without the shared store
would each keep their own table and part a session's turns between members: that deployment takes
`session_placement: rendezvous` (no table, agreement by hash). A store that does not answer within
`state.op_timeout_ms` leaves the request to the rendezvous walk, never waiting longer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, NamedTuple, Protocol

import orjson

from gateway.upstream.affinity import SessionKey

log = logging.getLogger("tierlane.upstream")


class Candidate(NamedTuple):
    """A member a session may be placed on, as the pool sees it now."""

    name: str
    may: bool  # takes requests and is within the load bound
    level: int = 0  # its rank among the candidates (0: the best placed: prefix held, then least loaded)


class Placed(NamedTuple):
    member: str
    moved: bool  # the session was on another member before


class Placement(Protocol):
    async def place(self, pool: str, session: SessionKey, candidates: Sequence[Candidate],
                    ttl_s: float) -> Placed | None:
        """The member of `candidates` (in order of preference) for the session's turn: where it was placed while
        that member may take it; else (a new session, or a move) the lowest level, then the one with the fewest
        live sessions, then the first in order."""
        ...

    async def close(self) -> None: ...


def session_id(session: SessionKey) -> str:
    """A session's id in the table: a digest of (tenant, name) as a structure (no two keys collide, no name stored)."""
    return hashlib.blake2b(orjson.dumps(["session", session.tenant, session.name]), digest_size=16).hexdigest()


@dataclass(slots=True)
class _PoolTable:
    """One pool's sessions, oldest use first, and each member's count of live sessions.

    NOTE: every use moves a session to the end, so the sessions past their TTL are always at the
    front: expiring them pops from there and stops at the first live one. A placement then costs
    O(candidates) plus the sessions that expired since the last one, never O(live sessions)."""

    sessions: OrderedDict[str, tuple[str, float]] = field(default_factory=OrderedDict)  # sid -> (member, last use)
    live: dict[str, int] = field(default_factory=dict)  # member -> sessions used within the TTL

    def drop_oldest(self) -> None:
        _, (member, _) = self.sessions.popitem(last=False)
        self._leave(member)

    def expire(self, now: float, ttl_s: float) -> None:
        sessions = self.sessions
        while sessions:
            sid = next(iter(sessions))
            if now - sessions[sid][1] <= ttl_s:
                return
            self.drop_oldest()

    def _leave(self, member: str) -> None:
        left = self.live[member] - 1
        if left:
            self.live[member] = left
        else:
            del self.live[member]

    def use(self, sid: str, member: str, now: float, previous: str | None) -> None:
        if previous is not None:
            self._leave(previous)
        self.sessions[sid] = (member, now)
        self.sessions.move_to_end(sid)
        self.live[member] = self.live.get(member, 0) + 1


# Sessions a pool's table keeps at most (the least recently used are forgotten past it, and placed
# afresh should they come back): a client minting a session per request fills the TTL's worth
# (session_ttl_s x requests/s) and no more than this, about 150 bytes each.
MAX_SESSIONS = 250_000


@dataclass
class LocalPlacement:
    """The table in this process: for one replica (or replicas that each serve whole sessions)."""

    clock: Callable[[], float] = time.monotonic
    max_sessions: int = MAX_SESSIONS
    _pools: dict[str, _PoolTable] = field(default_factory=dict)

    async def place(self, pool: str, session: SessionKey, candidates: Sequence[Candidate],
                    ttl_s: float) -> Placed | None:
        return self.place_now(pool, session_id(session), candidates, ttl_s)

    def place_now(self, pool: str, sid: str, candidates: Sequence[Candidate], ttl_s: float) -> Placed | None:
        now = self.clock()
        table = self._pools.get(pool)
        if table is None:
            table = self._pools[pool] = _PoolTable()
        table.expire(now, ttl_s)
        home = table.sessions.get(sid)
        current = home[0] if home is not None else None
        allowed = [c for c in candidates if c.may]
        if current is not None and any(c.name == current for c in allowed):
            pick, moved = current, False
        else:
            if not allowed:
                return None
            live = table.live
            pick = min(enumerate(allowed), key=lambda ic: (ic[1].level, live.get(ic[1].name, 0), ic[0]))[1].name
            moved = current is not None
        table.use(sid, pick, now, current)
        while len(table.sessions) > self.max_sessions:
            table.drop_oldest()
        return Placed(pick, moved)

    def sessions(self, pool: str) -> int:
        """The sessions the table holds for `pool` (used within the TTL, at most `max_sessions`)."""
        table = self._pools.get(pool)
        return len(table.sessions) if table is not None else 0

    async def close(self) -> None:
        return None


_SCRIPT = (resources.files("policies.shared_state") / "lua" / "place_session.lua").read_text("utf-8")


class SharedPlacement:
    """The table in Redis/Valkey, one for every replica: placed by one script, atomically."""

    def __init__(self, url: str, *, key_prefix: str, connect_timeout_s: float, op_timeout_s: float) -> None:
        from policies.shared_state.redis_mux import MuxClient  # redis is imported only when configured

        self._client = MuxClient(url, connect_timeout_s=connect_timeout_s, stale_after_s=max(1.0, 10 * op_timeout_s))
        self._script = self._client.script(_SCRIPT)
        self._prefix = key_prefix
        self._timeout = op_timeout_s
        self.failures = 0  # calls the store did not answer in time (the walk placed those turns)
        self._logged_at = 0.0

    async def place(self, pool: str, session: SessionKey, candidates: Sequence[Candidate],
                    ttl_s: float) -> Placed | None:
        sid = session_id(session)
        tag = f"{self._prefix}{{place:{pool}}}"  # one hash slot per pool: the script's keys meet in one slot
        keys = [f"{tag}:s:{sid}", *(f"{tag}:m:{c.name}" for c in candidates)]
        args: list[Any] = [int(ttl_s * 1000), sid]
        for c in candidates:
            args += [c.name, "1" if c.may else "0", c.level]
        try:
            reply = await asyncio.wait_for(self._script(keys, args), self._timeout)
        except Exception as exc:  # noqa: BLE001 - any store failure leaves the turn to the walk
            self.failures += 1
            now = time.monotonic()
            if now - self._logged_at > 10:
                self._logged_at = now
                log.warning("session placement store unavailable (%s): sessions walk their ranking meanwhile", exc)
            return None
        if not reply:
            return None
        member = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        return Placed(member, bool(int(reply[1])))

    async def close(self) -> None:
        await self._client.close()
