"""The online error bound: Wilson bound, tightening on errors, loosening with margin, per-entry thresholds, bounded state."""

from __future__ import annotations

import pytest

from policies.cache.error_bound import BoundParams, ErrorBounds, wilson_upper

PARAMS = BoundParams(max_error_rate=0.02, kind="probability", start=0.96, floor=0.5, loosen_after=20, entry_observations=5)


def test_wilson_upper_matches_known_values() -> None:
    assert wilson_upper(0, 0, 0.95) == 1.0
    # 0 errors in 135: the one-sided 95 % bound just under 0.02 (z^2 / (n + z^2))
    assert wilson_upper(0, 135, 0.95) == pytest.approx(1.645**2 / (135 + 1.645**2), rel=1e-3)
    assert wilson_upper(0, 135, 0.95) < 0.02 < wilson_upper(0, 120, 0.95)
    assert wilson_upper(5, 100, 0.95) > 0.05 > wilson_upper(5, 100, 0.5) - 0.01
    assert wilson_upper(5, 100, 0.99) > wilson_upper(5, 100, 0.95)


def test_new_scope_starts_at_the_shipped_threshold_and_does_not_loosen_without_evidence() -> None:
    bounds = ErrorBounds()
    assert bounds.threshold("t/a", PARAMS) == 0.96
    for i in range(100):  # right answers, but too few for the bound to hold at 0.02
        bounds.observe("t/a", PARAMS, i, 0.97, wrong=False)
    assert bounds.threshold("t/a", PARAMS) == 0.96
    assert bounds.threshold("t/other", PARAMS) == 0.96  # another scope learns nothing from this one


def test_loosens_slowly_once_the_bound_holds() -> None:
    bounds = ErrorBounds()
    for i in range(200):
        bounds.observe("t/a", PARAMS, i, 0.97, wrong=False)
    (stats,) = bounds.stats()
    assert stats.upper <= 0.02 and stats.error == 0.0
    # the bound held from about the 135th observation; one step per 20 observations since
    assert 1 <= stats.loosened <= 4
    assert PARAMS.floor < stats.threshold < 0.96


def test_errors_above_the_bound_tighten_past_their_scores() -> None:
    bounds = ErrorBounds()
    for i in range(300):
        bounds.observe("t/a", PARAMS, i, 0.9 + (i % 10) * 0.01, wrong=False)
    loose = bounds.threshold("t/a", PARAMS)
    for i in range(10):  # errors served at 0.965: 10 in 310 is over 0.02
        bounds.observe("t/a", PARAMS, 1000 + i, 0.965, wrong=True)
    tight = bounds.threshold("t/a", PARAMS)
    assert tight > 0.965 > loose
    (stats,) = bounds.stats()
    assert stats.tightened >= 1 and (stats.upper <= 0.02 or stats.error == 0.0)


def test_an_entry_gets_its_own_threshold_after_enough_observations() -> None:
    bounds = ErrorBounds()
    for _ in range(4):
        bounds.observe("t/a", PARAMS, 7, 0.99, wrong=False)
    bounds.observe("t/a", PARAMS, 7, 0.985, wrong=True)  # its fifth: now it has its own threshold
    assert bounds.threshold("t/a", PARAMS, 7) > 0.985
    assert not bounds.serves("t/a", PARAMS, 7, 0.985)
    for _ in range(5):
        bounds.observe("t/a", PARAMS, 8, 0.965, wrong=False)
    # never wrong: one step below the lowest score it was right at, looser than the scope's
    assert bounds.threshold("t/a", PARAMS, 8) < bounds.threshold("t/a", PARAMS) == bounds.threshold("t/a", PARAMS, 9)
    assert bounds.serves("t/a", PARAMS, 8, 0.957) and not bounds.serves("t/a", PARAMS, 9, 0.957)


def test_cosine_kind_moves_the_cosine_gate() -> None:
    params = BoundParams(max_error_rate=0.05, kind="cosine", start=0.82, floor=0.75, loosen_after=10)
    bounds = ErrorBounds()
    for i in range(200):
        bounds.observe("t/a", params, i, 0.85, wrong=False)
    assert 0.75 <= bounds.threshold("t/a", params) <= 0.82 - 0.005


def test_state_is_bounded_and_a_changed_policy_starts_again() -> None:
    bounds = ErrorBounds(window=50, max_scopes=3, max_entries=10)
    for s in range(5):
        for i in range(60):
            bounds.observe(f"t/{s}", PARAMS, s * 100 + i, 0.97, wrong=False)
    assert len(bounds) == 3 and len(bounds._entries) == 10
    assert max(st.counted for st in bounds.stats()) == 50
    stricter = BoundParams(max_error_rate=0.01, kind="probability", start=0.98, floor=0.5)
    assert bounds.threshold("t/4", stricter) == 0.98


def test_the_bound_is_on_metrics_per_tenant_and_app() -> None:
    from telemetry.attributes import LabelBounds
    from telemetry.prometheus import CACHE_BOUND_GAUGES, BoundCollector, PromMetrics

    bounds = ErrorBounds()
    for i in range(10):
        bounds.observe("acme/web", PARAMS, i, 0.97, wrong=i == 0)
    bounds.count_lookup("acme/web", PARAMS, hit=True, exact=False)
    bounds.count_lookup("acme/web", PARAMS, hit=False, exact=False)
    labels = LabelBounds(["acme"], ["web"], [])
    prom = PromMetrics()
    prom.registry.register(BoundCollector(CACHE_BOUND_GAUGES, bounds.stats, labels.tenant, labels.app))
    text = prom.render().decode()
    assert 'tierlane_cache_hit_rate{app="web",tenant="acme"} 0.5' in text
    assert 'tierlane_cache_judged_hits{app="web",tenant="acme"} 10.0' in text
    assert 'tierlane_cache_max_error_rate{app="web",tenant="acme"} 0.02' in text
    assert "tierlane_cache_served_error_upper{" in text and "tierlane_cache_serve_threshold{" in text


def test_the_dashboard_shows_the_bound_of_the_tenant_asked_for() -> None:
    from gateway.routes.dashboard import cache_bound

    bounds = ErrorBounds()
    bounds.observe("acme/web", PARAMS, 1, 0.97, wrong=False)
    bounds.observe("globex/web", PARAMS, 2, 0.97, wrong=True)
    assert [r["tenant"] for r in cache_bound(bounds.stats(), None)] == ["acme", "globex"]
    (row,) = cache_bound(bounds.stats(), "globex")
    assert (row["app"], row["judged"], row["judged_wrong"], row["served_error"]) == ("web", 1, 1, None)
    assert row["upper_bound"] == 1.0 and bounds.threshold("globex/web", PARAMS) > 0.97  # tightened past its only error


def test_judged_candidates_below_the_threshold_decide_whether_it_loosens() -> None:
    bounds = ErrorBounds()
    for i in range(300):  # served and right at 0.97; refused candidates at 0.955 judged wrong one time in ten
        bounds.observe("t/a", PARAMS, i, 0.97, wrong=False)
        bounds.observe("t/a", PARAMS, 1000 + i, 0.955, wrong=i % 10 == 0)
    assert bounds.threshold("t/a", PARAMS) > 0.955  # the step down to 0.95 would serve them: not taken
    shut = ErrorBounds()
    shut.observe("t/b", PARAMS, 1, 0.999, wrong=True)
    assert shut.threshold("t/b", PARAMS) > 0.999  # nothing is served any more...
    for i in range(400):  # ...but refused candidates judged right bring it down again
        shut.observe("t/b", PARAMS, 100 + i, 0.98, wrong=False)
    assert shut.threshold("t/b", PARAMS) < 0.999
