"""Flow control's figures on /metrics: queue depth, wait and refusals per pool and priority class, budgets per member.

The gateway's flow control (gateway/upstream/flow.py) keeps the counts; this collector reads them at
scrape time. Labels are bounded by the configuration: pools and members are the configured ones,
classes and reasons fixed sets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# seconds a request waited for a member before it was sent
WAIT_BUCKETS: tuple[float, ...] = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# why a request was answered 429 by flow control: past its class's max_wait_s, its class's queue (or the
# pool's) full, its tenant's share full, shed from the queue for a more urgent arrival
SHED_REASONS: tuple[str, ...] = ("deadline", "full", "tenant", "evicted")


@dataclass(slots=True)
class FlowClassStats:
    """One pool's counts for one class: waiting now, and since start."""

    pool: str
    priority: str
    queued: int = 0  # waiting now
    waited: int = 0  # sent after waiting (a request sent at once is not counted)
    wait_sum_s: float = 0.0
    wait_counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))  # per bucket, +Inf last
    shed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SHED_REASONS, 0))
    left: int = 0  # clients that left while waiting

    def observe_wait(self, seconds: float) -> None:
        self.waited += 1
        self.wait_sum_s += seconds
        for i, bound in enumerate(WAIT_BUCKETS):
            if seconds <= bound:
                self.wait_counts[i] += 1
                return
        self.wait_counts[-1] += 1


@dataclass(slots=True, frozen=True)
class FlowMemberStats:
    """One member's budget (None: none now) and the requests counted against it."""

    pool: str
    member: str
    budget: int | None
    in_use: int


FlowRead = Callable[[], tuple[Sequence[FlowClassStats], Sequence[FlowMemberStats]]]


class FlowCollector:
    """The flow-control families, read from the pool at each scrape."""

    def __init__(self, read: FlowRead) -> None:
        self._read = read

    def describe(self) -> list[Any]:
        return self._families()

    @staticmethod
    def _families() -> list[Any]:
        klass = ["pool", "priority"]
        return [
            GaugeMetricFamily("tierlane_flow_queued", "Requests waiting for a member of the pool, by priority class",
                              labels=klass),
            HistogramMetricFamily("tierlane_flow_wait_seconds", "How long requests that waited for a member waited, by class",
                                  labels=klass),
            CounterMetricFamily("tierlane_flow_refused", "Requests flow control answered 429, by class and reason "
                                "(deadline, full, tenant, evicted)", labels=[*klass, "reason"]),
            CounterMetricFamily("tierlane_flow_left", "Clients that left while their request waited for a member",
                                labels=klass),
            GaugeMetricFamily("tierlane_flow_budget", "A member's concurrency budget (absent: none now)",
                              labels=["pool", "member"]),
            GaugeMetricFamily("tierlane_flow_in_use", "Requests counted against a member's budget", labels=["pool", "member"]),
        ]  # fmt: skip

    def collect(self) -> list[Any]:
        families = self._families()
        queued, wait, refused, left, budget, in_use = families
        classes, members = self._read()
        for st in classes:
            labels = [st.pool, st.priority]
            queued.add_metric(labels, float(st.queued))
            running = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip([*map(str, WAIT_BUCKETS), "+Inf"], st.wait_counts):
                running += count
                buckets.append((bound, float(running)))
            wait.add_metric(labels, buckets, st.wait_sum_s)
            for reason, n in st.shed.items():
                refused.add_metric([*labels, reason], float(n))
            left.add_metric(labels, float(st.left))
        for m in members:
            if m.budget is not None:
                budget.add_metric([m.pool, m.member], float(m.budget))
            in_use.add_metric([m.pool, m.member], float(m.in_use))
        return families
