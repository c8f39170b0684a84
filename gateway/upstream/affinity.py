"""Which member of a pool already holds a request's prompt prefix (or its session) in its KV cache.

A self-hosted server (vLLM, SGLang, llama.cpp's server) reuses a prompt prefix's KV cache only
for a request that lands on the replica that computed it; balanced by load alone, an agent's
next turn finds its prefix cached about 1/N of the time. The pool keeps, per member, an
approximate index of the prefixes it sent there (llm-d's approximate prefix scorer, without
the server's help): the rendered prompt cut in BLOCK_CHARS blocks, each block's hash chained
to the one before (so a hash stands for the whole prefix up to it), an LRU of them per member
sized by the member's KV capacity (it forgets what the server will have evicted). A request goes
to the member with the longest matched prefix, weighed against load (vLLM production-stack's
score: matched share - LOAD_WEIGHT x relative load), never to a member with more than
`max_load_ratio` times the members' mean load, this request counted (bounded loads); with no match it is the least
loaded member. The chain of block hashes starts from the request's tenant, so one tenant's prompt
never matches what another tenant sent (the member named in `x-tierlane-upstream` says nothing of
other tenants' prompts; a prefix two tenants share is no longer steered to one member for both).

A session is keyed by (tenant, session name). In a pool with `session_placement: balanced` (the
default) the pool first asks the placement table (placement.py) for the session's member: at its
first turn the one `Balancer.preference` ranks first (the prompt's prefix weighed against load, as
for a request without a session; ties: the fewest live sessions), kept after; the balancer sends
the turn there.
Without a table's answer (`session_placement: rendezvous`, or a shared store that did not answer in
time) the session walks that key's rendezvous ranking of the members (vLLM production-stack's
session mode, with the fallback order made explicit): it goes to the first member of the ranking
that takes requests and is within the load bound. Nothing about the session is remembered then, so
every gateway replica makes the same choice from the same inputs: a member over the bound is
skipped by every replica that sees it over the bound, the session goes to the next member of its
ranking there, and the turn after the member is back within the bound (or its breaker closes
again) goes to it again, on every replica alike. A tenant naming its session like another tenant's
lands on its own ranking and moves nothing.

The load the bound and the choice read is, where a member's metrics are scraped (`metrics_url`,
`server_load.py`) and the reading is current, the server's own running plus waiting requests (other
clients and other replicas count too), read alike by every replica, plus the requests this replica
sent there since that reading and still outstanding: a reading is up to `metrics_interval_s` old,
and a burst sent within one interval would otherwise land on one member before any scrape shows it
(measured: with the scraped count alone, prefix affinity fell from 2.67x to 1.06x least-outstanding's
throughput at 4 sessions in flight). The replica's outstanding requests also break ties between
members of equal load. So replicas agree on a session's member wherever their own recent sends do
not put it over the bound; a replica whose own burst does sends that one turn elsewhere while the
others do not, and since nothing is pinned the next turn goes back as soon as the burst is
scraped or done: they part for a turn at a time, never for the rest of the session. A member
without metrics (or whose reading went stale) has only each replica's own outstanding count to go
by, with the same consequence.

Measured in bench/prefix_affinity.py (before this walk): two replicas reached 0.82x one replica's
cached share, lost to sessions one replica moved off a member over the bound and pinned elsewhere
while the other kept sending them to their hash member. A shared index (Valkey) would add a round
trip to every request for what the hash gives for free.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import orjson

BLOCK_CHARS = 256  # ~64 tokens of English
MAX_BLOCKS = 4096  # the first 1 MiB of a prompt is indexed; beyond, matching it says nothing more
CHARS_PER_TOKEN = 4
LOAD_WEIGHT = 0.5  # how much a member's relative load weighs against its matched prefix share
KV_FULL = 0.9  # a member's KV use (where its metrics say) above which an unmatched prompt goes elsewhere if it can


class Member(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def shared_load(self) -> int:
        """The scraped requests plus this replica's sent since that scrape; else this replica's own outstanding."""
        ...

    @property
    def inflight(self) -> int:
        """This replica's own outstanding requests to the member: a tie-breaker only."""
        ...

    @property
    def kv_usage(self) -> float: ...


class SessionKey(NamedTuple):
    """One conversation: its tenant and the name the client gave it (two tenants' names never meet)."""

    tenant: str | None
    name: str


@dataclass(frozen=True, slots=True)
class AffinityKey:
    """What the balancer reads of one request: its prompt's chained block hashes and its session."""

    blocks: tuple[int, ...] = ()
    session: SessionKey | None = None
    placed: str | None = None  # the member the session's placement table names for this turn (placement.py)


def prompt_text(body: Mapping[str, Any], limit: int = MAX_BLOCKS * BLOCK_CHARS) -> str:
    """The prompt as a server renders it, near enough for prefixes: tools, then each message in order;
    at most `limit` characters are put together (what is indexed), however long the prompt."""
    parts: list[str] = []
    size = 0
    tools = body.get("tools")
    if tools:
        parts.append(orjson.dumps(tools).decode())
    system = body.get("system")  # a native Messages body
    if system:
        parts.append(system if isinstance(system, str) else orjson.dumps(system).decode())
    for message in body.get("messages") or ():
        if not isinstance(message, Mapping):
            continue
        content = message.get("content")
        text = content if isinstance(content, str) else orjson.dumps(content).decode()
        calls = message.get("tool_calls")
        parts.append(f"{message.get('role')}\x1f{text}" + (orjson.dumps(calls).decode() if calls else ""))
        size += len(parts[-1]) + 1
        if size >= limit:
            break
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    return "\x1e".join(parts)[:limit]


def key_for(body: Mapping[str, Any], session: str | None, tenant: str | None = None) -> AffinityKey:
    """The chained hashes of the prompt's whole blocks (a partial last block is left out: it changes),
    the chain salted with `tenant` (a tenant's prompt never matches another's), and the session as
    (tenant, name). Without a tenant the chain is unsalted: the same hashes as every replica before."""
    text = prompt_text(body)
    whole = min(len(text) // BLOCK_CHARS, MAX_BLOCKS)
    blocks: list[int] = []
    previous = b"" if tenant is None else hashlib.blake2b(orjson.dumps(["tenant", tenant]), digest_size=8).digest()
    for i in range(whole):
        previous = hashlib.blake2b(previous + text[i * BLOCK_CHARS:(i + 1) * BLOCK_CHARS].encode(), digest_size=8).digest()
        blocks.append(int.from_bytes(previous))
    return AffinityKey(tuple(blocks), None if session is None else SessionKey(tenant, session))


def _weight(anchor: bytes, member: Member) -> bytes:
    return hashlib.blake2b(anchor + b"\x1f" + member.name.encode(), digest_size=8).digest()


def ranking(anchor: bytes, members: Sequence[Member]) -> list[Member]:
    """`members` by the hash of (anchor, name), highest first: the same order on every gateway replica, and
    a member that leaves or comes back moves only the anchors it heads."""
    return sorted(members, key=lambda m: _weight(anchor, m), reverse=True)


def session_anchor(session: SessionKey) -> bytes:
    """A session's rendezvous anchor: its tenant and name as a structure, never joined (no two keys collide)."""
    return orjson.dumps(["session", session.tenant, session.name])


def rendezvous(anchor: str, members: Sequence[Member]) -> Member:
    """The member with the highest hash of (anchor, its name): the same on every gateway replica, and
    a member that leaves moves only its own anchors."""
    return max(members, key=lambda m: _weight(anchor.encode(), m))


class PrefixIndex:
    """One member's block hashes, least recently sent first; at most `capacity` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of a prompt this member was sent (each hash stands for its whole prefix)."""
        lo, hi = 0, len(blocks)
        while lo < hi:  # chained hashes: a prefix present means every shorter one was sent too (unless evicted)
            mid = (lo + hi + 1) // 2
            if blocks[mid - 1] in self._blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if block in self._blocks:
                self._blocks.move_to_end(block)
            else:
                self._blocks[block] = None
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


@dataclass
class Balancer:
    """The members' prefix indexes, for one pool (sessions are walked, never remembered)."""

    mode: str = "prefix_affinity"  # prefix_affinity | session | least_outstanding | round_robin
    max_load_ratio: float = 1.5
    indexes: dict[str, PrefixIndex] = field(default_factory=dict)
    hits: int = 0  # requests sent where a prefix was found (for a session: on the member its walk picked)
    picks: int = 0
    moves: int = 0  # sessions the placement table moved off their member (over the bound, or down)
    _turn: int = 0  # round_robin's position

    def within_bound(self, candidates: Sequence[Member]) -> list[Member]:
        """The members whose load is at most `max_load_ratio` x the members' mean load counting this request
        (consistent hashing with bounded loads, Mirrokni et al. 2018): the same members on every replica
        that reads the same scraped loads.

        NOTE: against the mean, not the least loaded member: with a few requests in flight some member
        is nearly always idle, and a bound of a multiple of the least load (0) moved a session off its
        member whenever that member ran two, for one cold prefill elsewhere that evicts another
        session's prefix there, where waiting a turn's few tokens behind them costs less."""
        mean = (sum(m.shared_load for m in candidates) + 1) / len(candidates)
        return [m for m in candidates if m.shared_load <= self.max_load_ratio * mean] or list(candidates)

    def preference(self, candidates: Sequence[Member], key: AffinityKey) -> list[tuple[Member, tuple[float, int, int]]]:
        """`candidates` in the order a session is placed by (its first turn, or a move off its member), each
        with the rank it is placed by, lower first: in prefix_affinity mode the score a request without a
        session is picked by (the share of the prompt's blocks sent to the member, less LOAD_WEIGHT x its
        load relative to the busiest), then the load (scraped, then own outstanding). Equal ranks keep the
        session's ranking's order; placement.py breaks them by the fewest live sessions.

        NOTE: by load alone, a session's first turn went to an idle member that had never seen its tool
        list while another member held it: measured on three llama.cpp servers (bench/prefix_affinity.py),
        such a first turn prefilled 1,360 tokens in 17-26 s where one placed with its shared 880 cached
        took 7 s, and first turns' p90 was 1.4x least-outstanding's, which finds the prefix by chance."""
        ranked = ranking(session_anchor(key.session), candidates) if key.session is not None else list(candidates)
        load = [(m.shared_load, m.inflight) for m in ranked]  # read once: shared_load counts recent sends
        least = min(shared for shared, _ in load)
        busiest = max(1, max(shared for shared, _ in load))
        scored = []
        for m, (shared, own) in zip(ranked, load, strict=True):
            score = self._score(m, key.blocks, shared, least, busiest) if self.mode == "prefix_affinity" and key.blocks else 0.0
            scored.append((m, (-score, shared, own)))
        return sorted(scored, key=lambda mr: mr[1])  # stable: ties stay in ranking order

    def choose(self, candidates: Sequence[Member], key: AffinityKey | None) -> Member:
        """The member for a request among `candidates` (non-empty: those with a closed breaker, not yet tried)."""
        self.picks += 1
        if self.mode == "round_robin":
            self._turn += 1
            return candidates[self._turn % len(candidates)]
        allowed = self.within_bound(candidates)
        least = min(m.shared_load for m in allowed)
        if key is not None and self.mode != "least_outstanding":
            if key.session is not None:
                # where the placement table put the session (it judged the bound); else the first member of
                # the session's ranking within the bound: every replica walks the same one
                member = next((m for m in candidates if m.name == key.placed), None) if key.placed else None
                if member is None:
                    allowed_ids = {id(m) for m in allowed}
                    member = next(m for m in ranking(session_anchor(key.session), candidates) if id(m) in allowed_ids)
                if key.blocks and self._matched(member, key.blocks) > 0:
                    self.hits += 1
                return member
            if self.mode == "prefix_affinity" and key.blocks:
                busiest = max(1, max(m.shared_load for m in allowed))
                scored = [(self._score(m, key.blocks, m.shared_load, least, busiest), m) for m in allowed]
                best_score = max(score for score, _ in scored)
                best = [m for score, m in scored if score == best_score]
                if self._matched(best[0], key.blocks) > 0:
                    self.hits += 1
                    fewest_own = min(m.inflight for m in best)  # own outstanding: the tie-breaker
                    best = [m for m in best if m.inflight == fewest_own]
                    return best[0] if len(best) == 1 else rendezvous(str(key.blocks[0]), best)
        fewest = [m for m in allowed if m.shared_load == least]
        # a new prefix evicts others where the KV cache is full: members with room first (scraped KV use)
        fewest = [m for m in fewest if m.kv_usage < KV_FULL] or fewest
        fewest_own = min(m.inflight for m in fewest)  # own outstanding: the tie-breaker
        fewest = [m for m in fewest if m.inflight == fewest_own]
        if len(fewest) > 1 and key is not None and key.blocks:
            return rendezvous(str(key.blocks[0]), fewest)
        return random.choice(fewest)

    def _score(self, member: Member, blocks: Sequence[int], load: int, least: int, busiest: int) -> float:
        """vLLM production-stack's score: the share of the prompt's blocks sent to `member`, less LOAD_WEIGHT x
        its load above the least loaded, relative to the busiest."""
        return self._matched(member, blocks) / len(blocks) - LOAD_WEIGHT * (load - least) / busiest

    def _matched(self, member: Member, blocks: Sequence[int]) -> int:
        index = self.indexes.get(member.name)
        return index.matched(blocks) if index is not None else 0

    def record(self, member: Member, key: AffinityKey | None, capacity_tokens: int) -> None:
        """`member` was sent the request: its prefix is in that member's cache now."""
        if key is None or self.mode in ("least_outstanding", "round_robin"):
            return
        if key.blocks:
            index = self.indexes.get(member.name)
            if index is None:
                index = self.indexes[member.name] = PrefixIndex(capacity_tokens * CHARS_PER_TOKEN // BLOCK_CHARS)
            index.add(key.blocks)

    def forget(self, member: Member) -> None:
        """A member that left (its breaker opened): its cache is not to be counted on. Its sessions walk on
        to the next member of their ranking while it is away, and come back to it when it is back."""
        self.indexes.pop(member.name, None)
