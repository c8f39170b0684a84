"""Flow control: when a request goes to the member placement chose, by priority class.

Placement (pool._place, affinity.py, placement.py) decides *where* a request goes; this decides
*when*. Each member has a gate with a concurrency budget:

- `upstreams[].max_concurrency`, where set;
- where the pool scrapes the member's metrics (server_load.py) and `flow.from_metrics` is on, the
  requests it was running when a reading last showed it saturated (vLLM or SGLang waiting requests,
  llama.cpp deferred ones, or KV use at `flow.kv_saturated`), raised by one at each reading that
  shows it running that many without queueing (so a budget learnt under a burst of long prompts
  grows back); used while readings are current;
- the smaller of the two where both apply; none at all otherwise: a member nobody configured and
  whose server never said it was saturated sends every request at once, as without flow control.

Against the budget counts what the member runs: where a reading is current, the server's own count
then, plus the requests this replica sent since, less those it saw finish since (other clients and
replicas count too); else this replica's requests in flight.

A request past the budget waits here, in its class's queue of that member: interactive first;
standard next, and a standard request that has waited `standard_promote_after_s` goes as an
interactive one that came when it did (a steady interactive stream cannot starve it); batch only
when no interactive or standard request waits, and never into the member's reserve: the free slots
kept for interactive and standard arrivals ("urgent" below), always at most the budget less one (a
member of budget 1 still serves batch when idle). The reserve adapts to the member's recent urgent
demand:

- idle: no urgent request in flight or waiting at the member, and none arrived or ended there for
  `headroom_idle_s`: no reserve, batch may fill every slot (the next urgent arrival waits at most
  until one of them ends, and goes before any batch request then);
- present: the larger of `interactive_headroom` (the floor) and the adaptive reserve r, the fewest
  free slots that the urgent requests arriving before the member's next slot frees exceed with at
  most `headroom_miss` probability: arrivals over that horizon as Poisson with mean λ·s/b, where λ
  is the member's urgent arrivals over the last `headroom_window_s` per second (over the time since
  its first one, at least a second, while that is shorter), s the mean time a
  slot is held (an average over the member's releases, every class), b the budget (a full member
  frees a slot every s/b on average). Until a slot has been released, the floor alone.

The reserve is what keeps an interactive request from waiting behind batch work: at a fixed reserve
of 1 on 16-slot GPU members at 30 % interactive load, two urgent arrivals between releases were
common enough that the simulated p99 TTFT was 6.9x alone (bench/scheduling_sim.py); the adaptive
reserve keeps 2 there, and 0 on a member no person uses. A freed slot goes to the next waiter at
once: waiting is an asyncio future, no polling; a timer looks again when an idle window ends with
batch requests waiting. A request that waits past its class's `max_wait_s`, or finds its class's queue (or its
tenant's share) full, is answered 429 `upstream_busy` with the class's Retry-After; when the
pool's queues are full altogether an arrival sheds the newest waiting batch request, then standard,
before it is refused itself. A client that leaves while waiting gives its place up.

NOTE: the server's FIFO queue knows no classes; holding the overflow here is what lets an
interactive request overtake a thousand batch lines.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence

from gateway.errors import UpstreamBusy
from gateway.upstream.flow_settings import FlowSettings
from gateway.upstream.server_load import ServerLoad
from policies.domain import PRIORITIES, Priority
from telemetry.flow_metrics import FlowClassStats, FlowMemberStats

_MAX_ARRIVALS = 4096  # urgent arrivals remembered per member; past it the rate is taken over the span they cover
_HOLD_WEIGHT = 0.05  # the weight of each release in the mean slot time


class Slot:
    """A place on a member, held from its grant until the request's answer is released (once)."""

    __slots__ = ("_gate", "at", "urgent", "waited_s")

    def __init__(self, gate: Gate, at: float, waited_s: float, urgent: bool = False) -> None:
        self._gate: Gate | None = gate
        self.at = at  # the flow clock when it was granted
        self.waited_s = waited_s  # how long the request waited for it (0: at once)
        self.urgent = urgent  # interactive or standard (what the reserve is kept for)

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release(self)


class _Waiter:
    __slots__ = ("at", "future", "gate", "priority", "tenant", "timer")

    def __init__(self, gate: Gate, priority: Priority, tenant: str, at: float, future: asyncio.Future[Slot]) -> None:
        self.gate = gate
        self.priority = priority
        self.tenant = tenant
        self.at = at
        self.future = future
        self.timer: asyncio.TimerHandle | None = None


class PoolFlow:
    """One pool's queue bounds and counts, shared by its members' gates."""

    def __init__(self, name: str, settings: FlowSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.settings = settings
        self.clock = clock
        self.stats = {p: FlowClassStats(name, p) for p in PRIORITIES}
        self.gates: list[Gate] = []
        self._queued = 0
        self._tenants: dict[str, int] = {}

    def gate(self, member: str, static: int | None, stale_after_s: float) -> Gate:
        """The gate of a member of this pool (`static`: its max_concurrency)."""
        gate = Gate(self, member, static, stale_after_s)
        self.gates.append(gate)
        return gate

    def busy(self, priority: Priority, why: str) -> UpstreamBusy:
        return UpstreamBusy(f"the upstream pool {self.name!r} is busy: {why}",
                            retry_after=self.settings.of(priority).retry_after_s)

    def admit(self, priority: Priority, tenant: str) -> None:
        """Make room for one more waiter of `priority` (shedding less urgent ones where the pool is full), or raise."""
        settings = self.settings
        stats = self.stats[priority]
        if self._tenants.get(tenant, 0) >= settings.max_queued_per_tenant:
            stats.shed["tenant"] += 1
            raise self.busy(priority, f"this tenant has {settings.max_queued_per_tenant} requests waiting for it already "
                            f"(pools.{self.name}.flow.max_queued_per_tenant)")
        limit = settings.of(priority).max_queued
        if stats.queued >= limit:
            stats.shed["full"] += 1
            raise self.busy(priority, f"{limit} {priority} requests are waiting for it already "
                            f"(pools.{self.name}.flow.{priority}.max_queued)")
        if self._queued >= settings.max_queued:
            victim = self._victim(priority)
            if victim is None:
                stats.shed["full"] += 1
                raise self.busy(priority, f"{settings.max_queued} requests are waiting for it already "
                                f"(pools.{self.name}.flow.max_queued)")
            victim.gate.drop(victim, "evicted", "more urgent requests took this one's place while it waited")

    def _victim(self, priority: Priority) -> _Waiter | None:
        """The newest waiter of the least urgent class below `priority`, across the pool's members."""
        rank = PRIORITIES.index(priority)
        for lower in reversed(PRIORITIES[rank + 1:]):
            tails = [queue[-1] for gate in self.gates if (queue := gate.queues[lower])]
            if tails:
                return max(tails, key=lambda w: w.at)
        return None

    def counted(self, waiter: _Waiter, step: int) -> None:
        self._queued += step
        self.stats[waiter.priority].queued += step
        left = self._tenants.get(waiter.tenant, 0) + step
        if left > 0:
            self._tenants[waiter.tenant] = left
        else:
            self._tenants.pop(waiter.tenant, None)

    def snapshot(self) -> tuple[list[FlowClassStats], list[FlowMemberStats]]:
        members = [FlowMemberStats(self.name, g.member, g.budget(), g.in_use()) for g in self.gates]
        return list(self.stats.values()), members


class Gate:
    """One member's budget, its requests in flight and its queues by class."""

    def __init__(self, flow: PoolFlow, member: str, static: int | None, stale_after_s: float) -> None:
        self.flow = flow
        self.member = member
        self.static = static
        self.stale_after_s = stale_after_s
        self.capacity: int | None = None  # learnt from readings that showed the member saturated
        self.reading: ServerLoad | None = None
        self.active = 0  # slots this replica holds on the member
        self.queues: dict[Priority, deque[_Waiter]] = {p: deque() for p in PRIORITIES}
        self._waiting = 0
        self._grants: list[float] = []  # when each held slot was granted
        self._done_since = 0  # slots granted before the reading and released after it
        self._stale: asyncio.TimerHandle | None = None
        self._stale_at: float | None = None
        # the reserve's inputs: urgent (interactive, standard) arrivals, in flight and last seen; mean slot time
        self._arrivals: deque[float] = deque(maxlen=_MAX_ARRIVALS)
        self._urgent_active = 0
        self._urgent_seen: float | None = None
        self._first_urgent: float | None = None
        self._hold_s: float | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._idle_at: float | None = None

    # -- the budget ---------------------------------------------------------------------------
    def _current(self) -> ServerLoad | None:
        reading = self.reading
        if reading is None or self.flow.clock() - reading.at > self.stale_after_s:
            return None
        return reading

    def budget(self) -> int | None:
        """Requests the member may run now; None: no budget (every request goes at once)."""
        learnt = self.capacity if self._current() is not None else None
        if self.static is None or learnt is None:
            return self.static if learnt is None else learnt
        return min(self.static, learnt)

    def in_use(self) -> int:
        """What counts against the budget: the server's count at a current reading, corrected by this replica's
        grants and releases since; else this replica's slots."""
        reading = self._current()
        if reading is None:
            return self.active
        since = sum(1 for t in self._grants if t > reading.at)
        return max(self.active, reading.requests + since - self._done_since)

    def observe(self, reading: ServerLoad) -> None:
        """A new reading of the member's metrics (the pool's scraper calls this)."""
        settings = self.flow.settings
        if settings.from_metrics:
            kv = reading.kv_usage
            if reading.waiting > 0 or (kv is not None and kv >= settings.kv_saturated):
                self.capacity = max(1, reading.running)
            elif self.capacity is not None and reading.requests >= self.capacity:
                self.capacity += 1  # it keeps up at the budget: try one more
        self.reading = reading
        self._done_since = 0
        self._dispatch()

    # -- slots ----------------------------------------------------------------------------------
    async def acquire(self, priority: Priority, tenant: str | None, waited_s: float = 0.0) -> Slot:
        """A slot for a request of `priority`: at once where the member has room for it, else once it is its turn.

        UpstreamBusy (429) when it may not wait (its class's queue, its tenant's share or the pool's queues are
        full) or waits past its class's max_wait_s less `waited_s` (waited already, for members tried before)."""
        urgent = priority != "batch"
        if urgent:
            now = self.flow.clock()
            if self._first_urgent is None:
                self._first_urgent = now
            self._arrivals.append(now)
            self._urgent_seen = now
        budget = self.budget()
        if budget is None or self._goes_now(priority, budget):
            return self._hold(0.0, urgent)
        flow = self.flow
        key = tenant or ""
        flow.admit(priority, key)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(self, priority, key, flow.clock(), loop.create_future())
        self.queues[priority].append(waiter)
        self._waiting += 1
        flow.counted(waiter, 1)
        waiter.timer = loop.call_later(max(0.0, flow.settings.of(priority).max_wait_s - waited_s), self._expire, waiter)
        self._dispatch()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()  # granted while the client left: the slot goes to the next
            elif self._remove(waiter):
                flow.stats[priority].left += 1
            raise

    def release(self, slot: Slot) -> None:
        self.active -= 1
        now = self.flow.clock()
        held = max(0.0, now - slot.at)
        self._hold_s = held if self._hold_s is None else self._hold_s + _HOLD_WEIGHT * (held - self._hold_s)
        if slot.urgent:
            self._urgent_active -= 1
            self._urgent_seen = now
        try:
            self._grants.remove(slot.at)
        except ValueError:
            pass
        reading = self.reading
        if reading is not None and slot.at <= reading.at:
            self._done_since += 1
        self._dispatch()

    def drop(self, waiter: _Waiter, reason: str, why: str) -> None:
        """Take a waiter out of its queue and answer it 429 (`reason`: a SHED_REASONS label)."""
        if self._remove(waiter):
            self.flow.stats[waiter.priority].shed[reason] += 1
            waiter.future.set_exception(self.flow.busy(waiter.priority, why))

    def _hold(self, waited_s: float, urgent: bool) -> Slot:
        now = self.flow.clock()
        self.active += 1
        self._urgent_active += urgent
        self._grants.append(now)
        return Slot(self, now, waited_s, urgent)

    def _goes_now(self, priority: Priority, budget: int) -> bool:
        free = budget - self.in_use()
        if free <= 0:
            return False
        queues = self.queues
        if queues["interactive"] or queues["standard"]:
            return False
        if priority != "batch":
            return True
        return not queues["batch"] and free > self.reserve(budget)

    # -- the reserve ----------------------------------------------------------------------------
    def idle(self) -> bool:
        """No urgent request in flight or waiting here, and none arrived or ended for headroom_idle_s."""
        idle_s = self.flow.settings.headroom_idle_s
        if idle_s is None or self._urgent_active > 0 or self.queues["interactive"] or self.queues["standard"]:
            return False
        return self._urgent_seen is None or self.flow.clock() - self._urgent_seen >= idle_s

    def urgent_rate(self) -> float:
        """Urgent arrivals per second at this member over the last headroom_window_s."""
        window = self.flow.settings.headroom_window_s
        now = self.flow.clock()
        arrivals = self._arrivals
        while arrivals and now - arrivals[0] > window:
            arrivals.popleft()
        if not arrivals:
            return 0.0
        if len(arrivals) == arrivals.maxlen:
            return len(arrivals) / max(now - arrivals[0], 1e-3)
        assert self._first_urgent is not None
        return len(arrivals) / min(window, max(now - self._first_urgent, 1.0))  # a member seen for less than the window

    def reserve(self, budget: int | None) -> int:
        """Free slots batch requests leave on this member now (the module's docstring says how many and why)."""
        if budget is None or budget <= 1 or self.idle():
            return 0
        settings = self.flow.settings
        cap = budget - 1
        floor = min(settings.interactive_headroom, cap)
        if self._hold_s is None:
            return floor
        expected = self.urgent_rate() * self._hold_s / budget  # urgent arrivals before the next slot frees
        return max(floor, _poisson_quantile(expected, settings.headroom_miss, cap))

    def _watch_idle(self) -> None:
        """With batch requests waiting on a reserve kept only because urgent traffic was seen lately, look again when
        the idle window ends (nothing else says so)."""
        idle_s = self.flow.settings.headroom_idle_s
        due = None
        if (idle_s is not None and self.queues["batch"] and self._urgent_seen is not None and not self._urgent_active
                and not self.queues["interactive"] and not self.queues["standard"]):
            due = self._urgent_seen + idle_s
        if due == self._idle_at:
            return
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self._idle_at = due
        if due is not None:
            self._idle = asyncio.get_running_loop().call_later(max(0.0, due - self.flow.clock()) + 0.001, self._on_idle)

    def _on_idle(self) -> None:
        self._idle, self._idle_at = None, None
        self._dispatch()

    def _remove(self, waiter: _Waiter) -> bool:
        queue = self.queues[waiter.priority]
        try:
            queue.remove(waiter)
        except ValueError:
            return False
        self._waiting -= 1
        self.flow.counted(waiter, -1)
        if waiter.timer is not None:
            waiter.timer.cancel()
        return True

    def _expire(self, waiter: _Waiter) -> None:
        max_wait = self.flow.settings.of(waiter.priority).max_wait_s
        self.drop(waiter, "deadline", f"this {waiter.priority} request waited {max_wait:g} s for a member "
                  f"(pools.{self.flow.name}.flow.{waiter.priority}.max_wait_s)")

    # -- the queues' order ----------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Grant free slots to waiters, in order, while there are both."""
        if not self._waiting and self._stale is None and self._idle is None:
            return
        budget = self.budget()
        while self._waiting:
            free = math.inf if budget is None else budget - self.in_use()
            if free <= 0:
                break
            waiter = self._next(free, budget)
            if waiter is None:
                break
            self._remove(waiter)
            waited = self.flow.clock() - waiter.at
            self.flow.stats[waiter.priority].observe_wait(waited)
            waiter.future.set_result(self._hold(waited, waiter.priority != "batch"))
        self._watch_staleness()
        self._watch_idle()

    def _next(self, free: float, budget: int | None) -> _Waiter | None:
        queues = self.queues
        first = queues["interactive"][0] if queues["interactive"] else None
        standard = queues["standard"][0] if queues["standard"] else None
        if standard is not None and (first is None or (
                self.flow.clock() - standard.at >= self.flow.settings.standard_promote_after_s and standard.at < first.at)):
            return standard
        if first is not None:
            return first
        batch = queues["batch"][0] if queues["batch"] else None
        return batch if batch is not None and free > self.reserve(budget) else None

    def _watch_staleness(self) -> None:
        """With requests waiting on a budget a reading set, look again when that reading goes stale (the budget and
        the count change then, and no event says so)."""
        reading = self._current() if self._waiting else None
        due = None if reading is None else reading.at + self.stale_after_s
        if due == self._stale_at:
            return
        if self._stale is not None:
            self._stale.cancel()
            self._stale = None
        self._stale_at = due
        if due is not None:
            self._stale = asyncio.get_running_loop().call_later(max(0.0, due - self.flow.clock()) + 0.001, self._on_stale)

    def _on_stale(self) -> None:
        self._stale, self._stale_at = None, None
        self._dispatch()


def _poisson_quantile(mean: float, miss: float, cap: int) -> int:
    """The fewest r (at most `cap`) with P(N > r) <= miss for N ~ Poisson(mean)."""
    if mean <= 0:
        return 0
    term = cdf = math.exp(-mean)
    r = 0
    while 1.0 - cdf > miss and r < cap:
        r += 1
        term *= mean / r
        cdf += term
    return r


def snapshot(flows: Sequence[PoolFlow]) -> tuple[list[FlowClassStats], list[FlowMemberStats]]:
    """Every pool's figures, for /metrics."""
    classes: list[FlowClassStats] = []
    members: list[FlowMemberStats] = []
    for flow in flows:
        c, m = flow.snapshot()
        classes += c
        members += m
    return classes, members
