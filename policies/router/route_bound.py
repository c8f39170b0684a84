"""The quality the cost tier loses, estimated online per region, and the thresholds that bound it.

`lanes.upstream.tiers.max_quality_loss` (per tenant/app through the lanes overrides) turns this
on. The router scores a request; at or above a threshold it goes to the strong tier, below to the
cost tier. The shadow stage samples tiered requests of *both* tiers at one rate and asks the
other tier the same request (a cost-tier answer is re-asked of the strong tier, a strong-tier
answer of the cost tier), and an agreement judge (policies/router/agreement.py, answer similarity for
free text) says whether the two answers agree. Each judgement is an observation (the router's
score, disagree or not) of the request's scope (a `Scope`: tenant and app, kept apart, never joined
into one string) and region (policies/router/regions.py).

Because both tiers are sampled at the same rate, a region's observations are a uniform sample of
its tiered traffic, so for any threshold `t` the share of that traffic the cost tier would serve
*and* answer differently from the strong tier is estimated by

    loss(t) = #{observations with score < t that disagree} / #{observations}

over the last `window` observations, with a one-sided Wilson upper bound at `confidence`. That is
the quality lost against an all-strong counterfactual, in the region's own traffic: an answer
the cost tier gets right and the strong tier gets wrong also counts (disagreement bounds loss from
above). Holding every region's bound under `max_quality_loss` holds the whole scope's.

The region's threshold starts at the router's own (cold start: the router decides, as without
the bound) and moves:
- toward the strong tier at once when the upper bound exceeds `max_quality_loss` and the window
  holds disagreements below it: to the highest threshold (the least strong traffic) where the
  bound holds, or where no observed disagreement is below it (a cut at a disagreeing request's
  score sends it to the strong tier);
- back toward the router's threshold by one `step` when `loosen_after` observations came since the
  last move and the bound holds at the looser threshold too. Never past the router's threshold:
  the bound only ever buys quality, the router's strong-share target stays the operator's word
  on cost.

State is a pure fold over the observations in the order given (no clock, no randomness), so
replicas that apply one log in one order hold identical thresholds (policies/router/route_bound_log.py),
and a snapshot plus the log after it restores them. Bounded: `max_states` (scope, region) states,
least recently used dropped first, `window` observations each. Traffic counts (requests and money
saved per tier) are this replica's own and are not part of the fold.

Snapshots are per state and incremental: each state carries `at`, the log position of the last
observation folded into it, and the states changed (or dropped) since the last snapshot are kept
apart, so a snapshot takes only those (`take_changes`, a few at a time, each copy short under the
lock the route stage takes) and a replay skips an observation a state's record already holds.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any

from policies.cache.error_bound import wilson_upper


@dataclass(slots=True, frozen=True, order=True)
class Scope:
    """Whose bound: one tenant's app, the two kept apart (tenant `a/b` app `c` is not tenant `a` app `b/c`)."""

    tenant: str
    app: str

    def __str__(self) -> str:  # for people (logs); never a key
        return f"{self.tenant}/{self.app}"

    @classmethod
    def from_text(cls, text: str) -> Scope:
        """A scope the old formats joined as `tenant/app`: split at the first `/` (they could not tell more)."""
        tenant, _, app = text.partition("/")
        return cls(tenant, app)


At = tuple[int, int]  # a log position: (line, 0) in the local log, (ms, seq) of a stream id in the shared one


@dataclass(slots=True, frozen=True)
class QualityBound:
    """One resolved `lanes.upstream.tiers` bound (policies/router/policy.py builds it)."""

    max_quality_loss: float
    start: float  # the router's threshold for the tenant/app: where a region starts, and the most it loosens to
    sample_rate: float = 0.1  # share of tiered requests (both tiers) re-asked of the other tier
    confidence: float = 0.95
    loosen_after: int = 50  # observations since the last move before one loosening step
    step: float = 0.02  # one loosening step, in router-score units
    regions: str = ""  # digest of the regions the region numbers refer to: a refit starts every region again

    def __post_init__(self) -> None:
        if not 0.0 < self.max_quality_loss < 1.0:
            raise ValueError(f"max_quality_loss must be in (0, 1), got {self.max_quality_loss}")
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"quality_sample_rate must be in [0, 1], got {self.sample_rate}")
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"quality_confidence must be in [0.5, 1), got {self.confidence}")
        if self.loosen_after < 1 or self.step <= 0:
            raise ValueError("quality_loosen_after must be >= 1 and the step > 0")

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> QualityBound:
        return cls(max_quality_loss=float(raw["max_quality_loss"]), start=float(raw["start"]),
                   sample_rate=float(raw["sample_rate"]), confidence=float(raw["confidence"]),
                   loosen_after=int(raw["loosen_after"]), step=float(raw["step"]),
                   regions=str(raw.get("regions", "")))  # fmt: skip


@dataclass(slots=True)
class _State:
    params: QualityBound
    threshold: float
    window: deque[tuple[float, bool]]
    since_move: int = 0
    observed: int = 0
    disagreed: int = 0
    tightened: int = 0
    loosened: int = 0
    # the window's disagreeing scores, sorted: the loss at any cut is one bisection, not a pass
    wrong: list[float] = field(default_factory=list)
    # this replica's traffic (not folded): requests and USD saved against the strong tier, per tier
    requests: dict[str, int] = field(default_factory=lambda: {"cost": 0, "strong": 0})
    saved_usd: float = 0.0
    judge_usd: float = 0.0
    judge_failed: int = 0
    at: At = (0, 0)  # the log position of the last observation folded in


@dataclass(slots=True, frozen=True)
class RegionStats:
    """One (scope, region) now: for the dashboard and /metrics."""

    scope: Scope
    region: int
    max_quality_loss: float
    threshold: float
    start: float
    loss: float | None  # the estimated disagreement served at the threshold now (None: no observation)
    upper: float
    observed: int  # every observation since the state was created
    disagreed: int
    counted: int  # observations in the window
    tightened: int
    loosened: int
    requests_cost: int
    requests_strong: int
    saved_usd: float
    judge_usd: float
    judge_failed: int

    @property
    def strong_share(self) -> float | None:
        total = self.requests_cost + self.requests_strong
        return self.requests_strong / total if total else None


_Key = tuple[Scope, int]


@dataclass(slots=True)
class RouteBounds:
    """Per (scope, region) thresholds learnt from judged tier answers; thread-safe, bounded."""

    window: int = 1000
    max_states: int = 4096
    _states: OrderedDict[_Key, _State] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # since the last snapshot: the states an observation changed (in order), and those dropped (at the position then)
    _changed: dict[_Key, None] = field(default_factory=dict)
    _dropped: dict[_Key, At] = field(default_factory=dict)
    _at: At = (0, 0)  # the latest position observed

    def threshold(self, scope: Scope, region: int, params: QualityBound) -> float:
        """The strong-tier threshold of `region` in `scope` now."""
        with self._lock:
            state = self._states.get((scope, region))
            if state is None or state.params != params:
                return params.start  # cold start: the router decides (a state is made by an observation)
            self._states.move_to_end((scope, region))
            return state.threshold

    def observe(self, scope: Scope, region: int, params: QualityBound, score: float, *, disagree: bool,
                at: At | None = None) -> bool:  # fmt: skip
        """A judged tier answer: the router scored it `score`; the two tiers' answers disagreed or not.

        `at`, its log position: an observation at or before the state's own is already in it (a
        replay over a snapshot written meanwhile) and is skipped (False).
        """
        key = (scope, region)
        with self._lock:
            if at is not None:
                held = self._states.get(key)
                if held is not None and held.at >= at:
                    return False
                self._at = max(self._at, at)
            state = self._state(scope, region, params)
            self._append(state, float(score), bool(disagree))
            state.observed += 1
            state.disagreed += bool(disagree)
            state.since_move += 1
            if at is not None:
                state.at = at
            self._adapt(state)
            self._changed[key] = None
            return True

    def count(self, scope: Scope, region: int, params: QualityBound, tier: str, saved_usd: float) -> None:
        """One request this replica sent to `tier` (not part of the fold: every replica counts its own)."""
        with self._lock:
            state = self._state(scope, region, params)
            if tier in state.requests:
                state.requests[tier] += 1
            state.saved_usd += saved_usd

    def judge_spend(self, scope: Scope, region: int, params: QualityBound, usd: float, *, failed: bool = False) -> None:
        with self._lock:
            state = self._state(scope, region, params)
            state.judge_usd += usd
            state.judge_failed += failed

    def stats(self) -> list[RegionStats]:
        with self._lock:
            out = []
            for (scope, region), st in self._states.items():
                errors, n = self._loss(st, st.threshold)
                out.append(RegionStats(
                    scope=scope, region=region, max_quality_loss=st.params.max_quality_loss, threshold=st.threshold,
                    start=st.params.start, loss=errors / n if n else None,
                    upper=wilson_upper(errors, n, st.params.confidence), observed=st.observed, disagreed=st.disagreed,
                    counted=n, tightened=st.tightened, loosened=st.loosened, requests_cost=st.requests["cost"],
                    requests_strong=st.requests["strong"], saved_usd=st.saved_usd, judge_usd=st.judge_usd,
                    judge_failed=st.judge_failed,
                ))  # fmt: skip
            return out

    def __len__(self) -> int:
        return len(self._states)

    @property
    def at(self) -> At:
        """The latest log position observed (restored ones included)."""
        return self._at

    # Snapshots: the folded part of each state, as a record JSON keeps.

    def take_changes(self, limit: int) -> tuple[list[tuple[_Key, dict[str, Any]]], list[tuple[_Key, At]]]:
        """Up to `limit` states changed since they were last taken, as records, and the states dropped
        since (with the position then). O(what is taken) under the lock: never the whole state.
        A caller that fails to keep them gives them back (`give_back`)."""
        with self._lock:
            taken: list[tuple[_Key, _State]] = []
            while self._changed and len(taken) < limit:
                key = next(iter(self._changed))
                del self._changed[key]
                state = self._states.get(key)
                if state is not None:  # a copy: the window's items are immutable tuples
                    taken.append((key, _copy(state)))
            dropped = list(self._dropped.items())
            self._dropped.clear()
        return [(key, _record(key, st)) for key, st in taken], dropped

    def give_back(self, keys: list[_Key], dropped: list[tuple[_Key, At]]) -> None:
        """Changes taken but not kept: taken again next time."""
        with self._lock:
            for key in keys:
                if key in self._states:
                    self._changed[key] = None
            for key, at in dropped:
                if key not in self._states:
                    self._dropped.setdefault(key, at)

    def changes_pending(self) -> int:
        return len(self._changed) + len(self._dropped)

    def snapshot(self) -> dict[str, Any]:
        """Every state at once (tests, tools): the logs write `take_changes` a few states at a time."""
        with self._lock:
            return {"window": self.window, "states": [_record(key, st) for key, st in self._states.items()]}

    def restore(self, snapshot: dict[str, Any], *, changed: bool = False) -> None:
        """Replace the folded state with a snapshot's (traffic counts start again)."""
        self.restore_records(snapshot.get("states") or [], changed=changed)

    def restore_records(self, records: list[dict[str, Any]], *, changed: bool = False) -> int:
        """Replace the folded state with these records' (any order: of two of one state, the later
        position's stands); `changed`: all to be written again (an older format). Returns how many
        records were unreadable (skipped)."""
        parsed = []
        for raw in records:
            try:
                parsed.append(self._parse(raw))
            except (KeyError, TypeError, ValueError, IndexError):
                continue
        parsed.sort(key=lambda kv: kv[1].at)  # stable: records without a position keep their order
        states: OrderedDict[_Key, _State] = OrderedDict()
        for key, state in parsed:  # the later of two records of one state stands, where it stands
            states.pop(key, None)
            states[key] = state
        at = max((st.at for st in states.values()), default=(0, 0))
        dropped: dict[_Key, At] = {}
        while len(states) > self.max_states:
            dropped[states.popitem(last=False)[0]] = at
        with self._lock:
            self._states = states
            self._changed = dict.fromkeys(states) if changed else {}
            self._dropped = dropped
            self._at = at
        return len(records) - len(parsed)

    def _parse(self, raw: dict[str, Any]) -> tuple[_Key, _State]:
        params = QualityBound.from_dict(raw["params"])
        pairs = zip(raw["scores"], raw["disagree"], strict=True) if "scores" in raw else raw["window"]  # or the older form
        window: deque[tuple[float, bool]] = deque(((float(s), d in (1, "1")) for s, d in pairs), maxlen=self.window)
        scope = Scope(str(raw["tenant"]), str(raw["app"])) if "tenant" in raw else Scope.from_text(str(raw["scope"]))
        at = raw.get("at") or (0, 0)
        return (scope, int(raw["region"])), _State(
            params, float(raw["threshold"]), window, since_move=int(raw["since_move"]), observed=int(raw["observed"]),
            disagreed=int(raw["disagreed"]), tightened=int(raw["tightened"]), loosened=int(raw["loosened"]),
            wrong=sorted(score for score, d in window if d), at=(int(at[0]), int(at[1])))  # fmt: skip

    # Under the lock.

    def _state(self, scope: Scope, region: int, params: QualityBound) -> _State:
        key = (scope, region)
        state = self._states.get(key)
        if state is None or state.params != params:  # new, or its policy changed: start again
            state = _State(params, params.start, deque(maxlen=self.window))
            self._states[key] = state
            self._dropped.pop(key, None)
            while len(self._states) > self.max_states:
                old, _ = self._states.popitem(last=False)
                self._changed.pop(old, None)
                self._dropped[old] = self._at
        self._states.move_to_end(key)
        return state
    @staticmethod
    def _append(state: _State, score: float, disagree: bool) -> None:
        """Into the window, the oldest out (and out of the sorted disagreements too)."""
        window = state.window
        if window.maxlen is not None and len(window) == window.maxlen:
            old, was_wrong = window[0]
            if was_wrong:
                del state.wrong[bisect.bisect_left(state.wrong, old)]
        window.append((score, disagree))
        if disagree:
            bisect.insort(state.wrong, score)

    @staticmethod
    def _loss(state: _State, threshold: float) -> tuple[int, int]:
        """(disagreements the cost tier would serve at `threshold`, observations)."""
        return bisect.bisect_left(state.wrong, threshold), len(state.window)

    def _holds(self, state: _State, threshold: float) -> bool:
        errors, n = self._loss(state, threshold)
        return wilson_upper(errors, n, state.params.confidence) <= state.params.max_quality_loss

    def _adapt(self, state: _State) -> None:
        params = state.params
        errors, _ = self._loss(state, state.threshold)
        if errors and not self._holds(state, state.threshold):
            # Toward strong at once: the highest cut (at a disagreeing request's score) where the
            # bound holds, or where no observed disagreement is served by the cost tier any more.
            cuts = sorted(set(state.wrong[: errors]), reverse=True)
            target = cuts[-1]
            for cut in cuts:
                if self._loss(state, cut)[0] == 0 or self._holds(state, cut):
                    target = cut
                    break
            state.threshold = target
            state.tightened += 1
            state.since_move = 0
        elif state.since_move >= params.loosen_after and state.threshold < params.start:
            looser = min(params.start, state.threshold + params.step)
            if self._holds(state, looser):
                state.threshold = looser
                state.loosened += 1
                state.since_move = 0


def _copy(st: _State) -> _State:
    return _State(st.params, st.threshold, deque(st.window), since_move=st.since_move, observed=st.observed,
                  disagreed=st.disagreed, tightened=st.tightened, loosened=st.loosened, at=st.at)  # fmt: skip


def _record(key: _Key, st: _State) -> dict[str, Any]:
    """A state's folded part; the window as flat scores and a string of 0/1 (a list per judgement
    would be a thousand objects per state for the garbage collector to walk)."""
    (scope, region) = key
    return {"tenant": scope.tenant, "app": scope.app, "region": region, "params": st.params.as_dict(),
            "threshold": st.threshold, "scores": [s for s, _ in st.window],
            "disagree": "".join("1" if d else "0" for _, d in st.window), "since_move": st.since_move,
            "observed": st.observed, "disagreed": st.disagreed, "tightened": st.tightened, "loosened": st.loosened,
            "at": list(st.at)}  # fmt: skip
