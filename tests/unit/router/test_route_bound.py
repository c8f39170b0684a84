"""The routing quality bound: its update rule, its snapshots, its logs (a restart; two replicas), the regions."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import numpy as np
import pytest

from policies.cache.error_bound import wilson_upper
from policies.route_bound import QualityBound, RouteBounds
from policies.route_bound_log import LOG_FILE, LocalBoundLog, SharedBoundLog
from policies.router.regions import Regions
from tests.support.valkey import ValkeyServer

BOUND = QualityBound(max_quality_loss=0.05, start=0.6, sample_rate=1.0, loosen_after=20, step=0.05)


def test_a_region_without_judgements_routes_at_the_routers_threshold() -> None:
    bounds = RouteBounds()
    assert bounds.threshold("t/a", 3, BOUND) == 0.6
    assert len(bounds) == 0  # asking makes no state: only judgements do


def test_a_disagreement_below_the_threshold_moves_it_to_the_strong_tier_at_once() -> None:
    bounds = RouteBounds()
    for i in range(30):  # agreements spread below and above the threshold
        bounds.observe("t/a", 0, BOUND, 0.1 + i * 0.02, disagree=False)
    bounds.observe("t/a", 0, BOUND, 0.45, disagree=True)
    # one disagreement in 31: the upper bound is far above 0.05, and below 0.45 none is left
    assert bounds.threshold("t/a", 0, BOUND) == pytest.approx(0.45)
    (stats,) = bounds.stats()
    assert stats.tightened == 1 and stats.disagreed == 1 and stats.loss == 0.0
    # another region and another scope are untouched
    assert bounds.threshold("t/a", 1, BOUND) == 0.6
    assert bounds.threshold("t/b", 0, BOUND) == 0.6


def test_it_moves_only_as_far_as_the_bound_needs() -> None:
    """Disagreements at a high score and a few at a low one: the cut stops above the low ones, where the bound holds."""
    bounds = RouteBounds()
    params = QualityBound(max_quality_loss=0.05, start=0.9, loosen_after=10_000)
    rng = random.Random(1)
    for _ in range(500):
        bounds.observe("s", 0, params, rng.uniform(0.0, 1.0), disagree=False)
    for _ in range(10):
        bounds.observe("s", 0, params, 0.1, disagree=True)
    assert bounds.threshold("s", 0, params) == 0.9  # 10 in 510 (upper bound 0.033): it holds, nothing moves
    for _ in range(40):
        bounds.observe("s", 0, params, 0.8, disagree=True)
    # 50 in 550 at 0.9 break it; at 0.8 the 10 low ones are left (upper bound 0.032): the cut goes no lower
    assert bounds.threshold("s", 0, params) == pytest.approx(0.8)
    (stats,) = bounds.stats()
    assert stats.upper <= 0.05 < wilson_upper(50, 550, 0.95)
    assert stats.loss == pytest.approx(10 / 550)


def test_it_steps_back_toward_the_routers_threshold_when_the_bound_holds_and_never_past_it() -> None:
    bounds = RouteBounds()
    bounds.observe("s", 0, BOUND, 0.3, disagree=True)
    assert bounds.threshold("s", 0, BOUND) == pytest.approx(0.3)
    for i in range(200):  # agreements only, all above the disagreement's score
        bounds.observe("s", 0, BOUND, 0.35 + (i % 10) * 0.05, disagree=False)
    (stats,) = bounds.stats()
    assert stats.loosened >= 1
    assert stats.upper <= BOUND.max_quality_loss
    assert bounds.threshold("s", 0, BOUND) <= BOUND.start
    for _ in range(400):
        bounds.observe("s", 0, BOUND, 0.99, disagree=False)
    assert bounds.threshold("s", 0, BOUND) == pytest.approx(BOUND.start)  # back home, not beyond


def test_no_step_back_while_the_looser_threshold_would_break_the_bound() -> None:
    bounds = RouteBounds()
    for _ in range(5):
        bounds.observe("s", 0, BOUND, 0.5, disagree=True)
    assert bounds.threshold("s", 0, BOUND) == pytest.approx(0.5)
    for _ in range(100):
        bounds.observe("s", 0, BOUND, 0.1, disagree=False)  # agreements below: the cut at 0.5 still serves 5 errors above
    assert bounds.threshold("s", 0, BOUND) == pytest.approx(0.5)
    assert bounds.stats()[0].loosened == 0


def test_a_changed_policy_starts_the_region_again() -> None:
    bounds = RouteBounds()
    bounds.observe("s", 0, BOUND, 0.2, disagree=True)
    other = QualityBound(max_quality_loss=0.1, start=0.6, sample_rate=1.0, loosen_after=20, step=0.05)
    assert bounds.threshold("s", 0, other) == 0.6
    bounds.observe("s", 0, other, 0.9, disagree=False)
    assert bounds.stats()[0].observed == 1


def test_state_is_bounded() -> None:
    bounds = RouteBounds(window=10, max_states=5)
    for region in range(20):
        for i in range(30):
            bounds.observe("s", region, BOUND, i / 30, disagree=False)
    assert len(bounds) == 5
    assert all(st.counted == 10 for st in bounds.stats())


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="max_quality_loss"):
        QualityBound(max_quality_loss=0.0, start=0.5)
    with pytest.raises(ValueError, match="sample_rate"):
        QualityBound(max_quality_loss=0.03, start=0.5, sample_rate=2.0)


def _judgements(n: int, seed: int) -> list[tuple[str, int, float, bool]]:
    rng = random.Random(seed)
    return [("t/a", rng.randrange(3), rng.random(), rng.random() < 0.08) for _ in range(n)]


def _fold(events: list[tuple[str, int, float, bool]]) -> RouteBounds:
    bounds = RouteBounds()
    for scope, region, score, d in events:
        bounds.observe(scope, region, BOUND, score, disagree=d)
    return bounds


def _thresholds(bounds: RouteBounds) -> dict[tuple[str, int], float]:
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
        fh.write('{"s":"t/a","r":1,"p":')
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
        await c.record("t/a", 0, BOUND, x, disagree=True)
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
    bounds.observe("s", 0, old, 0.2, disagree=True)
    assert bounds.threshold("s", 0, old) == pytest.approx(0.2)
    refit = replace(BOUND, regions="bbbb")
    assert bounds.threshold("s", 0, refit) == BOUND.start
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
        bounds.observe("s", 0, BOUND, rng.random(), disagree=rng.random() < 0.3)
    state = bounds._states[("s", 0)]
    for cut in (0.0, 0.1, 0.37, 0.5, 0.99, 1.5):
        assert bounds._loss(state, cut) == (sum(1 for x, d in state.window if d and x < cut), 50)
