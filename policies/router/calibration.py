"""Cost–quality curves of a router (PGR vs strong share, APGR, CPT) and thresholds picked from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

TargetMode = Literal["threshold", "max_strong_share", "min_gap_recovered", "min_strong_quality"]
TARGET_MODES: tuple[str, ...] = ("threshold", "max_strong_share", "min_gap_recovered", "min_strong_quality")


@dataclass(slots=True, frozen=True)
class GapCurve:
    """Quality of the weak/strong mix when every prompt scoring >= threshold goes to the strong model.

    Point 0 is "nothing to strong" (threshold +inf); the last point sends everything.
    `pgr` is the share of the weak→strong quality gap recovered; `quality` is the mix's accuracy.
    """

    threshold: np.ndarray
    share: np.ndarray
    quality: np.ndarray
    pgr: np.ndarray
    weak_quality: float
    strong_quality: float

    def apgr(self) -> float:
        """Area under PGR over strong share in [0, 1]; a random split scores 0.5."""
        return float(np.trapezoid(self.pgr, self.share))

    def cpt(self, recovered: float) -> float:
        """Smallest strong share that recovers `recovered` of the gap (ties broken at random)."""
        reached = np.flatnonzero(self.pgr >= recovered - 1e-12)
        if reached.size == 0:
            return float("nan")
        i = int(reached[0])
        if i == 0:
            return float(self.share[0])
        p0, p1 = self.pgr[i - 1], self.pgr[i]
        s0, s1 = self.share[i - 1], self.share[i]
        return float(s0 + (recovered - p0) / (p1 - p0) * (s1 - s0))

    def to_table(self, max_points: int = 401) -> dict[str, Any]:
        """A compact copy for the manifest: at most `max_points` points, ends kept."""
        n = len(self.share)
        idx = np.unique(np.linspace(0, n - 1, min(n, max_points)).round().astype(int))
        return {
            "threshold": [_finite(t) for t in self.threshold[idx]],
            "share": [round(float(v), 6) for v in self.share[idx]],
            "quality": [round(float(v), 6) for v in self.quality[idx]],
            "pgr": [round(float(v), 6) for v in self.pgr[idx]],
            "weak_quality": self.weak_quality,
            "strong_quality": self.strong_quality,
        }

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> GapCurve:
        return cls(
            threshold=np.asarray([np.inf if t is None else t for t in table["threshold"]], dtype=np.float64),
            share=np.asarray(table["share"], dtype=np.float64),
            quality=np.asarray(table["quality"], dtype=np.float64),
            pgr=np.asarray(table["pgr"], dtype=np.float64),
            weak_quality=float(table["weak_quality"]),
            strong_quality=float(table["strong_quality"]),
        )


@dataclass(slots=True, frozen=True)
class RankMap:
    """A family's raw log-odds -> the weighted share of its calibration prompts that score lower.

    Piecewise linear through weighted quantiles, clamped at both ends. A prompt mapped to r
    scores above a share r of its family's calibration prompts, so "score >= 1 - t" sends a share
    t of a family to the strong tier whatever the family's own score range and base rate.
    """

    logit: np.ndarray  # strictly increasing knots
    rank: np.ndarray  # non-decreasing, in [0, 1): 0 at the lowest calibration score

    def __post_init__(self) -> None:
        if self.logit.ndim != 1 or self.logit.shape != self.rank.shape or self.logit.size < 2:
            raise ValueError("a rank map needs two or more (logit, rank) knots of equal length")
        if not (np.diff(self.logit) > 0).all() or (np.diff(self.rank) < 0).any():
            raise ValueError("rank map knots must increase in logit and not decrease in rank")

    def __call__(self, z: float) -> float:
        return float(np.interp(z, self.logit, self.rank))

    def batch(self, z: np.ndarray) -> np.ndarray:
        return np.asarray(np.interp(z, self.logit, self.rank), dtype=np.float64)

    def to_table(self) -> dict[str, list[float]]:
        return {"logit": [float(v) for v in self.logit], "rank": [round(float(v), 6) for v in self.rank]}

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> RankMap:
        return cls(np.asarray(table["logit"], dtype=np.float64), np.asarray(table["rank"], dtype=np.float64))


def rank_map(raw: np.ndarray, weights: np.ndarray | None = None, points: int = 201) -> RankMap:
    """The RankMap of calibration scores `raw`: knots at `points` evenly spaced weighted quantiles.

    `weights` (default: all 1) say how much each calibration prompt counts, e.g. 1/rows of its
    subject so that every subject counts once.
    """
    raw = np.asarray(raw, dtype=np.float64)
    w = np.ones_like(raw) if weights is None else np.asarray(weights, dtype=np.float64)
    if raw.ndim != 1 or raw.size < 2 or w.shape != raw.shape or (w < 0).any() or w.sum() <= 0:
        raise ValueError("rank_map needs two or more scores with non-negative weights, not all zero")
    if not np.isfinite(raw).all():
        raise ValueError("rank_map needs finite scores")
    order = np.argsort(raw, kind="stable")
    values = raw[order]
    below = np.cumsum(w[order]) / w.sum()  # weighted share at or below each sorted score
    levels = np.linspace(0.0, 1.0, points)
    xs = np.unique(values[np.minimum(np.searchsorted(below, levels - 1e-12), values.size - 1)])
    if xs.size < 2:
        raise ValueError("rank_map needs at least two distinct scores")
    # Each knot's rank is the share scoring strictly lower: a block of ties is never counted
    # inside a share it would overrun, and no score reaches 1 (threshold 1 sends nothing).
    lower = np.concatenate([[0.0], below])[np.searchsorted(values, xs, side="left")]
    return RankMap(xs, np.minimum(lower, 1.0))


def _finite(value: float) -> float | None:
    return None if not np.isfinite(value) else float(value)


def gap_curve(
    scores: np.ndarray, weak_correct: np.ndarray, strong_correct: np.ndarray, weights: np.ndarray | None = None
) -> GapCurve:
    """The curve over every distinct score; prompts with equal scores move to strong together.

    `weak_correct` / `strong_correct` are per-prompt qualities (0/1 correctness, or a graded
    quality such as a judge's win probability). `weights` (default: all 1) weigh prompts in
    every share and mean, e.g. to give each data source an equal say in a pooled curve.
    """
    scores = np.asarray(scores, dtype=np.float64)
    weak = np.asarray(weak_correct, dtype=np.float64)
    strong = np.asarray(strong_correct, dtype=np.float64)
    if not (scores.shape == weak.shape == strong.shape) or scores.ndim != 1 or scores.size == 0:
        raise ValueError("scores, weak_correct and strong_correct must be equal-length, non-empty 1-d arrays")
    w = np.ones_like(scores) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != scores.shape or (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights must be non-negative, one per score, and not all zero")
    total = float(w.sum())
    weak_q, strong_q = float(w @ weak / total), float(w @ strong / total)
    if strong_q <= weak_q:
        raise ValueError(f"the strong model must beat the weak one (strong {strong_q:.3f} <= weak {weak_q:.3f})")
    order = np.argsort(-scores, kind="stable")
    gain = np.cumsum((w * (strong - weak))[order])
    mass = np.cumsum(w[order])
    sorted_scores = scores[order]
    # The last index of each run of equal scores: the threshold admits the whole run.
    ends = np.append(np.flatnonzero(np.diff(sorted_scores) != 0), scores.size - 1)
    share = np.concatenate([[0.0], mass[ends] / total])
    quality = np.concatenate([[weak_q], weak_q + gain[ends] / total])
    threshold = np.concatenate([[np.inf], sorted_scores[ends]])
    pgr = (quality - weak_q) / (strong_q - weak_q)
    return GapCurve(threshold, share, quality, pgr, weak_q, strong_q)


def threshold_for_target(curve: GapCurve, mode: TargetMode | str, value: float) -> float:
    """The score threshold that meets a cost or quality target on the curve's data.

    max_strong_share: the most prompts to strong that stays <= value;
    min_gap_recovered: the fewest prompts to strong with PGR >= value;
    min_strong_quality: the fewest prompts to strong with quality >= value x strong model quality.
    """
    if mode == "threshold":
        return float(value)
    if mode == "max_strong_share":
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"max_strong_share must be in [0, 1], got {value}")
        i = int(np.flatnonzero(curve.share <= value + 1e-12)[-1])
    elif mode == "min_gap_recovered":
        hits = np.flatnonzero(curve.pgr >= value - 1e-12)
        if hits.size == 0:
            raise ValueError(f"no threshold recovers {value:.0%} of the gap (best {curve.pgr.max():.0%})")
        i = int(hits[0])
    elif mode == "min_strong_quality":
        hits = np.flatnonzero(curve.quality >= value * curve.strong_quality - 1e-12)
        if hits.size == 0:
            raise ValueError(f"no threshold reaches {value:.0%} of the strong model's quality")
        i = int(hits[0])
    else:
        raise ValueError(f"unknown target mode {mode!r}; expected one of {', '.join(TARGET_MODES)}")
    return float(curve.threshold[i])


def random_apgr() -> float:
    """APGR of a router that splits at random: the diagonal's area."""
    return 0.5


def oracle_scores(weak_correct: np.ndarray, strong_correct: np.ndarray) -> np.ndarray:
    """Scores of a router that knows the answers: strong-only wins first, weak-only wins last."""
    weak = np.asarray(weak_correct, dtype=np.float64)
    strong = np.asarray(strong_correct, dtype=np.float64)
    return strong - weak


def expected_calibration_error(prob: np.ndarray, label: np.ndarray, bins: int = 10) -> float:
    """Mean |predicted - observed| over equal-width probability bins, weighted by bin size."""
    prob = np.asarray(prob, dtype=np.float64)
    label = np.asarray(label, dtype=np.float64)
    which = np.minimum((prob * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            total += mask.sum() * abs(prob[mask].mean() - label[mask].mean())
    return float(total / max(prob.size, 1))
