"""The served error of semantic cache hits, estimated online, and the thresholds that keep it bounded.

`cache.max_error_rate` (per tenant/app through the policy's overrides) turns this on. The shadow
stage re-asks the upstream for a sample of served semantic hits and judges each: the served
answer was right or wrong. Every judged hit is an observation (score it was served at, right or
wrong, the stored entry that served it) for its scope (tenant/app). From these:

- Per scope, the served error is estimated over the last `window` observations as they would be
  served now (an observation counts when its score clears the threshold its entry has now), with
  a one-sided Wilson upper bound at `confidence` (default 0.95).
- The scope's threshold (the verifier's probability a hit needs, or the cosine gate when the
  verifier is off) moves so that the upper bound stays <= max_error_rate: when the bound is
  exceeded and errors are counted, it rises at once to the lowest value (just above an observed
  error's score) where the bound holds, or where no observed error is left; when the bound holds
  and `loosen_after` observations came since the last move, it drops by one step, never below
  `floor`, if the bound holds at the lower value too.
- Observations are also made without serving: a candidate that passed every check but the
  bound's threshold (a miss, so the upstream answers the request anyway) is judged by comparing
  the upstream's answer with the stored one, at no extra upstream call. These score below the
  threshold: they count once a threshold that low is considered, which is what lets a scope
  that tightened find its way down again (and what a loosening step is checked against). A new scope starts at the shipped threshold (`start`) and cannot move down before
  its bound holds: at max_error_rate 0.02 and 95 % that takes about 135 right answers in a row.
- Per stored entry (vCache's threshold per cached entry, learnt online), once it has
  `entry_observations` judged hits: an entry served wrongly at least once needs a score above
  its worst-scored error (and never less than the scope's threshold), one never served wrongly
  may serve one step below the lowest score it was right at (never below `floor`). Until then
  the entry follows its scope.

State is bounded: at most `max_scopes` scopes and `max_entries` entries, least recently used
dropped first, and `window` observations per scope. The estimator is pure logic behind one lock;
the cache backends call it from their worker thread. With the shared (Redis/Valkey) backend,
observations travel on the cache's stream, so every replica applies every observation to its
own estimator (a replica that starts later starts with empty state: conservative); the lookup
and hit counts behind the hit rate are per replica.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Literal

Kind = Literal["probability", "cosine"]

_ABOVE = 1e-6  # a threshold "just above" an observed score
_LOOSEN_CUTS = 20  # at most this many cuts below are tried when a scope looks for one that holds


def wilson_upper(errors: int, n: int, confidence: float) -> float:
    """One-sided Wilson score upper bound of a proportion (1.0 with no observations)."""
    if n <= 0:
        return 1.0
    z = NormalDist().inv_cdf(confidence)
    p = errors / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return min(1.0, (centre + margin) / (1 + z2 / n))


@dataclass(slots=True, frozen=True)
class BoundParams:
    """What the bound needs of one resolved cache policy (built in policies/cache/config.py)."""

    max_error_rate: float
    kind: Kind  # what the threshold applies to: the verifier's probability, or the cosine
    start: float  # the shipped threshold: where a new scope starts
    floor: float  # the lowest threshold loosening may reach
    confidence: float = 0.95
    sample_rate: float = 0.2  # share of served semantic hits the shadow stage judges
    loosen_after: int = 50  # observations since the last move before one loosening step
    entry_observations: int = 8  # judged hits an entry needs before it has its own threshold
    ceiling: float = 1.0 + _ABOVE  # above every score: no semantic hit at all

    def step(self, threshold: float) -> float:
        """One loosening step from `threshold`: a quarter of the distance to 1 for a probability
        (0.96 -> 0.95 -> 0.9375 ...), 0.005 for a cosine."""
        if self.kind == "probability":
            return max(0.005, (1.0 - min(threshold, 1.0)) * 0.25)
        return 0.005


@dataclass(slots=True)
class _EntryStats:
    n: int = 0
    wrong: int = 0
    lowest_right: float = math.inf
    highest_wrong: float = -math.inf


_EMPTY = _EntryStats()


@dataclass(slots=True)
class _Scope:
    params: BoundParams
    threshold: float
    window: deque[tuple[float, bool, int]]
    since_move: int = 0
    observed: int = 0
    observed_wrong: int = 0
    lookups: int = 0
    hits: int = 0
    semantic_hits: int = 0
    tightened: int = 0
    loosened: int = 0
    # the estimate as of the last observation (kept so that reading the stats costs no pass over the window)
    errors_now: int = 0
    counted_now: int = 0
    entries_with_threshold: int = 0


@dataclass(slots=True, frozen=True)
class ScopeStats:
    """One scope's state, for /metrics and the cache's stats."""

    scope: str
    kind: Kind
    max_error_rate: float
    threshold: float
    error: float | None  # the estimated served error as hits are served now (None: no observation counts)
    upper: float  # its upper confidence bound
    counted: int  # observations the estimate counts
    observed: int  # every observation since the scope was created
    observed_wrong: int
    lookups: int
    hits: int
    semantic_hits: int
    tightened: int
    loosened: int
    entries_with_threshold: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None


@dataclass(slots=True)
class ErrorBounds:
    """Per scope and per entry thresholds learnt from judged hits; thread-safe, bounded."""

    window: int = 2000
    max_scopes: int = 10_000
    max_entries: int = 100_000
    _scopes: OrderedDict[str, _Scope] = field(default_factory=OrderedDict)
    _entries: OrderedDict[int, _EntryStats] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # The lookup path.

    def threshold(self, scope: str, params: BoundParams, entry_id: int | None = None) -> float:
        """The threshold a candidate of `entry_id` needs in `scope` now."""
        with self._lock:
            state = self._scope(scope, params)
            return self._threshold_for(state, state.threshold, entry_id)

    def serves(self, scope: str, params: BoundParams, entry_id: int, score: float) -> bool:
        """Whether a candidate scored `score` may be served in `scope`."""
        return score >= self.threshold(scope, params, entry_id)

    def count_lookup(self, scope: str, params: BoundParams, *, hit: bool, exact: bool) -> None:
        """One lookup the cache answered (`hit`) or not; for the hit rate."""
        with self._lock:
            state = self._scope(scope, params)
            state.lookups += 1
            state.hits += hit
            state.semantic_hits += hit and not exact

    # Observations.

    def observe(self, scope: str, params: BoundParams, entry_id: int, score: float, *, wrong: bool) -> None:
        """A judged semantic hit: served in `scope` from `entry_id` at `score`, right or `wrong`."""
        with self._lock:
            state = self._scope(scope, params)
            state.window.append((score, wrong, entry_id))
            state.observed += 1
            state.observed_wrong += wrong
            state.since_move += 1
            entry = self._entries.get(entry_id)
            if entry is None:
                entry = self._entries[entry_id] = _EntryStats()
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(entry_id)
            entry.n += 1
            if wrong:
                entry.wrong += 1
                entry.highest_wrong = max(entry.highest_wrong, score)
            else:
                entry.lowest_right = min(entry.lowest_right, score)
            self._adapt(state)
            state.errors_now, state.counted_now = self._served(state, state.threshold)
            state.entries_with_threshold = len({e for _, _, e in state.window
                                                if self._entries.get(e, _EMPTY).n >= state.params.entry_observations})  # fmt: skip

    def stats(self) -> list[ScopeStats]:
        with self._lock:
            out = []
            for name, state in self._scopes.items():
                errors, n = state.errors_now, state.counted_now
                out.append(ScopeStats(
                    scope=name, kind=state.params.kind, max_error_rate=state.params.max_error_rate,
                    threshold=min(state.threshold, 1.0), error=errors / n if n else None,
                    upper=wilson_upper(errors, n, state.params.confidence), counted=n, observed=state.observed,
                    observed_wrong=state.observed_wrong, lookups=state.lookups, hits=state.hits,
                    semantic_hits=state.semantic_hits, tightened=state.tightened, loosened=state.loosened,
                    entries_with_threshold=state.entries_with_threshold,
                ))  # fmt: skip
            return out

    def __len__(self) -> int:
        return len(self._scopes)

    # Under the lock.

    def _scope(self, name: str, params: BoundParams) -> _Scope:
        state = self._scopes.get(name)
        if state is None or state.params != params:  # new, or its policy changed: start again
            state = _Scope(params, params.start, deque(maxlen=self.window))
            self._scopes[name] = state
            while len(self._scopes) > self.max_scopes:
                self._scopes.popitem(last=False)
        self._scopes.move_to_end(name)
        return state

    def _threshold_for(self, state: _Scope, scope_threshold: float, entry_id: int | None) -> float:
        params = state.params
        entry = self._entries.get(entry_id) if entry_id is not None else None
        if entry is None or entry.n < params.entry_observations:
            return scope_threshold
        if entry.wrong:
            return min(params.ceiling, max(scope_threshold, entry.highest_wrong + _ABOVE))
        loose = entry.lowest_right - params.step(entry.lowest_right)
        return max(params.floor, min(scope_threshold, loose))

    def _served(self, state: _Scope, scope_threshold: float) -> tuple[int, int]:
        """(errors, count) of the window's observations that would be served at `scope_threshold`."""
        errors = n = 0
        cut: dict[int, float] = {}
        for score, wrong, entry_id in state.window:
            t = cut.get(entry_id)
            if t is None:
                t = cut[entry_id] = self._threshold_for(state, scope_threshold, entry_id)
            if score >= t:
                n += 1
                errors += wrong
        return errors, n

    def _adapt(self, state: _Scope) -> None:
        params = state.params
        errors, n = self._served(state, state.threshold)
        upper = wilson_upper(errors, n, params.confidence)
        if upper > params.max_error_rate and errors:
            # Tighten at once: the lowest cut just above an observed error where the bound holds,
            # or where no observed error is served any more.
            cuts = sorted({score + _ABOVE for score, wrong, _ in state.window if wrong and score + _ABOVE > state.threshold})
            for cut in cuts:
                e, m = self._served(state, cut)
                if e == 0 or wilson_upper(e, m, params.confidence) <= params.max_error_rate:
                    break
            else:  # pragma: no cover - the last cut leaves no error of the window served
                cut = params.ceiling
            state.threshold = min(params.ceiling, cut)
            state.tightened += 1
            state.since_move = 0
        elif state.since_move >= params.loosen_after and state.threshold > params.floor:
            # Loosen one step when the bound holds at the lower value (judged candidates the bound
            # refused, scored below the threshold, count there: a step into a region known to hold
            # errors is not taken; with none observed there it is the same set of hits). When it
            # does not, but judged candidates further down show a cut where it holds (a scope that
            # tightened past an error and serves nothing now), the highest such cut.
            lower = max(params.floor, state.threshold - params.step(state.threshold))
            target: float | None = None
            if self._holds(state, lower):
                target = lower
            else:
                below = sorted({score for score, _, _ in state.window if params.floor <= score < lower}, reverse=True)
                stride = max(1, len(below) // _LOOSEN_CUTS)
                target = next((cut for cut in below[::stride] if self._holds(state, cut)), None)
            if target is not None:
                state.threshold = target
                state.loosened += 1
                state.since_move = 0

    def _holds(self, state: _Scope, cut: float) -> bool:
        errors, n = self._served(state, cut)
        return wilson_upper(errors, n, state.params.confidence) <= state.params.max_error_rate
