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
`max_load_ratio` times the least-loaded one's outstanding requests (plus one); with no match it is
least-outstanding as before. A session key pins a conversation to its member while that member
takes requests and is within the same load bound.

Replicas of the gateway agree without talking: each keeps its own index, but the hashes are
stable (blake2b, not Python's per-process hash) and a session the replica has not seen yet goes
to the member its rendezvous hash names (vLLM production-stack's session mode) while that member
is within the load bound, so a session's turns spread over two replicas meet on one member; a
prompt with no session and no match goes to the least loaded member, ties broken by the rendezvous hash of its first block. A shared index
(Valkey) would add a round trip to every request for what the hash gives for free. Measured in
bench/prefix_affinity.py: two replicas reach 0.82x one replica's cached share; what they lose is a
session one replica moved off a member over the load bound and pinned elsewhere while the other
keeps sending it to its hash member (walking the rendezvous ranking instead of pinning would keep
them together; not done).
A member's load is the gateway's own outstanding requests, or the server's running plus waiting
requests where its metrics are scraped and higher (`server_load.py`: other clients and other
gateway replicas count too).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

BLOCK_CHARS = 256  # ~64 tokens of English
MAX_BLOCKS = 4096  # the first 1 MiB of a prompt is indexed; beyond, matching it says nothing more
CHARS_PER_TOKEN = 4
LOAD_WEIGHT = 0.5  # how much a member's relative load weighs against its matched prefix share
KV_FULL = 0.9  # a member's KV use (where its metrics say) above which an unmatched prompt goes elsewhere if it can
MAX_SESSIONS = 65_536  # sessions remembered per pool (LRU)


class Member(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def load(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...


@dataclass(frozen=True, slots=True)
class AffinityKey:
    """What the balancer reads of one request: its prompt's chained block hashes and its session."""

    blocks: tuple[int, ...] = ()
    session: str | None = None


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


def key_for(body: Mapping[str, Any], session: str | None) -> AffinityKey:
    """The chained hashes of the prompt's whole blocks (a partial last block is left out: it changes)."""
    text = prompt_text(body)
    whole = min(len(text) // BLOCK_CHARS, MAX_BLOCKS)
    blocks: list[int] = []
    previous = b""
    for i in range(whole):
        previous = hashlib.blake2b(previous + text[i * BLOCK_CHARS:(i + 1) * BLOCK_CHARS].encode(), digest_size=8).digest()
        blocks.append(int.from_bytes(previous))
    return AffinityKey(tuple(blocks), session)


def rendezvous(anchor: str, members: Sequence[Member]) -> Member:
    """The member with the highest hash of (anchor, its name): the same on every gateway replica, and
    a member that leaves moves only its own anchors."""
    return max(members, key=lambda m: hashlib.blake2b(f"{anchor}\x1f{m.name}".encode(), digest_size=8).digest())


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
    """The members' prefix indexes and the sessions' members, for one pool."""

    mode: str = "prefix_affinity"  # prefix_affinity | session | least_outstanding | round_robin
    max_load_ratio: float = 2.0
    indexes: dict[str, PrefixIndex] = field(default_factory=dict)
    sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)
    hits: int = 0  # requests sent where a prefix or the session was found
    picks: int = 0
    _turn: int = 0  # round_robin's position

    def choose(self, candidates: Sequence[Member], key: AffinityKey | None) -> Member:
        """The member for a request among `candidates` (non-empty: those with a closed breaker, not yet tried)."""
        self.picks += 1
        if self.mode == "round_robin":
            self._turn += 1
            return candidates[self._turn % len(candidates)]
        least = min(m.load for m in candidates)
        allowed = [m for m in candidates if m.load <= self.max_load_ratio * least + 1] or list(candidates)
        if key is not None and self.mode != "least_outstanding":
            if key.session is not None:
                pinned = self.sessions.get(key.session)
                if pinned is None:
                    # a session new to this replica goes where every replica sends it, load permitting
                    target = rendezvous(key.session, candidates)
                    if target in allowed:
                        return target
                for member in allowed:
                    if member.name == pinned:
                        self.hits += 1
                        return member
            if self.mode == "prefix_affinity" and key.blocks:
                busiest = max(1, max(m.load for m in allowed))
                scored = [(self._matched(m, key.blocks) / len(key.blocks) - LOAD_WEIGHT * (m.load - least) / busiest, m)
                          for m in allowed]
                best_score = max(score for score, _ in scored)
                best = [m for score, m in scored if score == best_score]
                if self._matched(best[0], key.blocks) > 0:
                    self.hits += 1
                    return best[0] if len(best) == 1 else rendezvous(str(key.blocks[0]), best)
        lightest = min(m.load for m in allowed)
        fewest = [m for m in allowed if m.load == lightest]
        # a new prefix evicts others where the KV cache is full: members with room first (scraped KV use)
        fewest = [m for m in fewest if m.kv_usage < KV_FULL] or fewest
        if len(fewest) > 1 and key is not None and key.blocks:
            return rendezvous(str(key.blocks[0]), fewest)
        return random.choice(fewest)

    def _matched(self, member: Member, blocks: Sequence[int]) -> int:
        index = self.indexes.get(member.name)
        return index.matched(blocks) if index is not None else 0

    def record(self, member: Member, key: AffinityKey | None, capacity_tokens: int) -> None:
        """`member` was sent the request: its prefix is in that member's cache now, the session is its."""
        if key is None or self.mode in ("least_outstanding", "round_robin"):
            return
        if key.blocks:
            index = self.indexes.get(member.name)
            if index is None:
                index = self.indexes[member.name] = PrefixIndex(capacity_tokens * CHARS_PER_TOKEN // BLOCK_CHARS)
            index.add(key.blocks)
        if key.session is not None:
            self.sessions[key.session] = member.name
            self.sessions.move_to_end(key.session)
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)

    def forget(self, member: Member) -> None:
        """A member that left (its breaker opened): its cache is not to be counted on."""
        self.indexes.pop(member.name, None)
