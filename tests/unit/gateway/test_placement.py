"""Sessions placed on the least loaded member (ties: the fewest live sessions) and kept there: in one
process, and in one table for every replica (Valkey), with the pool reading the table before it picks."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from gateway.settings import Settings
from gateway.upstream.affinity import AffinityKey, SessionKey, key_for
from gateway.upstream.placement import Candidate, LocalPlacement, SharedPlacement
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.server_load import ServerLoad
from tests.support.config import upstream_cfg

MEMBERS = ("gpu0", "gpu1", "gpu2")
TURNS = [10, 8, 6, 5, 4, 4, 3, 3, 3, 3, 3, 3]  # the fleet bench's skewed session lengths


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _all(*allowed: bool) -> list[Candidate]:
    return [Candidate(name, may) for name, may in zip(MEMBERS, allowed or (True,) * len(MEMBERS), strict=True)]


def _loaded(*levels: int) -> list[Candidate]:
    return [Candidate(name, True, level) for name, level in zip(MEMBERS, levels, strict=True)]


def test_new_sessions_go_to_the_member_with_the_fewest_and_stay_there():
    table = LocalPlacement(clock=Clock())
    homes: dict[int, str] = {}
    for n in range(max(TURNS)):  # interleaved, as sessions run side by side
        for s, turns in enumerate(TURNS):
            if n < turns:
                placed = table.place_now("p", f"s{s}", _all(), 300)
                assert placed is not None and not placed.moved
                assert homes.setdefault(s, placed.member) == placed.member, (s, n)
    assert sorted(Counter(homes.values()).values()) == [4, 4, 4]


def test_a_new_session_goes_to_the_least_loaded_member_however_many_sessions_it_holds():
    table = LocalPlacement(clock=Clock())
    for s in range(4):  # the others busy: gpu0 takes four sessions (ended by now, but within the TTL)
        placed = table.place_now("p", f"old{s}", _loaded(0, 1, 1), 300)
        assert placed is not None and placed.member == "gpu0"
    # gpu0 is idle again, the others busy: a new session goes there (what least-outstanding picks)
    fresh = table.place_now("p", "new", _loaded(0, 1, 1), 300)
    assert fresh is not None and fresh.member == "gpu0"
    # equal loads: the fewest sessions decide
    tie = table.place_now("p", "tie", _loaded(0, 0, 0), 300)
    assert tie is not None and tie.member != "gpu0"
    # and a placed session stays put whatever the loads are now
    again = table.place_now("p", "new", _loaded(2, 0, 0), 300)
    assert again is not None and again.member == "gpu0" and not again.moved


def test_a_session_moved_off_a_member_over_the_bound_stays_where_it_was_moved():
    table = LocalPlacement(clock=Clock())
    first = {s: table.place_now("p", f"s{s}", _all(), 300) for s in range(6)}
    assert sorted(Counter(p.member for p in first.values() if p).values()) == [2, 2, 2]
    busy = first[0].member if first[0] else ""
    over = [Candidate(name, name != busy) for name in MEMBERS]
    moved = {s: table.place_now("p", f"s{s}", over, 300) for s in range(6)}
    for s, placed in moved.items():
        assert placed is not None
        was = first[s]
        assert was is not None
        if was.member == busy:
            assert placed.moved and placed.member != busy
        else:
            assert placed.member == was.member and not placed.moved
    # the member is back within the bound: the moved sessions stay (their prefix is where they went)
    for s in range(6):
        again = table.place_now("p", f"s{s}", _all(), 300)
        assert again is not None and again.member == moved[s].member and not again.moved  # type: ignore[union-attr]


def test_a_member_down_moves_its_sessions_and_no_member_allowed_places_none():
    table = LocalPlacement(clock=Clock())
    placed = table.place_now("p", "s", _all(), 300)
    assert placed is not None
    rest = [Candidate(name, True) for name in MEMBERS if name != placed.member]  # its breaker is open: not a candidate
    moved = table.place_now("p", "s", rest, 300)
    assert moved is not None and moved.moved and moved.member != placed.member
    assert table.place_now("p", "other", [Candidate(name, False) for name in MEMBERS], 300) is None


def test_sessions_unused_past_the_ttl_no_longer_count_and_are_placed_afresh():
    clock = Clock()
    table = LocalPlacement(clock=clock)
    old = [table.place_now("p", f"old{s}", _all(), 300) for s in range(3)]
    assert sorted(p.member for p in old if p) == sorted(MEMBERS)
    clock.now += 100
    busy = table.place_now("p", "recent", _all(), 300)  # one member gets a second session
    assert busy is not None
    clock.now += 250  # the first three are past the TTL, the recent one is not
    fresh = [table.place_now("p", f"new{s}", _all(), 300) for s in range(2)]
    assert busy.member not in {p.member for p in fresh if p}
    # pools are apart: the same session name in another pool is another session
    elsewhere = table.place_now("q", "recent", _all(), 300)
    assert elsewhere is not None and not elsewhere.moved


# -- one table for every replica (Valkey) --------------------------------------------------------


def test_two_replicas_sharing_the_table_agree_on_every_session_and_balance_them(valkey):
    async def main() -> None:
        replicas = [SharedPlacement(valkey.url, key_prefix="t:", connect_timeout_s=2, op_timeout_s=2) for _ in range(2)]
        try:
            homes: dict[int, str] = {}
            for n in range(max(TURNS)):
                for s, turns in enumerate(TURNS):
                    if n < turns:
                        placed = await replicas[(s + n) % 2].place("p", SessionKey("t", f"s{s}"), _all(), 300)
                        assert placed is not None
                        assert homes.setdefault(s, placed.member) == placed.member, (s, n)
            assert sorted(Counter(homes.values()).values()) == [4, 4, 4]
            # one new session placed by both replicas at the same moment: one placement wins, both read it
            both = await asyncio.gather(*(r.place("p", SessionKey("t", "racing"), _all(), 300) for r in replicas))
            assert both[0] is not None and both[1] is not None and both[0].member == both[1].member
            # moved by one replica (its member over the bound): the other follows the move
            busy = homes[0]
            over = [Candidate(name, name != busy) for name in MEMBERS]
            moved = await replicas[0].place("p", SessionKey("t", "s0"), over, 300)
            assert moved is not None and moved.moved and moved.member != busy
            after = await replicas[1].place("p", SessionKey("t", "s0"), _all(), 300)
            assert after is not None and after.member == moved.member and not after.moved
            # a new session goes to the least loaded member, whatever the session counts
            for member in MEMBERS:
                levels = [0 if name == member else 1 for name in MEMBERS]
                light = await replicas[1].place("p", SessionKey("t", f"light-{member}"), _loaded(*levels), 300)
                assert light is not None and light.member == member
            # tenants are apart: another tenant's session of the same name is placed on its own
            other = await replicas[1].place("p", SessionKey("u", "s0"), _all(), 300)
            assert other is not None and not other.moved
        finally:
            for r in replicas:
                await r.close()

    asyncio.run(main())


def test_a_store_that_does_not_answer_leaves_the_turn_to_the_walk(valkey):
    async def main() -> None:
        table = SharedPlacement(valkey.url, key_prefix="t:", connect_timeout_s=0.3, op_timeout_s=0.3)
        try:
            assert await table.place("p", SessionKey("t", "s"), _all(), 300) is not None
            valkey.kill()
            began = time.monotonic()
            assert await table.place("p", SessionKey("t", "s"), _all(), 300) is None
            assert table.failures == 1
            assert time.monotonic() - began < 30  # a hang guard: bounded by the op timeout, not waited on
        finally:
            await table.close()

    asyncio.run(main())


def test_sessions_that_expired_together_are_cleared_a_few_per_placement_and_never_counted(valkey):
    import redis

    client = redis.Redis.from_url(valkey.url)
    tag = "t:{place:p}"
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    expired = {f"old{n}": now_ms - 400_000 for n in range(5_000)}  # past a 300 s TTL
    client.zadd(f"{tag}:m:gpu0", expired)  # a flood's sessions, all ended at once, on gpu0

    async def main() -> list[str]:
        table = SharedPlacement(valkey.url, key_prefix="t:", connect_timeout_s=2, op_timeout_s=2)
        try:
            members = []
            for n in range(3):
                placed = await table.place("p", SessionKey("t", f"new{n}"), _all(), 300)
                assert placed is not None
                members.append(placed.member)
                # one script call removes a bounded number of them, not all 5,000 in one command
                assert 5_000 - 64 * (n + 1) <= client.zcard(f"{tag}:m:gpu0") < 5_000
            return members
        finally:
            await table.close()

    # expired sessions do not count: the new sessions spread as if gpu0 held none
    assert sorted(asyncio.run(main())) == sorted(MEMBERS)


# -- the pool reads the table before it picks ----------------------------------------------------


def _pool(**pool: Any) -> UpstreamPool:
    settings = Settings.load(env={}, overrides={
        "upstreams": [upstream_cfg(name, f"http://127.0.0.1:{9 + i}/v1", models=["m"],
                                   metrics_url=f"http://127.0.0.1:{9 + i}/metrics", metrics_interval_s=3600)
                      for i, name in enumerate(MEMBERS)],
        "pools": {"default": pool}})
    return UpstreamPool(settings)


def _turn(s: int, n: int) -> dict[str, object]:
    messages: list[dict[str, str]] = [{"role": "system", "content": f"agent {s} " * 60}]
    for i in range(n):
        messages += [{"role": "user", "content": f"step {i} " * 40}, {"role": "assistant", "content": f"done {i} " * 40}]
    return {"model": "m", "messages": [*messages, {"role": "user", "content": "next"}]}


async def _send(pool: UpstreamPool, key: AffinityKey) -> str:
    balancer = pool.balancer("default")
    members = pool._by_pool["default"]
    placed = await pool._place("default", members, "m", balancer, key)
    chosen = pool._pick(members, "m", set(), (), balancer, placed)
    assert chosen is not None
    return chosen.name


def test_a_balanced_pool_spreads_sessions_evenly_where_their_ranking_does_not():
    async def spread(**pool: Any) -> list[int]:
        replica = _pool(**pool)
        for upstream in replica._by_pool["default"]:
            upstream.server_load = ServerLoad(0, 0, None, time.monotonic())
        homes: dict[int, str] = {}
        for n in range(1, 4):
            for s in range(12):
                where = await _send(replica, key_for(_turn(s, n), f"session-{s}", tenant="t"))
                assert homes.setdefault(s, where) == where, (s, n)
        return sorted(Counter(homes.values()).values())

    assert asyncio.run(spread()) == [4, 4, 4]
    # the hash ranking of these twelve session names is uneven: what the table is for
    assert asyncio.run(spread(session_placement="rendezvous")) != [4, 4, 4]


def _first_turn(group: str, s: int) -> dict[str, object]:
    """A session's first turn: its group's long tool list, then its own short instructions."""
    tools = "".join(f"tool_{group}_{i}(path, text): reads, edits or runs what it is given. " for i in range(60))
    return {"model": "m", "messages": [{"role": "system", "content": tools + f"session {s}: " + "be brief. " * 20},
                                       {"role": "user", "content": f"task {s}"}]}


def test_a_new_session_goes_where_its_shared_prefix_was_sent_unless_that_member_is_over_the_bound():
    async def main() -> None:
        replica = _pool()
        balancer = replica.balancer("default")
        assert balancer is not None
        members = {u.name: u for u in replica._by_pool["default"]}

        def loads(**running: int) -> None:
            for name, upstream in members.items():
                upstream.server_load = ServerLoad(running.get(name, 0), 0, None, time.monotonic())

        async def first(group: str, s: int) -> str:
            key = key_for(_first_turn(group, s), f"{group}-{s}", tenant="t")
            where = await _send(replica, key)
            balancer.record(members[where], key, 100_000)
            return where

        loads()
        a = await first("a", 0)
        b = await first("b", 1)
        assert a != b  # equal loads, nothing shared: the fewest sessions decide
        # equal loads: the member that was sent group b's tool list, not the one holding no session
        assert await first("b", 2) == b
        # somewhat busier there: the cached tool list still weighs more than one request's load
        loads(**{b: 1})
        assert await first("b", 3) == b
        # over the load bound there: elsewhere, the least loaded
        loads(**{b: 3, a: 1})
        third = await first("b", 4)
        assert third not in (a, b)
        # a session with nothing cached anywhere goes to the least loaded, as before, however many it holds
        loads(**{a: 1, third: 1})
        assert await first("c", 5) == b

    asyncio.run(main())


class CountingTime(float):
    """A clock reading that counts the ages computed from it (`now - last use`)."""

    ages = 0

    def __sub__(self, other: float) -> float:
        CountingTime.ages += 1
        return float(self) - other


def test_a_first_turn_costs_the_same_whatever_the_number_of_live_sessions():
    # a client minting a session per request: the table holds thousands of live sessions, and
    # placing one more must not look at them (it once counted each member's sessions one by one)
    clock = Clock()
    table = LocalPlacement(clock=lambda: CountingTime(clock()))
    for live in (100, 20_000):
        while table.sessions("p") < live:
            clock.now += 0.001
            table.place_now("p", f"s{clock.now}", _all(), 300)
        CountingTime.ages = 0
        for n in range(10):
            clock.now += 0.001
            assert table.place_now("p", f"new{live}-{n}", _all(), 300) is not None
        assert CountingTime.ages <= 20, (live, CountingTime.ages)  # ages looked at in 10 first turns


def test_the_table_forgets_expired_and_least_recently_used_sessions_and_counts_only_what_it_holds():
    clock = Clock()
    table = LocalPlacement(clock=clock, max_sessions=50)
    for s in range(120):
        clock.now += 1
        table.place_now("p", f"s{s}", _all(), 300)
    assert table.sessions("p") == 50  # bounded: the oldest 70 were forgotten
    # the counts that break ties are the sessions held: 50 spread as evenly as they were placed
    counts = table._pools["p"].live
    assert sum(counts.values()) == 50 and max(counts.values()) - min(counts.values()) <= 1
    recent = table.place_now("p", "s119", _all(), 300)
    assert recent is not None and not recent.moved  # a held session stays
    clock.now += 301  # every session is past the TTL: the next placement clears them
    table.place_now("p", "fresh", _all(), 300)
    assert table.sessions("p") == 1 and sum(table._pools["p"].live.values()) == 1
