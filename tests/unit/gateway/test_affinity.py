"""Prefix and session affinity in the pool: the index, the balancer, and a pool of two real servers."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from gateway.upstream.affinity import BLOCK_CHARS, AffinityKey, Balancer, PrefixIndex, key_for
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app

SYSTEM = "You are a coding agent. " * 120  # ~2.9k characters: 11 whole blocks shared by every turn


@dataclass
class M:
    name: str
    inflight: int = 0
    kv_usage: float = 0.0

    @property
    def load(self) -> int:
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


def test_the_balancer_follows_the_prefix_within_the_load_bound_and_pins_sessions():
    a, b = M("a"), M("b")
    balancer = Balancer()
    key = key_for(turn(1), None)
    balancer.record(b, key, capacity_tokens=100_000)
    assert all(balancer.choose([a, b], key_for(turn(2), None)) is b for _ in range(20))  # its next turn
    b.inflight = 5  # more than max_load_ratio x the least loaded + 1: the cache is not worth the queue
    assert balancer.choose([a, b], key_for(turn(2), None)) is a
    b.inflight = 1
    assert balancer.choose([a, b], key_for(turn(2), None)) is b  # within the bound: the prefix wins
    picked = {balancer.choose([a, b], AffinityKey()).name for _ in range(20)}
    assert picked == {"a"}  # nothing to match: least outstanding
    session = AffinityKey(session="s1")
    balancer.record(a, session, capacity_tokens=100_000)
    a.inflight, b.inflight = 1, 0
    assert balancer.choose([a, b], session) is a
    b.inflight = 0
    a.inflight = 3  # beyond the bound: the session goes elsewhere, and stays there
    moved = balancer.choose([a, b], session)
    assert moved is b
    balancer.record(moved, session, capacity_tokens=100_000)
    a.inflight = 0
    assert balancer.choose([a, b], session) is b
    balancer.forget(b)
    assert balancer.choose([a, b], key_for(turn(2), None)).name in ("a", "b")
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
