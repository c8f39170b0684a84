"""Prefix and session affinity in the pool: the index, the balancer, and a pool of two real servers."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import httpx

from gateway.settings import Settings
from gateway.upstream.affinity import (
    BLOCK_CHARS,
    AffinityKey,
    Balancer,
    PrefixIndex,
    SessionKey,
    key_for,
    ranking,
    session_anchor,
)
from gateway.upstream.pool import Upstream, UpstreamPool, UpstreamReply
from gateway.upstream.server_load import ServerLoad
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app

SYSTEM = "You are a coding agent. " * 120  # ~2.9k characters: 11 whole blocks shared by every turn


@dataclass
class M:
    """A member without metrics: its shared load is this replica's own outstanding count."""

    name: str
    inflight: int = 0
    kv_usage: float = 0.0

    @property
    def load(self) -> int:
        return self.inflight

    @property
    def shared_load(self) -> int:
        return self.inflight


def turn(n: int, system: str = SYSTEM) -> dict[str, object]:
    messages = [{"role": "system", "content": system}]
    for i in range(n):
        messages += [{"role": "user", "content": f"step {i} " * 40}, {"role": "assistant", "content": f"done {i} " * 40}]
    return {"model": "m", "messages": [*messages, {"role": "user", "content": "next"}]}


def test_a_conversations_next_turn_extends_the_prefix_of_the_one_before():
    first, second = key_for(turn(1), None).blocks, key_for(turn(2), None).blocks
    assert len(second) > len(first) >= len(SYSTEM) // BLOCK_CHARS
    assert second[:len(first) - 1] == first[:-1]  # the chained hashes of the shared prefix are the same
    other = key_for(turn(1, system="Another agent. " * 200), None).blocks
    assert not set(other) & set(first)


def test_the_index_matches_leading_blocks_and_forgets_the_least_recently_sent():
    index = PrefixIndex(capacity=20)
    blocks = key_for(turn(2), None).blocks
    index.add(blocks[:10])
    assert index.matched(blocks) == 10 and index.matched(blocks[:4]) == 4
    index.add(key_for(turn(1, system="Another agent. " * 300), None).blocks)  # more than 10 more: the first go
    assert len(index) == 20 and index.matched(blocks) < 10


def test_the_balancer_follows_the_prefix_within_the_load_bound_and_walks_sessions_without_pinning():
    a, b = M("a"), M("b")
    balancer = Balancer()
    key = key_for(turn(1), None)
    balancer.record(b, key, capacity_tokens=100_000)
    assert all(balancer.choose([a, b], key_for(turn(2), None)) is b for _ in range(20))  # its next turn
    b.inflight = 5  # more than max_load_ratio x the mean load (3): the cache is not worth the queue
    assert balancer.choose([a, b], key_for(turn(2), None)) is a
    b.inflight = 1
    assert balancer.choose([a, b], key_for(turn(2), None)) is b  # within the bound: the prefix wins
    picked = {balancer.choose([a, b], AffinityKey()).name for _ in range(20)}
    assert picked == {"a"}  # nothing to match: least outstanding
    session = AffinityKey(session=SessionKey("t", "s1"))
    b.inflight = 0
    home = balancer.choose([a, b], session)
    other = b if home is a else a
    balancer.record(home, session, capacity_tokens=100_000)
    home.inflight, other.inflight = 1, 0
    assert balancer.choose([a, b], session) is home  # within the bound: its member
    home.inflight = 4  # beyond the bound (1.5 x a mean of 2.5): the session goes to the next member of its ranking...
    moved = balancer.choose([a, b], session)
    assert moved is other
    balancer.record(moved, session, capacity_tokens=100_000)
    home.inflight = 0
    assert balancer.choose([a, b], session) is home  # ...and back once its member is within the bound: nothing pinned
    balancer.forget(b)
    assert balancer.choose([a, b], key_for(turn(2), None)).name in ("a", "b")
    assert Balancer(mode="least_outstanding").choose([a, b], key_for(turn(2), None)) in (a, b)
    a.inflight = 1
    assert Balancer(mode="least_outstanding").choose([a, b], key_for(turn(2), None)) is b


def test_a_pool_of_two_keeps_a_conversation_on_one_member_and_moves_it_when_that_member_fails(bg, make_gateway):
    recs = [Recorder(), Recorder()]
    apps = [RunningApp(bg, fault_app("ok", rec, text="ok")) for rec in recs]
    gw = make_gateway(upstreams=[upstream_cfg(f"gpu{i}", app.url + "/v1", models=["m"], breaker_failures=1, retries=1)
                                 for i, app in enumerate(apps)])
    for n in range(1, 6):
        r = httpx.post(gw.url + "/v1/chat/completions", json=turn(n), timeout=30)
        assert r.status_code == 200
    served = [rec.hits for rec in recs]
    assert sorted(served) == [0, 5]  # every turn found the member holding its prefix
    holder = served.index(5)
    apps[holder].stop()  # that member goes away mid-session
    for n in range(6, 9):
        r = httpx.post(gw.url + "/v1/chat/completions", json=turn(n), timeout=30)
        assert r.status_code == 200, r.text  # retried on the other member: no error reaches the client
    assert recs[1 - holder].hits == 3


def test_what_is_put_together_for_the_index_is_bounded():
    from gateway.upstream.affinity import MAX_BLOCKS, prompt_text

    huge = {"model": "m", "messages": [{"role": "user", "content": "x" * 400_000}] * 20}  # 8 MB of prompt
    assert len(prompt_text(huge)) == MAX_BLOCKS * BLOCK_CHARS
    assert len(key_for(huge, None).blocks) == MAX_BLOCKS


def test_two_replicas_send_a_session_to_the_same_member_without_talking():
    members = [M("gpu0"), M("gpu1"), M("gpu2")]
    one, two = Balancer(), Balancer()  # two gateway replicas, each with its own index
    homes = set()
    for s in range(30):
        session = f"session-{s}"
        first = one.choose(members, key_for(turn(1, system=f"agent {s} " * 60), session))
        one.record(first, key_for(turn(1, system=f"agent {s} " * 60), session), 100_000)
        second = two.choose(members, key_for(turn(2, system=f"agent {s} " * 60), session))  # next turn, other replica
        assert second is first
        homes.add(first.name)
    assert homes == {"gpu0", "gpu1", "gpu2"}  # the hash spreads sessions over the members
    # stable across processes: the hashes are blake2b, not Python's per-process hash
    assert key_for(turn(1), None).blocks[0] == 0x65D15ADC473B0D39


def test_a_member_whose_kv_cache_is_full_gets_no_new_prefix_while_another_has_room():
    a, b = M("a", kv_usage=0.97), M("b", kv_usage=0.2)
    balancer = Balancer()
    assert all(balancer.choose([a, b], key_for(turn(1, system=f"new {i} " * 80), None)) is b for i in range(10))
    a.kv_usage = 0.5
    assert {balancer.choose([a, b], key_for(turn(1, system=f"new {i} " * 80), None)).name for i in range(20)} == {"a", "b"}


def test_round_robin_takes_the_members_in_turn():
    members = [M("a"), M("b"), M("c")]
    balancer = Balancer(mode="round_robin")
    members[0].inflight = 9  # load does not matter to it
    assert [balancer.choose(members, None).name for _ in range(6)] == ["b", "c", "a", "b", "c", "a"]


# -- gateway replicas that agree without talking --------------------------------------------------
MEMBERS = ("gpu0", "gpu1", "gpu2")


def _replica() -> UpstreamPool:
    """One gateway replica's pool of three members with metrics (never started: the test sets the readings)."""
    settings = Settings.load(env={}, overrides={"upstreams": [
        upstream_cfg(name, f"http://127.0.0.1:{9 + i}/v1", models=["m"], metrics_url=f"http://127.0.0.1:{9 + i}/metrics",
                     metrics_interval_s=3600, breaker_failures=1) for i, name in enumerate(MEMBERS)]})
    return UpstreamPool(settings)


def _member(pool: UpstreamPool, name: str) -> Upstream:
    return next(u for u in pool._by_pool["default"] if u.name == name)


def _scraped(replicas: tuple[UpstreamPool, ...], requests: dict[str, int]) -> None:
    """The same reading of every member's server on every replica (what each scrapes from /metrics)."""
    at = time.monotonic()
    for pool in replicas:
        for upstream in pool._by_pool["default"]:
            upstream.server_load = ServerLoad(requests.get(upstream.name, 0), 0, None, at)


def _send(pool: UpstreamPool, key: AffinityKey) -> str:
    """The member a replica's pool sends a request to (as `send` picks it), and what it notes."""
    balancer = pool.balancer("default")
    assert balancer is not None
    chosen = pool._pick(pool._by_pool["default"], "m", set(), (), balancer, key)
    assert chosen is not None
    balancer.record(chosen, key, chosen.settings.kv_capacity_tokens)
    return chosen.name


def _key(s: int, n: int) -> AffinityKey:
    return key_for(turn(n, system=f"agent {s} " * 60), f"session-{s}")


def test_two_replicas_fed_the_same_scraped_loads_keep_every_turn_of_a_session_on_one_member():
    replicas = (_replica(), _replica())
    rng = random.Random(7)

    def own_counts() -> None:  # each replica counts only its own requests: they differ, and must not matter
        for pool in replicas:
            for name in MEMBERS:
                _member(pool, name).inflight = rng.randrange(0, 8)

    _scraped(replicas, {})
    homes: dict[int, str] = {}
    for n in range(1, 6):
        for s in range(24):
            own_counts()
            where = _send(replicas[(s + n) % 2], _key(s, n))  # a session's turns alternate between the replicas
            assert homes.setdefault(s, where) == where, (s, n)
    assert set(homes.values()) == set(MEMBERS)  # the ranking spreads sessions over the members
    # one member over the bound for both replicas: its sessions move, on both, to the same next member
    busy = homes[0]
    _scraped(replicas, {busy: 9})
    moved: dict[int, str] = {}
    for n in range(6, 10):
        for s in range(24):
            own_counts()
            where = _send(replicas[(s + n) % 2], _key(s, n))
            if homes[s] == busy:
                assert where != busy and moved.setdefault(s, where) == where, (s, n)
            else:
                assert where == homes[s], (s, n)
    assert moved
    # back within the bound: every replica takes its sessions back to it by the same ranking
    _scraped(replicas, {})
    for n in range(10, 13):
        for s in range(24):
            own_counts()
            assert _send(replicas[(s + n) % 2], _key(s, n)) == homes[s], (s, n)
    # down (its breaker open on both) and back: the same walk, the same return
    for pool in replicas:
        _member(pool, busy).breaker.failure()
    for n in range(13, 15):
        for s in range(24):
            where = _send(replicas[(s + n) % 2], _key(s, n))
            assert where == (moved[s] if homes[s] == busy else homes[s]), (s, n)
    for pool in replicas:
        _member(pool, busy).breaker.success()
    for s in range(24):
        assert _send(replicas[s % 2], _key(s, 15)) == homes[s]


def test_requests_the_last_scrape_counted_are_not_counted_again_and_those_sent_since_are():
    one, two = replicas = (_replica(), _replica())
    _scraped(replicas, {})  # every server says it is idle
    home = _send(one, _key(3, 1))
    member = _member(one, home)
    member.inflight = 10  # outstanding, but all sent before the reading: the scraped count holds them
    member.sent_at = [member.server_load.at - 1.0] * 10  # type: ignore[union-attr]
    assert member.shared_load == 0
    assert _send(one, _key(3, 2)) == home and _send(two, _key(3, 3)) == home
    # a burst this replica sent after the reading: the server's count cannot hold it yet, so this replica
    # sees the member over the bound at once (not a scrape interval later); the other replica did not send it
    member.sent_at = [member.server_load.at + 1.0] * 10  # type: ignore[union-attr]
    assert member.shared_load == 10
    assert _send(one, _key(3, 4)) != home
    assert _send(two, _key(3, 5)) == home
    # the next reading counts the burst on both replicas alike: both move the session, and both bring it back
    _scraped(replicas, {home: 10})
    member.sent_at = [member.server_load.at - 1.0] * 10  # type: ignore[union-attr]
    assert _send(one, _key(3, 6)) == _send(two, _key(3, 7)) != home
    _scraped(replicas, {})
    member.inflight, member.sent_at = 0, []
    assert _send(one, _key(3, 8)) == home and _send(two, _key(3, 9)) == home


def test_a_released_request_leaves_the_members_load():
    pool = _replica()
    _scraped((pool,), {})
    member = _member(pool, MEMBERS[0])
    replies = [UpstreamReply(upstream=member, status=200, sent_at=time.monotonic() + i, _pool=pool) for i in range(3)]
    for reply in replies:
        member.inflight += 1
        member.sent_at.append(reply.sent_at)
    assert member.shared_load == 3
    replies[1].release()
    assert member.shared_load == 2 and member.inflight == 2 and replies[1].sent_at not in member.sent_at
    for reply in (replies[0], replies[2]):
        reply.release()
    assert member.shared_load == 0 and member.sent_at == []


# -- tenants ---------------------------------------------------------------------------------------
def test_a_tenant_naming_its_session_like_anothers_moves_none_of_its_turns():
    members = [M("gpu0"), M("gpu1"), M("gpu2")]
    balancer = Balancer()

    def acme(n: int) -> AffinityKey:
        return key_for(turn(n), "build-42", tenant="acme")

    home = balancer.choose(members, acme(1))
    balancer.record(home, acme(1), 100_000)
    # another tenant sends a turn under the same session name while acme's member is over the bound here
    home.inflight = 9
    globex = key_for(turn(1, system="Another tenant's agent. " * 100), "build-42", tenant="globex")
    balancer.record(balancer.choose(members, globex), globex, 100_000)
    home.inflight = 0
    assert all(balancer.choose(members, acme(n)) is home for n in range(2, 6))
    # the session is the tenant and the name as a structure: never one joined string
    assert acme(1).session == SessionKey("acme", "build-42") != globex.session
    assert session_anchor(SessionKey("a\x1fb", "c")) != session_anchor(SessionKey("a", "b\x1fc"))
    firsts = [(ranking(session_anchor(SessionKey("acme", f"s{i}")), members)[0],
               ranking(session_anchor(SessionKey("globex", f"s{i}")), members)[0]) for i in range(30)]
    assert any(x is not y for x, y in firsts)  # the tenant is part of the ranking's key


def test_prefix_blocks_are_salted_per_tenant_so_one_tenants_prompt_never_matches_anothers():
    acme, globex = key_for(turn(2), None, tenant="acme").blocks, key_for(turn(2), None, tenant="globex").blocks
    assert len(acme) == len(globex) == len(key_for(turn(2), None).blocks)
    assert not set(acme) & set(globex) and not set(acme) & set(key_for(turn(2), None).blocks)
    assert key_for(turn(2), None, tenant="acme").blocks == acme  # stable: every replica hashes alike
    x, y = M("x"), M("y", inflight=1)
    balancer = Balancer()
    balancer.record(y, key_for(turn(1), None, tenant="acme"), 100_000)
    assert balancer.choose([x, y], key_for(turn(2), None, tenant="acme")) is y  # its own prefix is found
    assert balancer.choose([x, y], key_for(turn(2), None, tenant="globex")) is x  # another's is not: least loaded
