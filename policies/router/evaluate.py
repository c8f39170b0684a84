"""Held-out figures of a router (AUC, APGR, CPT against random and oracle) and the quality-vs-share plot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from sklearn.metrics import brier_score_loss, roc_auc_score

from policies.router.calibration import (
    GapCurve,
    expected_calibration_error,
    gap_curve,
    oracle_scores,
    random_apgr,
    threshold_for_target,
)

if TYPE_CHECKING:
    from policies.router.data import AlpacaData, MMLUData
    from policies.router.model import Router


class Labelled(Protocol):
    """A routing data set: per-prompt weak and strong quality, the strong-needed label, and groups."""

    @property
    def weak(self) -> np.ndarray: ...
    @property
    def strong(self) -> np.ndarray: ...
    @property
    def label(self) -> np.ndarray: ...
    @property
    def subjects(self) -> np.ndarray: ...

CHECKED_TARGETS: tuple[tuple[str, float], ...] = (
    ("max_strong_share", 0.3),
    ("max_strong_share", 0.5),
    ("min_gap_recovered", 0.8),
    ("min_strong_quality", 0.95),
)


def routing_metrics(scores: np.ndarray, data: Labelled, calibrated: bool = False) -> dict[str, Any]:
    """AUC on the strong-needed label, APGR and CPT(50%/80%), with the random and oracle baselines."""
    curve = gap_curve(scores, data.weak, data.strong)
    oracle = gap_curve(oracle_scores(data.weak, data.strong), data.weak, data.strong)
    out: dict[str, Any] = {
        "rows": int(len(scores)),
        "auc": round(float(roc_auc_score(data.label, scores)), 4),
        "apgr": round(curve.apgr(), 4),
        "cpt50": round(curve.cpt(0.5), 4),
        "cpt80": round(curve.cpt(0.8), 4),
        "random": {"apgr": random_apgr(), "cpt50": 0.5, "cpt80": 0.8},
        "oracle": {"apgr": round(oracle.apgr(), 4), "cpt50": round(oracle.cpt(0.5), 4),
                   "cpt80": round(oracle.cpt(0.8), 4)},
        "weak_quality": round(curve.weak_quality, 4),
        "strong_quality": round(curve.strong_quality, 4),
        "positive_rate": round(float(data.label.mean()), 4),
    }
    if calibrated:
        out["brier"] = round(float(brier_score_loss(data.label, scores)), 4)
        out["brier_constant"] = round(float(brier_score_loss(data.label, np.full(len(scores), data.label.mean()))), 4)
        out["ece"] = round(expected_calibration_error(scores, data.label), 4)
    return out


def _check(mode: str, value: float, t: float, shares: float, quality: float, weak_q: float, strong_q: float
           ) -> dict[str, Any]:
    row: dict[str, Any] = {
        "mode": mode, "value": value, "threshold": round(t, 6),
        "test_strong_share": round(shares, 4),
        "test_quality": round(quality, 4),
        "test_pgr": round((quality - weak_q) / (strong_q - weak_q), 4),
        "test_quality_vs_strong": round(quality / strong_q, 4),
    }
    if mode == "max_strong_share":
        row["share_error"] = round(shares - value, 4)
    return row


def target_checks(dev_curve: GapCurve, test_scores: np.ndarray, test: Labelled) -> list[dict[str, Any]]:
    """Thresholds picked on selection data for each target, and what they actually deliver on held-out data."""
    out = []
    weak_q, strong_q = float(test.weak.mean()), float(test.strong.mean())
    for mode, value in CHECKED_TARGETS:
        t = threshold_for_target(dev_curve, mode, value)
        to_strong = test_scores >= t
        quality = float(np.where(to_strong, test.strong, test.weak).mean())
        out.append(_check(mode, value, t, float(to_strong.mean()), quality, weak_q, strong_q))
    return out


def pooled_target_checks(dev_curve: GapCurve, m_scores: np.ndarray, m: Labelled, a_scores: np.ndarray, a: Labelled
                         ) -> list[dict[str, Any]]:
    """target_checks on both held-out sources together, each weighing half, qualities relative to strong."""
    out = []
    parts = [(m_scores, m), (a_scores, a)]
    weak_q = float(np.mean([d.weak.mean() / d.strong.mean() for _, d in parts]))
    for mode, value in CHECKED_TARGETS:
        t = threshold_for_target(dev_curve, mode, value)
        share = float(np.mean([(sc >= t).mean() for sc, _ in parts]))
        quality = float(np.mean([np.where(sc >= t, d.strong, d.weak).mean() / d.strong.mean() for sc, d in parts]))
        out.append(_check(mode, value, t, share, quality, weak_q, 1.0))
    return out


def within_group_auc(scores: np.ndarray, data: Labelled) -> float | None:
    """Mean AUC inside each group (MMLU subject, AlpacaEval source) that has both labels."""
    aucs = []
    for group in np.unique(data.subjects):
        k = data.subjects == group
        y = data.label[k]
        if 0 < y.sum() < len(y):
            aucs.append(float(roc_auc_score(y, scores[k])))
    return round(float(np.mean(aucs)), 4) if aucs else None


def held_out_data(router: Router, data_dir: Path, cache_dir: Path, every: int = 1) -> tuple[MMLUData, np.ndarray]:
    """The artifact's own test subjects with their embeddings, computed the gateway's way.

    Only the held-out subjects are embedded (one cache file per subject, shared with training),
    so a cold cache costs ~20% of the training pass, not all of it. `every` > 1 keeps every
    every-th held-out row (a fixed sample, cached apart from the whole set).
    """
    from policies.router.data import load_mmlu, mmlu_embeddings, subject_sample

    subjects = router.manifest.get("split", {}).get("test_subjects")
    if not subjects:
        raise ValueError("the router manifest lists no held-out test subjects to evaluate on")
    data = router.manifest.get("data", {})
    mmlu = subject_sample(load_mmlu(data_dir), data.get("mmlu_rows_per_subject_cap"), data.get("mmlu_sample_seed", 11))
    idx = np.flatnonzero(np.isin(mmlu.subjects, subjects))
    if every == 1:
        return mmlu.take(idx), mmlu_embeddings(mmlu, cache_dir, subjects=list(subjects))
    sample = mmlu.take(idx[::every])
    return sample, mmlu_embeddings(sample, cache_dir)


def per_subject(scores: np.ndarray, data: Labelled) -> dict[str, dict[str, Any]]:
    """Rows, positive rate, mean score and within-subject AUC (None when a subject has one class)."""
    out: dict[str, dict[str, Any]] = {}
    for subject in sorted(set(data.subjects.tolist())):
        k = data.subjects == subject
        y = data.label[k]
        out[subject] = {
            "rows": int(k.sum()), "positive_rate": round(float(y.mean()), 4),
            "mean_score": round(float(scores[k].mean()), 4),
            "auc": round(float(roc_auc_score(y, scores[k])), 4) if 0 < y.sum() < len(y) else None,
        }
    return out


def held_out_alpaca(router: Router, data_dir: Path, cache_dir: Path) -> tuple[AlpacaData, np.ndarray]:
    """The artifact's held-out AlpacaEval sources with their embeddings (the gateway's way, cached)."""
    from policies.router.data import alpaca_embeddings, load_alpaca

    sources = router.manifest.get("split", {}).get("alpaca_test_sources")
    if not sources:
        raise ValueError("the router manifest lists no held-out AlpacaEval sources to evaluate on")
    alpaca = load_alpaca(data_dir)
    idx = np.flatnonzero(np.isin(alpaca.subjects, list(sources)))
    return alpaca.take(idx), alpaca_embeddings(alpaca, cache_dir)[idx]


def _at_threshold(scores: np.ndarray, data: Labelled, threshold: float) -> dict[str, float]:
    to_strong = scores >= threshold
    weak_q, strong_q = float(data.weak.mean()), float(data.strong.mean())
    quality = float(np.where(to_strong, data.strong, data.weak).mean())
    return {"threshold": round(threshold, 6), "strong_share": round(float(to_strong.mean()), 4),
            "quality": round(quality, 4), "pgr": round((quality - weak_q) / (strong_q - weak_q), 4),
            "quality_vs_strong": round(quality / strong_q, 4)}


def source_report(router: Router, scores: np.ndarray, data: Labelled, threshold: float | None) -> dict[str, Any]:
    """Every held-out figure of one source: pooled metrics, per group, targets, the default threshold."""
    # Brier and calibration error read the score as a probability; a family-ranked score is a rank.
    report = routing_metrics(scores, data, calibrated=router.ranks is None)
    report["per_group"] = per_subject(scores, data)
    report["mean_within_group_auc"] = within_group_auc(scores, data)
    if router.curve is not None:
        report["target_checks"] = target_checks(router.curve, scores, data)
    if threshold is not None:
        report["at_default_policy"] = _at_threshold(scores, data, threshold)
    return report


def evaluate_router(
    router: Router, data_dir: Path, cache_dir: Path, plot: Path | None = None, threshold: float | None = None
) -> dict[str, Any]:
    """Score the held-out MMLU subjects and AlpacaEval sources; optionally draw both sources' curves.

    `threshold`: the score threshold the default policy resolves to, reported per source.
    """
    m_test, m_emb = held_out_data(router, data_dir, cache_dir)
    a_test, a_emb = held_out_alpaca(router, data_dir, cache_dir)
    m_scores = router.score_batch(m_test.prompts, m_emb)
    a_scores = router.score_batch(a_test.prompts, a_emb)
    mmlu = source_report(router, m_scores, m_test, threshold)
    # The largest subject can dominate the pooled figures; the same metrics without it.
    largest = max(mmlu["per_group"], key=lambda s: mmlu["per_group"][s]["rows"])
    rest = np.flatnonzero(m_test.subjects != largest)
    if len(rest) and 0 < m_test.label[rest].mean() < 1:
        without = routing_metrics(m_scores[rest], m_test.take(rest))
        mmlu["without_largest_subject"] = {"subject": largest, **{k: without[k] for k in ("rows", "auc", "apgr", "cpt50", "cpt80")}}
    report: dict[str, Any] = {
        "model": router.manifest.get("model", {}).get("name"),
        "mmlu": mmlu,
        "alpaca": source_report(router, a_scores, a_test, threshold),
    }
    if router.curve is not None:
        report["pooled_target_checks"] = pooled_target_checks(router.curve, m_scores, m_test, a_scores, a_test)
    if plot is not None:
        plot_sources(
            {"MMLU held-out subjects": (m_scores, m_test), "AlpacaEval held-out sources": (a_scores, a_test)}, plot
        )
    return report


def plot_sources(parts: dict[str, tuple[np.ndarray, Labelled]], path: Path) -> None:
    """One panel per source: the mix's quality against the strong share, router vs random and oracle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(parts), figsize=(5.6 * len(parts), 4.4), dpi=110, squeeze=False)
    for ax, (name, (scores, data)) in zip(axes[0], parts.items()):
        router_curve = gap_curve(scores, data.weak, data.strong)
        oracle = gap_curve(oracle_scores(data.weak, data.strong), data.weak, data.strong)
        ax.plot([0, 1], [router_curve.weak_quality, router_curve.strong_quality], "--", color="grey",
                label="random (APGR 0.50)")
        ax.plot(router_curve.share, router_curve.quality, label=f"router (APGR {router_curve.apgr():.3f})")
        ax.plot(oracle.share, oracle.quality, lw=0.8, label=f"oracle (APGR {oracle.apgr():.2f})")
        ax.axhline(router_curve.strong_quality, color="black", lw=0.6)
        ax.axhline(router_curve.weak_quality, color="black", lw=0.6)
        ax.set_xlabel("share of calls sent to the strong model")
        ax.set_ylabel("quality of the weak/strong mix")
        ax.set_title(f"{name} (n={len(scores)})", fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
