"""Held-out figures of a router (AUC, APGR, CPT against random and oracle) and the quality-vs-share plot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    from policies.router.data import MMLUData
    from policies.router.model import Router

CHECKED_TARGETS: tuple[tuple[str, float], ...] = (
    ("max_strong_share", 0.3),
    ("max_strong_share", 0.5),
    ("min_gap_recovered", 0.8),
    ("min_strong_quality", 0.95),
)


def routing_metrics(scores: np.ndarray, data: MMLUData, calibrated: bool = False) -> dict[str, Any]:
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


def target_checks(dev_curve: GapCurve, test_scores: np.ndarray, test: MMLUData) -> list[dict[str, Any]]:
    """Thresholds picked on dev data for each target, and what they actually deliver on held-out data."""
    out = []
    for mode, value in CHECKED_TARGETS:
        t = threshold_for_target(dev_curve, mode, value)
        to_strong = test_scores >= t
        quality = float(np.where(to_strong, test.strong, test.weak).mean())
        weak_q, strong_q = float(test.weak.mean()), float(test.strong.mean())
        out.append({
            "mode": mode, "value": value, "threshold": round(t, 6),
            "test_strong_share": round(float(to_strong.mean()), 4),
            "test_quality": round(quality, 4),
            "test_pgr": round((quality - weak_q) / (strong_q - weak_q), 4),
            "test_quality_vs_strong": round(quality / strong_q, 4),
        })
    return out


def held_out_data(router: Router, data_dir: Path, cache_dir: Path) -> tuple[MMLUData, np.ndarray]:
    """The artifact's own test subjects with their embeddings, computed the gateway's way.

    Only the held-out subjects are embedded (one cache file per subject, shared with training),
    so a cold cache costs ~20% of the training pass, not all of it.
    """
    from policies.router.data import load_mmlu, mmlu_embeddings, subject_sample

    subjects = router.manifest.get("split", {}).get("test_subjects")
    if not subjects:
        raise ValueError("the router manifest lists no held-out test subjects to evaluate on")
    data = router.manifest.get("data", {})
    mmlu = subject_sample(load_mmlu(data_dir), data.get("mmlu_rows_per_subject_cap"), data.get("mmlu_sample_seed", 11))
    idx = np.flatnonzero(np.isin(mmlu.subjects, subjects))
    return mmlu.take(idx), mmlu_embeddings(mmlu, cache_dir, subjects=list(subjects))


def per_subject(scores: np.ndarray, data: MMLUData) -> dict[str, dict[str, Any]]:
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


def evaluate_router(router: Router, data_dir: Path, cache_dir: Path, plot: Path | None = None) -> dict[str, Any]:
    """Score the held-out subjects with `router`; optionally draw the PGR-vs-strong-share curve."""
    test, emb = held_out_data(router, data_dir, cache_dir)
    scores = router.score_batch(test.prompts, emb)
    report = routing_metrics(scores, test, calibrated=True)
    report["test_subjects"] = sorted(set(test.subjects.tolist()))
    report["per_subject"] = per_subject(scores, test)
    within = [r["auc"] for r in report["per_subject"].values() if r["auc"] is not None]
    report["mean_within_subject_auc"] = round(float(np.mean(within)), 4) if within else None
    # The largest subject can dominate the pooled figures; the same metrics without it.
    largest = max(report["per_subject"], key=lambda s: report["per_subject"][s]["rows"])
    rest = np.flatnonzero(test.subjects != largest)
    if len(rest) and 0 < test.label[rest].mean() < 1:
        without = routing_metrics(scores[rest], test.take(rest))
        report["without_largest_subject"] = {"subject": largest, **{k: without[k] for k in ("rows", "auc", "apgr", "cpt50", "cpt80")}}
    if router.curve is not None:
        report["target_checks"] = target_checks(router.curve, scores, test)
    report["model"] = router.manifest.get("model", {}).get("name")
    if plot is not None:
        plot_curves(
            {"router": gap_curve(scores, test.weak, test.strong),
             "oracle": gap_curve(oracle_scores(test.weak, test.strong), test.weak, test.strong)},
            plot,
            title=f"Held-out MMLU subjects (n={len(scores)}): APGR {report['apgr']:.3f}",
        )
    return report


def plot_curves(curves: dict[str, GapCurve], path: Path, title: str) -> None:
    """Quality of the mix (and PGR) against the share sent to the strong model, with random as reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    any_curve = next(iter(curves.values()))
    ax.plot([0, 1], [any_curve.weak_quality, any_curve.strong_quality], "--", color="grey", label="random (APGR 0.50)")
    for name, curve in curves.items():
        ax.plot(curve.share, curve.quality, label=f"{name} (APGR {curve.apgr():.2f})")
    ax.axhline(any_curve.strong_quality, color="black", lw=0.6)
    ax.axhline(any_curve.weak_quality, color="black", lw=0.6)
    ax.set_xlabel("share of calls sent to the strong model")
    ax.set_ylabel("accuracy of the weak/strong mix")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
