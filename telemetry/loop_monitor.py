"""Event-loop stalls: how late a small periodic timer fires, measured on the loop it watches.

Anything that blocks the loop thread (a synchronous call, a long GC pause, a CPU-bound step
that should be on an executor) delays every request in flight by as long as it runs. A timer
callback due every `interval_s` fires late by about that much; its lateness is the stall.

A stall shorter than the interval can fall between two ticks and show up smaller than it
was, by at most `interval_s`: the default interval (25 ms) is a quarter of the default stall
threshold (100 ms). One tick costs a timer callback and a few additions, tens of times a
second: nothing a request can see.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 0.025
DEFAULT_STALL_S = 0.1
# Lateness buckets (seconds): a healthy loop stays in the first; GC pauses and blocking calls land
# between 10 ms and 1 s.
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class MaxSince:
    """The largest lateness since the previous `read()`, which resets it; one per consumer.

    A Prometheus scrape and an OTLP export each read their own, so neither empties the other's.
    `read()` may run on another thread (the OTel export thread): the swap is locked.
    """

    __slots__ = ("_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0

    def update(self, lag: float) -> None:
        if lag > self._value:
            with self._lock:
                if lag > self._value:
                    self._value = lag

    def read(self) -> float:
        with self._lock:
            value, self._value = self._value, 0.0
        return value


class LoopMonitor:
    """A timer on the running loop, re-armed every `interval_s`; counts how late each tick fires.

    `stalls` counts ticks late by `stall_s` or more; `max_lag_s` is the largest lateness since
    start; `window()` gives a reader of the largest since its previous read. `on_lag` callbacks
    (histograms) get every tick's lateness.
    """

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        stall_s: float = DEFAULT_STALL_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if interval_s <= 0 or stall_s <= 0:
            raise ValueError("the loop monitor's interval and stall threshold must be positive")
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.ticks = 0
        self.stalls = 0
        self.max_lag_s = 0.0
        self._clock = clock
        self._windows: list[MaxSince] = []
        self._sinks: list[Callable[[float], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    @property
    def running(self) -> bool:
        return self._handle is not None

    def window(self) -> Callable[[], float]:
        """A reader of the largest lateness (seconds) since its own previous call."""
        window = MaxSince()
        self._windows.append(window)
        return window.read

    def on_lag(self, sink: Callable[[float], None]) -> None:
        """Call `sink(lateness_s)` on every tick (on the loop thread)."""
        self._sinks.append(sink)

    def start(self) -> None:
        """Arm the timer on the running loop; a second call is a no-op."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._arm()

    def stop(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.cancel()

    def _arm(self) -> None:
        assert self._loop is not None
        self._due = self._clock() + self.interval_s
        self._handle = self._loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        if self._handle is None:
            return
        self.observe(max(0.0, self._clock() - self._due))
        self._arm()

    def observe(self, lag: float) -> None:
        """Count one tick that fired `lag` seconds late."""
        self.ticks += 1
        if lag > self.max_lag_s:
            self.max_lag_s = lag
        if lag >= self.stall_s:
            self.stalls += 1
        for window in self._windows:
            window.update(lag)
        for sink in self._sinks:
            sink(lag)
