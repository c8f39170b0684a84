"""Flow control of one member: budgets, class order, aging, headroom, deadlines, shedding, clients leaving."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.errors import UpstreamBusy
from gateway.upstream.flow import Gate, PoolFlow, Slot
from gateway.upstream.flow_settings import FlowSettings
from gateway.upstream.server_load import ServerLoad
from policies.domain import Priority


class Clock:
    """A clock the test moves (aging reads it; deadlines run on the loop's own timers)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def member(budget: int | None = 1, clock: Clock | None = None, stale_after_s: float = 3.0, **flow: Any) -> Gate:
    return PoolFlow("p", FlowSettings.model_validate(flow), clock or Clock()).gate("m", budget, stale_after_s)


async def settle() -> None:
    """Let every task the last grant woke run up to its next wait."""
    for _ in range(5):
        await asyncio.sleep(0)


class Queue:
    """Requests of a test: each a task acquiring a slot; `served` lists them in the order they got one."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.served: list[str] = []
        self.slots: dict[str, Slot] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def ask(self, name: str, priority: Priority, tenant: str = "t") -> None:
        async def go() -> None:
            self.slots[name] = await self.gate.acquire(priority, tenant)
            self.served.append(name)

        self.tasks[name] = asyncio.create_task(go())
        await settle()

    async def done(self, name: str) -> None:
        self.slots.pop(name).release()
        await settle()


async def test_a_member_without_a_budget_sends_every_request_at_once() -> None:
    gate = member(budget=None)
    slots = [await gate.acquire("batch", "t") for _ in range(50)]
    assert gate.budget() is None and gate.active == 50 and all(s.waited_s == 0 for s in slots)
    for slot in slots:
        slot.release()
        slot.release()  # once only
    assert gate.active == 0


async def test_a_freed_slot_goes_to_interactive_then_standard_then_batch() -> None:
    q = Queue(member(budget=1, interactive_headroom=0))
    await q.ask("first", "interactive")
    arrivals: list[tuple[str, Priority]] = [("b", "batch"), ("s", "standard"), ("i", "interactive")]
    for name, priority in arrivals:  # the least urgent came first
        await q.ask(name, priority)
    assert q.served == ["first"]
    for name in ("first", "i", "s"):
        await q.done(name)
    assert q.served == ["first", "i", "s", "b"]
    assert q.gate.flow.stats["batch"].waited == 1 and q.gate.flow.stats["interactive"].queued == 0


async def test_standard_is_promoted_after_its_wait_so_a_steady_interactive_stream_never_starves_it() -> None:
    clock = Clock()
    q = Queue(member(budget=1, clock=clock, standard_promote_after_s=10.0))
    await q.ask("i0", "interactive")
    await q.ask("s", "standard")
    running = "i0"
    for k in range(1, 30):
        await q.ask(f"i{k}", "interactive")  # one more person waits each second
        clock.now += 1.0
        await q.done(running)
        running = q.served[-1]
        if running == "s":
            break
    assert running == "s", q.served
    assert q.served.index("s") == 10  # served once it had waited 10 s, before every interactive request queued after it
    assert all(name.startswith("i") for name in q.served[:10])


async def test_batch_never_takes_the_last_free_slot_kept_for_interactive() -> None:
    q = Queue(member(budget=3, interactive_headroom=1))
    await q.ask("i0", "interactive")  # a person uses the member: the reserve applies
    await q.ask("b1", "batch")
    await q.ask("b2", "batch")  # one slot free: the headroom
    assert q.served == ["i0", "b1"]
    await q.ask("i", "interactive")  # finds it free at once
    assert q.served == ["i0", "b1", "i"]
    await q.done("i")  # the headroom again: b2 still waits
    assert q.served == ["i0", "b1", "i"]
    await q.done("b1")
    assert q.served == ["i0", "b1", "i", "b2"]


async def test_a_member_no_person_used_lately_lets_batch_take_every_slot() -> None:
    clock = Clock()
    q = Queue(member(budget=3, clock=clock, interactive_headroom=1, headroom_idle_s=2.0))
    for name in ("b1", "b2", "b3"):
        await q.ask(name, "batch")
    assert q.served == ["b1", "b2", "b3"] and q.gate.reserve(3) == 0
    await q.ask("i", "interactive")  # waits for a batch request to end, then goes before any batch waiting
    await q.ask("b4", "batch")
    await q.done("b1")
    assert q.served[-1] == "i" and q.gate.reserve(3) == 1
    await q.done("i")  # it ended just now: the reserve holds for headroom_idle_s
    assert q.served[-1] == "i"
    clock.now += 2.0
    await q.done("b2")  # idle again: b4 takes the two free slots' one, and would take the last too
    assert q.served[-1] == "b4" and q.gate.reserve(3) == 0


async def test_batch_waiting_on_a_reserve_gets_the_slot_when_the_idle_window_ends() -> None:
    gate = PoolFlow("p", FlowSettings(headroom_idle_s=0.02), asyncio.get_running_loop().time).gate("m", 2, 3.0)
    q = Queue(gate)
    await q.ask("i", "interactive")
    await q.ask("b1", "batch")  # one free slot: the reserve, while a person is here
    await q.ask("b2", "batch")
    await q.done("i")  # b1 takes one of the two free slots, b2 waits on the other: the reserve
    assert q.served == ["i", "b1"]
    await asyncio.wait_for(q.tasks["b2"], 5)  # nothing else happens: the window's timer looks again
    assert q.served == ["i", "b1", "b2"]


async def test_the_reserve_grows_with_the_urgent_arrival_rate_and_the_slot_time() -> None:
    clock = Clock()
    gate = member(budget=64, clock=clock, interactive_headroom=1, headroom_window_s=10.0, headroom_miss=0.01)
    slots = [await gate.acquire("interactive", "t")]  # present, no slot released yet: the floor
    assert gate.reserve(16) == 1
    clock.now += 4.0
    slots.pop().release()  # slots are held 4 s: a full member frees one every 0.25 s
    clock.now += 6.0
    for _ in range(9):
        slots.append(await gate.acquire("interactive", "t"))
    # 10 arrivals in 10 s: 0.25 expected before the next slot frees; P(N > 1) = 0.026, P(N > 2) = 0.002
    assert gate.urgent_rate() == pytest.approx(1.0)
    assert gate.reserve(16) == 2
    for _ in range(30):
        slots.append(await gate.acquire("standard", "t"))  # standard counts as urgent too: 4/s, 1 expected
    assert gate.reserve(16) == 4
    assert gate.reserve(3) == 2  # never more than the budget less one
    clock.now += 11.0  # the arrivals leave the window; those in flight keep the floor
    assert gate.urgent_rate() == 0.0 and gate.reserve(16) == 1
    for slot in slots:
        slot.release()
    assert gate.reserve(16) == 1  # they ended just now
    clock.now += 2.0
    assert gate.reserve(16) == 0


async def test_headroom_idle_s_null_keeps_the_reserve_always() -> None:
    q = Queue(member(budget=3, interactive_headroom=1, headroom_idle_s=None))
    for name in ("b1", "b2", "b3"):
        await q.ask(name, "batch")
    assert q.served == ["b1", "b2"]


async def test_a_member_of_budget_one_still_serves_batch_when_idle() -> None:
    q = Queue(member(budget=1, interactive_headroom=4))
    await q.ask("b", "batch")
    assert q.served == ["b"]


async def test_a_request_past_its_class_deadline_is_a_429_with_its_retry_after() -> None:
    gate = member(budget=1, interactive={"max_wait_s": 0.01, "retry_after_s": 7})
    held = await gate.acquire("interactive", "t")
    with pytest.raises(UpstreamBusy) as info:
        await asyncio.wait_for(gate.acquire("interactive", "t"), 30)
    assert info.value.status == 429 and info.value.code == "upstream_busy" and info.value.retry_after == 7
    assert "max_wait_s" in info.value.message
    stats = gate.flow.stats["interactive"]
    assert stats.shed["deadline"] == 1 and stats.queued == 0
    held.release()
    assert gate.active == 0


async def test_time_waited_on_members_tried_before_counts_against_the_deadline() -> None:
    gate = member(budget=1, standard={"max_wait_s": 100})
    held = await gate.acquire("interactive", "t")
    with pytest.raises(UpstreamBusy):
        await asyncio.wait_for(gate.acquire("standard", "t", waited_s=100), 30)
    held.release()


async def test_full_queues_shed_batch_then_standard_before_interactive() -> None:
    q = Queue(member(budget=1, max_queued=2))
    await q.ask("running", "interactive")
    await q.ask("s", "standard")
    await q.ask("b", "batch")
    await q.ask("i1", "interactive")  # the pool's queues are full: the batch request gives its place up
    assert isinstance(q.tasks["b"].exception(), UpstreamBusy)
    await q.ask("i2", "interactive")  # then the standard one
    assert isinstance(q.tasks["s"].exception(), UpstreamBusy)
    await q.ask("i3", "interactive")  # nothing less urgent left: refused itself
    assert isinstance(q.tasks["i3"].exception(), UpstreamBusy)
    await q.ask("b2", "batch")  # a batch arrival sheds nobody
    assert isinstance(q.tasks["b2"].exception(), UpstreamBusy)
    flow = q.gate.flow
    assert flow.stats["batch"].shed == {"deadline": 0, "full": 1, "tenant": 0, "evicted": 1}
    assert flow.stats["standard"].shed["evicted"] == 1 and flow.stats["interactive"].shed["full"] == 1
    await q.done("running")
    await q.done("i1")
    assert q.served == ["running", "i1", "i2"]


async def test_the_newest_waiting_batch_request_is_the_one_shed() -> None:
    q = Queue(member(budget=1, max_queued=2))
    await q.ask("running", "interactive")
    await q.ask("old", "batch")
    q.gate.flow.clock.now += 1  # type: ignore[attr-defined]
    await q.ask("new", "batch")
    await q.ask("i", "interactive")
    assert isinstance(q.tasks["new"].exception(), UpstreamBusy) and not q.tasks["old"].done()


async def test_a_class_queue_and_a_tenant_have_their_own_bounds() -> None:
    q = Queue(member(budget=1, batch={"max_queued": 1}, max_queued_per_tenant=2))
    await q.ask("running", "interactive")
    await q.ask("b1", "batch", tenant="a")
    await q.ask("b2", "batch", tenant="b")  # the batch queue holds one
    assert isinstance(q.tasks["b2"].exception(), UpstreamBusy)
    await q.ask("s1", "standard", tenant="a")
    await q.ask("s2", "standard", tenant="a")  # tenant a has two waiting already
    error = q.tasks["s2"].exception()
    assert isinstance(error, UpstreamBusy) and "max_queued_per_tenant" in error.message
    await q.ask("s3", "standard", tenant="c")
    assert not q.tasks["s3"].done()
    assert q.gate.flow.stats["standard"].shed["tenant"] == 1


async def test_a_client_that_leaves_while_waiting_gives_its_place_up() -> None:
    q = Queue(member(budget=1))
    await q.ask("running", "interactive")
    await q.ask("gone", "interactive")
    await q.ask("next", "standard")
    q.tasks["gone"].cancel()
    await settle()
    flow = q.gate.flow
    assert flow.stats["interactive"].queued == 0 and flow.stats["interactive"].left == 1
    await q.done("running")
    assert q.served == ["running", "next"]


async def test_a_slot_granted_to_a_client_leaving_at_that_moment_goes_to_the_next() -> None:
    q = Queue(member(budget=1))
    await q.ask("running", "interactive")
    await q.ask("gone", "interactive")
    await q.ask("next", "interactive")
    q.slots.pop("running").release()  # granted to "gone", which has not run since
    q.tasks["gone"].cancel()
    await settle()
    assert q.served == ["running", "next"] and q.gate.active == 1


async def test_a_saturated_reading_sets_a_budget_of_what_the_server_ran() -> None:
    clock = Clock()
    q = Queue(member(budget=None, clock=clock))
    gate = q.gate
    read_at = clock.now - 0.5  # a scrape half a second ago
    gate.observe(ServerLoad(running=2, waiting=0, kv_usage=0.5, at=read_at))
    assert gate.budget() is None  # keeping up: no budget
    gate.observe(ServerLoad(running=2, waiting=3, kv_usage=0.5, at=read_at))
    assert gate.budget() == 2 and gate.in_use() == 5
    await q.ask("a", "interactive")
    assert q.served == []  # five there already: it waits here, not in the server's queue
    gate.observe(ServerLoad(running=1, waiting=0, kv_usage=0.5, at=read_at))
    await settle()
    assert q.served == ["a"] and gate.in_use() == 2  # the server's one, and the one sent since
    gate.observe(ServerLoad(running=2, waiting=0, kv_usage=0.5, at=read_at))
    assert gate.budget() == 3  # it ran its budget without queueing: one more
    gate.observe(ServerLoad(running=1, waiting=0, kv_usage=0.97, at=read_at))
    assert gate.budget() == 1  # KV cache full


async def test_releases_since_a_reading_count_before_the_next_one() -> None:
    clock = Clock()
    q = Queue(member(budget=None, clock=clock))
    await q.ask("a", "interactive")
    await q.ask("b", "interactive")
    clock.now += 1
    q.gate.observe(ServerLoad(running=2, waiting=1, kv_usage=None, at=clock.now))  # a, b and another client's
    await q.ask("c", "interactive")
    assert q.served == ["a", "b"] and q.gate.budget() == 2
    await q.done("a")  # b and the other client's: still the budget
    assert q.served == ["a", "b"]
    await q.done("b")  # the reading is older than both: this replica saw its own finish since
    assert q.served == ["a", "b", "c"]


async def test_a_budget_from_a_reading_ends_when_the_reading_goes_stale() -> None:
    q = Queue(member(budget=None, clock=None, stale_after_s=0.05))
    gate = q.gate
    gate.flow.clock = asyncio.get_running_loop().time  # the loop's own clock: its timer marks the staleness
    gate.observe(ServerLoad(running=1, waiting=4, kv_usage=None, at=gate.flow.clock()))
    await q.ask("a", "interactive")
    assert q.served == []
    await asyncio.wait_for(q.tasks["a"], 30)  # nobody read the server since: its budget no longer holds
    assert q.served == ["a"] and gate.budget() is None


async def test_a_static_budget_and_a_learnt_one_the_smaller_applies() -> None:
    clock = Clock()
    gate = member(budget=4, clock=clock)
    gate.observe(ServerLoad(running=2, waiting=1, kv_usage=None, at=clock.now))
    assert gate.budget() == 2
    off = member(budget=4, clock=clock, from_metrics=False)
    off.observe(ServerLoad(running=2, waiting=1, kv_usage=None, at=clock.now))
    assert off.budget() == 4


async def test_the_snapshot_names_each_class_and_member() -> None:
    q = Queue(member(budget=1))
    await q.ask("a", "interactive")
    await q.ask("b", "batch")
    classes, members = q.gate.flow.snapshot()
    assert [(c.pool, c.priority, c.queued) for c in classes] == [("p", "interactive", 0), ("p", "standard", 0),
                                                                 ("p", "batch", 1)]
    assert [(m.pool, m.member, m.budget, m.in_use) for m in members] == [("p", "m", 1, 1)]
    q.tasks["b"].cancel()
    await settle()
