"""The routing quality bound: its update rule, its snapshots, its logs (a restart; two replicas), the regions."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policies.cache.error_bound import wilson_upper
from policies.router import route_bound_log
from policies.router.regions import Regions
from policies.router.route_bound import QualityBound, RouteBounds, Scope
from policies.router.route_bound_log import (
    LOG_FILE,
    SNAPSHOT_CHUNK,
    SNAPSHOT_FILE,
    STATES_DIR,
    LocalBoundLog,
    SharedBoundLog,
    _state_file,
)
from tests.support.valkey import ValkeyServer

TA, TB, S = Scope("t", "a"), Scope("t", "b"), Scope("s", "")
BOUND = QualityBound(max_quality_loss=0.05, start=0.6, sample_rate=1.0, loosen_after=20, step=0.05)


def test_a_region_without_judgements_routes_at_the_routers_threshold() -> None:
    bounds = RouteBounds()
    assert bounds.threshold(TA, 3, BOUND) == 0.6
    assert len(bounds) == 0  # asking makes no state: only judgements do


def test_a_disagreement_below_the_threshold_moves_it_to_the_strong_tier_at_once() -> None:
    bounds = RouteBounds()
    for i in range(30):  # agreements spread below and above the threshold
        bounds.observe(TA, 0, BOUND, 0.1 + i * 0.02, disagree=False)
    bounds.observe(TA, 0, BOUND, 0.45, disagree=True)
    # one disagreement in 31: the upper bound is far above 0.05, and below 0.45 none is left
    assert bounds.threshold(TA, 0, BOUND) == pytest.approx(0.45)
    (stats,) = bounds.stats()
    assert stats.tightened == 1 and stats.disagreed == 1 and stats.loss == 0.0
    # another region and another scope are untouched
    assert bounds.threshold(TA, 1, BOUND) == 0.6
    assert bounds.threshold(TB, 0, BOUND) == 0.6


def test_it_moves_only_as_far_as_the_bound_needs() -> None:
    """Disagreements at a high score and a few at a low one: the cut stops above the low ones, where the bound holds."""
    bounds = RouteBounds()
    params = QualityBound(max_quality_loss=0.05, start=0.9, loosen_after=10_000)
    rng = random.Random(1)
    for _ in range(500):
        bounds.observe(S, 0, params, rng.uniform(0.0, 1.0), disagree=False)
    for _ in range(10):
        bounds.observe(S, 0, params, 0.1, disagree=True)
    assert bounds.threshold(S, 0, params) == 0.9  # 10 in 510 (upper bound 0.033): it holds, nothing moves
    for _ in range(40):
        bounds.observe(S, 0, params, 0.8, disagree=True)
    # 50 in 550 at 0.9 break it; at 0.8 the 10 low ones are left (upper bound 0.032): the cut goes no lower
    assert bounds.threshold(S, 0, params) == pytest.approx(0.8)
    (stats,) = bounds.stats()
    assert stats.upper <= 0.05 < wilson_upper(50, 550, 0.95)
    assert stats.loss == pytest.approx(10 / 550)


def test_it_steps_back_toward_the_routers_threshold_when_the_bound_holds_and_never_past_it() -> None:
    bounds = RouteBounds()
    bounds.observe(S, 0, BOUND, 0.3, disagree=True)
    assert bounds.threshold(S, 0, BOUND) == pytest.approx(0.3)
    for i in range(200):  # agreements only, all above the disagreement's score
        bounds.observe(S, 0, BOUND, 0.35 + (i % 10) * 0.05, disagree=False)
    (stats,) = bounds.stats()
    assert stats.loosened >= 1
    assert stats.upper <= BOUND.max_quality_loss
    assert bounds.threshold(S, 0, BOUND) <= BOUND.start
    for _ in range(400):
        bounds.observe(S, 0, BOUND, 0.99, disagree=False)
    assert bounds.threshold(S, 0, BOUND) == pytest.approx(BOUND.start)  # back home, not beyond


def test_no_step_back_while_the_looser_threshold_would_break_the_bound() -> None:
    bounds = RouteBounds()
    for _ in range(5):
        bounds.observe(S, 0, BOUND, 0.5, disagree=True)
    assert bounds.threshold(S, 0, BOUND) == pytest.approx(0.5)
    for _ in range(100):
        bounds.observe(S, 0, BOUND, 0.1, disagree=False)  # agreements below: the cut at 0.5 still serves 5 errors above
    assert bounds.threshold(S, 0, BOUND) == pytest.approx(0.5)
    assert bounds.stats()[0].loosened == 0


def test_a_changed_policy_starts_the_region_again() -> None:
    bounds = RouteBounds()
    bounds.observe(S, 0, BOUND, 0.2, disagree=True)
    other = QualityBound(max_quality_loss=0.1, start=0.6, sample_rate=1.0, loosen_after=20, step=0.05)
    assert bounds.threshold(S, 0, other) == 0.6
    bounds.observe(S, 0, other, 0.9, disagree=False)
    assert bounds.stats()[0].observed == 1


def test_state_is_bounded() -> None:
    bounds = RouteBounds(window=10, max_states=5)
    for region in range(20):
        for i in range(30):
            bounds.observe(S, region, BOUND, i / 30, disagree=False)
    assert len(bounds) == 5
    assert all(st.counted == 10 for st in bounds.stats())


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="max_quality_loss"):
        QualityBound(max_quality_loss=0.0, start=0.5)
    with pytest.raises(ValueError, match="sample_rate"):
        QualityBound(max_quality_loss=0.03, start=0.5, sample_rate=2.0)


def _judgements(n: int, seed: int) -> list[tuple[Scope, int, float, bool]]:
    rng = random.Random(seed)
    return [(TA, rng.randrange(3), rng.random(), rng.random() < 0.08) for _ in range(n)]


def _fold(events: list[tuple[Scope, int, float, bool]]) -> RouteBounds:
    bounds = RouteBounds()
    for scope, region, score, d in events:
        bounds.observe(scope, region, BOUND, score, disagree=d)
    return bounds


def _thresholds(bounds: RouteBounds) -> dict[tuple[Scope, int], float]:
    return {(st.scope, st.region): st.threshold for st in bounds.stats()}


def test_a_snapshot_restores_the_same_fold() -> None:
    events = _judgements(500, 3)
    whole = _fold(events)
    first = _fold(events[:300])
    restored = RouteBounds()
    restored.restore(json.loads(json.dumps(first.snapshot())))
    for scope, region, score, d in events[300:]:
        restored.observe(scope, region, BOUND, score, disagree=d)
    assert _thresholds(restored) == _thresholds(whole)
    assert any(t < BOUND.start for t in _thresholds(whole).values())  # the fold did move


async def test_the_local_log_keeps_the_bound_across_a_restart(tmp_path: Path) -> None:
    events = _judgements(700, 4)
    first = LocalBoundLog(tmp_path, compact_every=250)  # compacts twice, then keeps 200 lines
    await first.start()
    for scope, region, score, d in events:
        await first.record(scope, region, BOUND, score, disagree=d)
    before = _thresholds(first.bounds)
    assert before == _thresholds(_fold(events))
    # a crash: no close, and half a line at the end of the log
    with (tmp_path / LOG_FILE).open("a") as fh:
        fh.write('{"t":"t","a":"a","r":1,"p":')
    again = LocalBoundLog(tmp_path)
    await again.start()
    assert again.restored == 200
    assert _thresholds(again.bounds) == before
    await again.close()
    third = LocalBoundLog(tmp_path)
    await third.start()
    assert third.restored == 0 and _thresholds(third.bounds) == before  # all in the snapshot written at close
    await third.close()
    await first.close()


async def _until(predicate: object, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


async def test_two_replicas_hold_one_bound_and_a_third_started_later_joins_it(valkey: ValkeyServer) -> None:
    def replica() -> SharedBoundLog:
        return SharedBoundLog.connect(valkey.url, key_prefix="t:", connect_timeout_s=1.0, op_timeout_s=1.0,
                                      stream_max_len=100_000)  # fmt: skip

    a, b = replica(), replica()
    b._snapshot_every = 100
    await a.start()
    await b.start()
    assert await a.caught_up(10) and await b.caught_up(10)
    events = _judgements(400, 5)
    # the two replicas judge alternate requests, concurrently
    await asyncio.gather(*[(a if i % 2 else b).record(s, r, BOUND, x, disagree=d) for i, (s, r, x, d) in enumerate(events)])
    await _until(lambda: a.applied == 400 and b.applied == 400)
    assert _thresholds(a.bounds) == _thresholds(b.bounds)
    assert any(t < BOUND.start for t in _thresholds(a.bounds).values())
    # a replica that starts now (or restarts) takes b's snapshot and the stream after it
    c = replica()
    await c.start()
    assert await c.caught_up(10)
    assert _thresholds(c.bounds) == _thresholds(a.bounds)
    assert c.applied < 400  # not the whole stream: the snapshot held the rest
    for x in (0.01, 0.02):
        await c.record(TA, 0, BOUND, x, disagree=True)
    await _until(lambda: a.applied == 402 and b.applied == 402)
    await _until(lambda: _thresholds(c.bounds) == _thresholds(a.bounds) == _thresholds(b.bounds))
    for log in (a, b, c):
        await log.close()


def test_regions_are_the_shipped_centroids_and_place_prompts_alike() -> None:
    regions = Regions.load()
    assert len(regions) == len(regions.labels) >= 4
    norms = np.linalg.norm(regions.centroids, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-4)
    # a centroid is in its own region; a vector of another size is refused
    for k in range(len(regions)):
        assert regions.of(regions.centroids[k]) == k
    with pytest.raises(ValueError, match="dimensions"):
        regions.of(np.ones(10, dtype=np.float32))


def test_judgements_made_under_other_regions_do_not_carry_over() -> None:
    from dataclasses import replace

    bounds = RouteBounds()
    old = replace(BOUND, regions="aaaa")
    bounds.observe(S, 0, old, 0.2, disagree=True)
    assert bounds.threshold(S, 0, old) == pytest.approx(0.2)
    refit = replace(BOUND, regions="bbbb")
    assert bounds.threshold(S, 0, refit) == BOUND.start
    assert Regions.load().digest != "" and len(Regions.load().digest) == 16


async def test_judgements_recorded_while_the_log_compacts_are_all_kept(tmp_path: Path) -> None:
    events = _judgements(600, 6)
    log = LocalBoundLog(tmp_path, compact_every=50)
    await log.start()
    await asyncio.gather(*[log.record(s, r, BOUND, x, disagree=d) for s, r, x, d in events])
    expected = _thresholds(log.bounds)
    assert sum(st.observed for st in log.bounds.stats()) == 600
    again = LocalBoundLog(tmp_path)  # no close: the snapshot and the log's lines after it
    await again.start()
    assert _thresholds(again.bounds) == expected
    assert sum(st.observed for st in again.bounds.stats()) == 600
    await again.close()
    await log.close()


def test_the_loss_at_a_cut_is_the_count_a_pass_over_the_window_gives() -> None:
    bounds = RouteBounds(window=50)
    rng = random.Random(8)
    for _ in range(400):
        bounds.observe(S, 0, BOUND, rng.random(), disagree=rng.random() < 0.3)
    state = bounds._states[(S, 0)]
    for cut in (0.0, 0.1, 0.37, 0.5, 0.99, 1.5):
        assert bounds._loss(state, cut) == (sum(1 for x, d in state.window if d and x < cut), 50)


# Scopes: a tenant and an app, kept apart.


async def test_tenant_and_app_are_kept_apart_in_the_bound_and_its_log(tmp_path: Path) -> None:
    """Tenant `a/b` app `c` and tenant `a` app `b/c` once shared the state of the string `a/b/c`."""
    one, other = Scope("a/b", "c"), Scope("a", "b/c")
    log = LocalBoundLog(tmp_path, compact_every=15)
    await log.start()
    for i in range(20):
        await log.record(one, 0, BOUND, 0.1 + i * 0.02, disagree=False)
    await log.record(one, 0, BOUND, 0.45, disagree=True)
    assert log.bounds.threshold(one, 0, BOUND) == pytest.approx(0.45)
    assert log.bounds.threshold(other, 0, BOUND) == BOUND.start
    await log.record(other, 0, BOUND, 0.9, disagree=False)
    before = {(st.scope, st.region): (st.threshold, st.observed) for st in log.bounds.stats()}
    assert before == {(one, 0): (pytest.approx(0.45), 21), (other, 0): (BOUND.start, 1)}
    again = LocalBoundLog(tmp_path)  # no close: the state files and the log's lines after them
    await again.start()
    assert {(st.scope, st.region): (st.threshold, st.observed) for st in again.bounds.stats()} == before
    await again.close()
    await log.close()


# Snapshots: O(changed), a few states at a time, never holding up the event loop.


def _old_format(events: list[tuple[Scope, int, float, bool]], window: int = 1000) -> dict[str, Any]:
    """What the previous code wrote: one snapshot of every state (scopes `tenant/app`), log lines without numbers."""
    bounds = RouteBounds(window=window)
    for scope, region, score, d in events:
        bounds.observe(scope, region, BOUND, score, disagree=d)
    states = [{"scope": f"{scope.tenant}/{scope.app}", "region": region, "params": st.params.as_dict(),
               "threshold": st.threshold, "window": [[s, int(d)] for s, d in st.window], "since_move": st.since_move,
               "observed": st.observed, "disagreed": st.disagreed, "tightened": st.tightened, "loosened": st.loosened}
              for (scope, region), st in bounds._states.items()]  # fmt: skip
    return {"window": window, "states": states}


def _old_lines(events: list[tuple[Scope, int, float, bool]]) -> list[str]:
    return [json.dumps({"s": f"{s.tenant}/{s.app}", "r": r, "p": BOUND.as_dict(), "x": x, "d": int(d)}) for s, r, x, d in events]


async def test_an_older_snapshot_and_log_are_read_then_rewritten_per_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = _judgements(700, 9)
    snapshot = _old_format(events[:500])
    (tmp_path / SNAPSHOT_FILE).write_text(json.dumps(snapshot))
    (tmp_path / LOG_FILE).write_text("\n".join(_old_lines(events[500:])) + "\n")
    log = LocalBoundLog(tmp_path)
    await log.start()
    expected = _thresholds(_fold(events))
    assert log.restored == 200 and _thresholds(log.bounds) == expected
    monkeypatch.setattr(route_bound_log, "SNAPSHOT_CHUNK", 1)
    assert await asyncio.to_thread(log._write_some)  # one state's file, then a crash: the older file still holds the rest
    mid = LocalBoundLog(tmp_path)
    await mid.start()
    assert _thresholds(mid.bounds) == expected and sum(st.observed for st in mid.bounds.stats()) == 700
    await mid.close()
    await log.close()
    assert not (tmp_path / SNAPSHOT_FILE).exists() and len(list((tmp_path / STATES_DIR).glob("*.json"))) == 3
    again = LocalBoundLog(tmp_path)
    await again.start()
    assert again.restored == 0 and _thresholds(again.bounds) == expected
    await again.close()


async def test_a_crash_between_the_state_files_and_the_logs_truncation_counts_nothing_twice(tmp_path: Path) -> None:
    events = _judgements(400, 10)
    log = LocalBoundLog(tmp_path, compact_every=10**9)
    await log.start()
    for s, r, x, d in events:
        await log.record(s, r, BOUND, x, disagree=d)
    while await asyncio.to_thread(log._write_some):  # the state files of a compaction, then a crash: the log stays
        pass
    again = LocalBoundLog(tmp_path)
    await again.start()
    assert again.restored == 0  # every line is already in a state file
    assert _thresholds(again.bounds) == _thresholds(_fold(events))
    assert sum(st.observed for st in again.bounds.stats()) == 400
    await again.close()
    await log.close()


async def test_a_compaction_writes_only_the_states_changed_since_the_last(tmp_path: Path) -> None:
    log = LocalBoundLog(tmp_path, compact_every=10**9)
    await log.start()
    for region in range(40):
        await log.record(TA, region, BOUND, 0.5, disagree=False)
    await log.close()
    log = LocalBoundLog(tmp_path, compact_every=3)
    await log.start()
    files = sorted((tmp_path / STATES_DIR).glob("*.json"))
    stamps = {p: p.stat().st_mtime_ns for p in files}
    await log.record(TA, 7, BOUND, 0.1, disagree=False)
    await log.record(TA, 7, BOUND, 0.2, disagree=False)
    assert log.bounds.changes_pending() == 1  # one state changed (restored ones are not)
    await log.record(TA, 7, BOUND, 0.3, disagree=False)  # the third line compacts
    assert log.bounds.changes_pending() == 0
    assert [p.name for p in files if p.stat().st_mtime_ns != stamps[p]] == [_state_file(TA, 7)]
    assert (tmp_path / LOG_FILE).read_text() == ""
    await log.close()


def _loaded(n_states: int, window: int) -> RouteBounds:
    """`n_states` full states, every one changed since the last snapshot (through the older format's restore)."""
    rng = random.Random(11)
    bounds = RouteBounds(window=window, max_states=n_states)
    bounds.restore({"window": window, "states": [
        {"scope": f"t{i}/a", "region": 0, "params": BOUND.as_dict(), "threshold": 0.6,
         "window": [[rng.random(), int(rng.random() < 0.02)] for _ in range(window)], "since_move": 0,
         "observed": window, "disagreed": 0, "tightened": 0, "loosened": 0} for i in range(n_states)]}, changed=True)  # fmt: skip
    gc.collect()
    return bounds


async def _worst_loop_gap(work: Callable[[], Awaitable[Any]], bounds: RouteBounds, probe: Scope) -> float:
    """The longest gap between two ticks of a task on the loop asking a threshold every ms (the route stage's part)."""
    done = asyncio.Event()
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            bounds.threshold(probe, 0, BOUND)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    worst = 0.0
    await work()
    done.set()
    await ticker
    return worst


class _NoStore:
    def __init__(self) -> None:
        self.calls = 0

    async def call(self, *args: Any) -> None:
        self.calls += 1


@pytest.mark.parametrize("kind", ["local compaction", "shared snapshot"])
async def test_a_snapshot_of_many_states_never_holds_up_the_event_loop(tmp_path: Path, kind: str) -> None:
    """The previous snapshot (every state built under the lock the route stage takes, serialised in one
    call on a worker thread, which holds the interpreter) stalled the loop ~1 s at 1,200 states."""
    n_states, window, probe = 500, 1000, Scope("t0", "a")
    old = _loaded(n_states, window)

    async def the_old_way() -> None:
        def build() -> str:
            with old._lock:
                states = [{"scope": str(scope), "region": region, "params": st.params.as_dict(),
                           "window": [[s, int(d)] for s, d in st.window]} for (scope, region), st in old._states.items()]  # fmt: skip
            return json.dumps({"states": states})

        (tmp_path / "old.json").write_text(await asyncio.to_thread(build))

    before = await _worst_loop_gap(the_old_way, old, probe)
    old = RouteBounds()
    bounds = _loaded(n_states, window)
    if kind == "local compaction":
        log: Any = LocalBoundLog(tmp_path / "log", bounds)
        await log.start()
        log.bounds = bounds
        after = await _worst_loop_gap(log.close, bounds, probe)
        assert len(list((tmp_path / "log" / STATES_DIR).glob("*.json"))) == n_states
    else:
        store = _NoStore()
        log = SharedBoundLog(store, None, bounds=bounds)
        after = await _worst_loop_gap(log._offer_snapshot, bounds, probe)
        assert store.calls > n_states // SNAPSHOT_CHUNK
    assert bounds.changes_pending() == 0
    assert after < 0.25, f"the loop waited {after * 1000:.0f} ms (the previous way: {before * 1000:.0f} ms)"
    assert after * 4 < before, f"{after * 1000:.0f} ms, the previous way {before * 1000:.0f} ms"


async def test_the_shared_logs_older_snapshot_and_events_are_read_then_rewritten_per_state(valkey: ValkeyServer) -> None:
    from policies.shared_state.redis_client import redis_client

    events = _judgements(300, 12)
    raw = redis_client(valkey.url, connect_timeout_s=1.0, read_timeout_s=2.0)
    try:  # what the previous code left: events without structured scopes, a snapshot of the first 200 in one field
        ids = [await raw.xadd("o:route:obs", {"e": line}) for line in _old_lines(events)]
        await raw.hset("o:route:snapshot", mapping={"id": ids[199], "state": json.dumps(_old_format(events[:200]))})

        def replica() -> SharedBoundLog:
            return SharedBoundLog.connect(valkey.url, key_prefix="o:", connect_timeout_s=1.0, op_timeout_s=1.0,
                                          stream_max_len=100_000)  # fmt: skip

        first = replica()
        await first.start()
        assert await first.caught_up(10)
        expected = _thresholds(_fold(events))
        assert first.applied == 100 and _thresholds(first.bounds) == expected
        await first.close()  # offers its snapshot: every state, in the new format
        assert await raw.hget("o:route:snapshot", "state") is None
        assert await raw.hlen("o:route:states") == 3
        again = replica()
        await again.start()
        assert await again.caught_up(10)
        assert again.applied == 0 and _thresholds(again.bounds) == expected
        assert sum(st.observed for st in again.bounds.stats()) == 300
        await again.close()
    finally:
        await raw.aclose()
