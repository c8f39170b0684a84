"""A per-upstream circuit breaker: closed → open after N consecutive failures → half-open probe.

Only a closed breaker lets client requests through. Once an open breaker's cooldown has
passed it is half-open: the pool then sends its own probe (never a client's request); the
probe's success closes the breaker, its failure opens it for another cooldown.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class CircuitBreaker:
    failures_to_open: int
    cooldown_s: float
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        if self.clock() - self.opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def allow(self) -> bool:
        """May a client request be sent now? Only while closed: probes are the pool's own."""
        return self.opened_at is None

    def available(self) -> bool:
        """Does this upstream take client requests (for picking and readiness)?"""
        return self.opened_at is None

    def due_in(self) -> float | None:
        """Seconds until a probe is due (0 when due now); None when closed or a probe is running."""
        if self.opened_at is None or self.probing:
            return None
        return max(0.0, self.opened_at + self.cooldown_s - self.clock())

    def claim_probe(self) -> bool:
        """Half-open and no probe running: claim the probe (the caller must `end_probe`)."""
        if self.probing or self.state != "half_open":
            return False
        self.probing = True
        return True

    def end_probe(self, ok: bool) -> None:
        self.probing = False
        if ok:
            self.success()
        else:
            self.failure()

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None

    def failure(self) -> None:
        self.failures += 1
        if self.opened_at is not None or self.failures >= self.failures_to_open:
            self.opened_at = self.clock()
