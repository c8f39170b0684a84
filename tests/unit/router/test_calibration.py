"""APGR, CPT and target thresholds on small arrays whose answers are known by hand."""

from __future__ import annotations

import numpy as np
import pytest

from policies.router.calibration import (
    GapCurve,
    expected_calibration_error,
    gap_curve,
    oracle_scores,
    threshold_for_target,
)

# Weak right on half, strong right on all: the gap is 0.5 and the last two rows are the wins.
WEAK = np.array([1, 1, 0, 0])
STRONG = np.array([1, 1, 1, 1])


def test_perfect_ranking_has_known_area() -> None:
    curve = gap_curve(np.array([0.1, 0.2, 0.8, 0.9]), WEAK, STRONG)
    assert curve.share.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert curve.pgr.tolist() == [0.0, 0.5, 1.0, 1.0, 1.0]
    # Trapezoids: .25*(0+.5)/2 + .25*(.5+1)/2 + .25 + .25
    assert curve.apgr() == pytest.approx(0.75)
    assert curve.cpt(0.5) == pytest.approx(0.25)
    assert curve.cpt(0.8) == pytest.approx(0.25 + 0.3 / 0.5 * 0.25)


def test_reversed_ranking_has_known_area() -> None:
    curve = gap_curve(np.array([0.9, 0.8, 0.2, 0.1]), WEAK, STRONG)
    assert curve.pgr.tolist() == [0.0, 0.0, 0.0, 0.5, 1.0]
    assert curve.apgr() == pytest.approx(0.25)
    assert curve.cpt(0.5) == pytest.approx(0.75)


@pytest.mark.parametrize("x", [0.1, 0.5, 0.8, 1.0])
def test_constant_scores_are_a_random_split(x: float) -> None:
    rng = np.random.default_rng(0)
    weak = rng.integers(0, 2, 200)
    strong = np.maximum(weak, rng.integers(0, 2, 200))
    curve = gap_curve(np.full(200, 0.3), weak, strong)
    assert len(curve.share) == 2  # ties move together: nothing, then everything
    assert curve.apgr() == pytest.approx(0.5)
    assert curve.cpt(x) == pytest.approx(x)


def test_oracle_puts_wins_first_and_losses_last() -> None:
    weak = np.array([1, 0, 0, 1, 1])
    strong = np.array([0, 1, 1, 1, 1])  # gap = (4 - 3) / 5 = 0.2
    curve = gap_curve(oracle_scores(weak, strong), weak, strong)
    # Two wins (+0.2 each) recover 200% of the gap at 40% share; the one loss comes last.
    assert curve.pgr.max() == pytest.approx(2.0)
    assert curve.cpt(1.0) == pytest.approx(0.2)


def test_target_thresholds() -> None:
    scores = np.array([0.1, 0.2, 0.8, 0.9])
    curve = gap_curve(scores, WEAK, STRONG)
    assert threshold_for_target(curve, "max_strong_share", 0.5) == pytest.approx(0.8)
    assert threshold_for_target(curve, "max_strong_share", 0.6) == pytest.approx(0.8)
    assert threshold_for_target(curve, "max_strong_share", 0.0) == np.inf
    assert threshold_for_target(curve, "min_gap_recovered", 0.5) == pytest.approx(0.9)
    assert threshold_for_target(curve, "min_gap_recovered", 0.9) == pytest.approx(0.8)
    # strong quality 1.0; weak 0.5; 0.75 of strong quality needs one win.
    assert threshold_for_target(curve, "min_strong_quality", 0.75) == pytest.approx(0.9)
    assert threshold_for_target(curve, "threshold", 0.42) == 0.42
    with pytest.raises(ValueError, match="unknown target mode"):
        threshold_for_target(curve, "cheapest", 0.5)
    with pytest.raises(ValueError, match="max_strong_share"):
        threshold_for_target(curve, "max_strong_share", 1.5)


def test_table_round_trip_keeps_the_curve() -> None:
    rng = np.random.default_rng(1)
    weak = rng.integers(0, 2, 1000)
    strong = np.maximum(weak, rng.integers(0, 2, 1000))
    curve = gap_curve(rng.random(1000), weak, strong)
    back = GapCurve.from_table(curve.to_table(max_points=2000))
    assert back.apgr() == pytest.approx(curve.apgr(), abs=1e-5)
    assert back.threshold[0] == np.inf


def test_strong_not_better_is_rejected() -> None:
    with pytest.raises(ValueError, match="strong model must beat"):
        gap_curve(np.array([0.1, 0.2]), np.array([1, 0]), np.array([0, 1]))
    with pytest.raises(ValueError, match="equal-length"):
        gap_curve(np.array([0.1]), np.array([1, 0]), np.array([0, 1]))


def test_expected_calibration_error() -> None:
    # Bin 0.2: predicted 0.2, observed 1/5; bin 0.8: predicted 0.8, observed 4/5 -> 0.
    prob = np.array([0.2] * 5 + [0.8] * 5)
    label = np.array([1, 0, 0, 0, 0, 1, 1, 1, 1, 0])
    assert expected_calibration_error(prob, label) == pytest.approx(0.0)
    assert expected_calibration_error(np.full(4, 0.9), np.zeros(4)) == pytest.approx(0.9)
