"""A per-upstream circuit breaker: closed → open after N consecutive failures → half-open probe."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class CircuitBreaker:
    failures_to_open: int
    cooldown_s: float
    clock: object = field(default=time.monotonic, repr=False)
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        if self.clock() - self.opened_at >= self.cooldown_s:  # type: ignore[operator]
            return "half_open"
        return "open"

    def allow(self) -> bool:
        """May a request be sent now? In half-open state only one probe at a time."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self.probing:
            self.probing = True
            return True
        return False

    def available(self) -> bool:
        """Could a request be sent now, without claiming the probe."""
        state = self.state
        return state == "closed" or (state == "half_open" and not self.probing)

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.probing = False

    def failure(self) -> None:
        self.failures += 1
        self.probing = False
        if self.opened_at is not None or self.failures >= self.failures_to_open:
            self.opened_at = self.clock()  # type: ignore[operator]
