"""When a learned template may be answered by the edge: its measured disagreement with the upstream, bounded.

Per artifact, one gate, in one of three states:

- `shadow`: every request goes upstream; a sampled share (`shadow_rate`) is also answered by the
  adapter off the request's path, and each answer the adapter was confident enough to serve (its
  confidence at or above the threshold) is judged against the upstream's: one observation.
- `serving`: the edge answers the requests whose confidence clears the threshold, the rest go
  upstream; a sampled share of the local answers (`recheck_rate`) is re-asked upstream and judged,
  so the bound is held online.
- `suspended`: was serving until the bound broke; behaves as shadow (the upstream answers, the
  adapter keeps being judged) and serves again only when the bound holds again.

The bound: over the latest `window` observations, the one-sided Wilson upper bound of the
disagreement at `confidence` must be at most `max_disagreement`, with at least `min_observations`
of them (at 0.02 and 95 % that takes about 135 agreeing answers in a row). A serving gate is
suspended on the first observation after which the bound fails: after a change of traffic (a new
label set, another language) every judged answer disagrees, so it takes a handful of judged
answers (4 after 200 agreeing ones at 0.02), that is about that many over `recheck_rate` served
requests.

Pure logic behind one lock; thread-safe.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from policies.cache.error_bound import wilson_upper

SHADOW, SERVING, SUSPENDED = "shadow", "serving", "suspended"
MAX_TRANSITIONS = 64


@dataclass(frozen=True, slots=True)
class GateParams:
    max_disagreement: float = 0.02
    confidence: float = 0.95
    min_observations: int = 50
    window: int = 500


@dataclass(slots=True)
class Gate:
    """One artifact's state and its counters."""

    params: GateParams
    state: str = SHADOW
    _window: deque[bool] = field(default_factory=deque)  # True: the adapter's answer disagreed
    _wrong: int = 0
    observed: int = 0
    observed_wrong: int = 0
    shadowed: int = 0  # requests the adapter answered beside the upstream (shadow and suspended)
    confident: int = 0  # of those, answers at or above the threshold (what serving would have answered)
    served: int = 0  # requests answered by the edge
    declined: int = 0  # requests of a serving gate sent upstream, the adapter not confident enough
    rechecked: int = 0  # served answers re-asked upstream
    transitions: list[tuple[str, int]] = field(default_factory=list)  # (new state, observations so far)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def serves(self) -> bool:
        return self.state == SERVING

    def observe(self, *, wrong: bool) -> str:
        """One judged answer; the state after it."""
        with self._lock:
            self._window.append(wrong)
            self._wrong += wrong
            if len(self._window) > self.params.window:
                self._wrong -= self._window.popleft()
            self.observed += 1
            self.observed_wrong += wrong
            holds = len(self._window) >= self.params.min_observations and self._upper() <= self.params.max_disagreement
            if self.state == SERVING and not holds:
                self._move(SUSPENDED)
            elif self.state != SERVING and holds:
                self._move(SERVING)
            return self.state

    def count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def _upper(self) -> float:
        return wilson_upper(self._wrong, len(self._window), self.params.confidence)

    def _move(self, state: str) -> None:
        self.state = state
        self.transitions.append((state, self.observed))
        if len(self.transitions) > MAX_TRANSITIONS:  # bounded: the first (when it first served) and the latest
            del self.transitions[1]

    def figures(self) -> dict[str, object]:
        """The state, the measured disagreement with its interval, and the counters."""
        with self._lock:
            n = len(self._window)
            share = self.served / (self.served + self.declined) if self.served + self.declined else None
            return {
                "state": self.state,
                "disagreement": self._wrong / n if n else None,
                "disagreement_upper": self._upper(),
                "max_disagreement": self.params.max_disagreement,
                "judged": n,
                "judged_total": self.observed,
                "disagreed_total": self.observed_wrong,
                "shadowed": self.shadowed,
                "confident_in_shadow": self.confident,
                "served": self.served,
                "declined": self.declined,
                "local_share": share,
                "rechecked": self.rechecked,
                "transitions": [{"state": s, "after_judged": k} for s, k in self.transitions],
            }
