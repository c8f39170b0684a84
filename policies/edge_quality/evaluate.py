"""Figures of a local/upstream policy from per-item outcomes; shared by calibration and the bench.

An item is one request the edge could answer: whether the edge answer is correct, its prior and
confidence, and raw token signals. Policies compared at the shipped thresholds:

* ``prior_only``: local when prior >= prior_only threshold (router before generation, no cascade);
* ``cascade_only``: every item generated at the edge, kept when confidence >= threshold;
* ``prior_cascade``: routed to the edge when prior >= gate, then kept when confidence >= threshold;
* ``random``: a coin with the edge share of ``prior_cascade`` (expected values).

Overall accuracy assumes the upstream model answers every escalated or upstream-routed item correctly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.edge_quality.features import answer_features

SIGNALS = ("prior", "confidence", "p_min", "p_q10", "p_q25", "mean_logprob", "neg_mean_entropy", "neg_log_tokens", "finished")


@dataclass(slots=True)
class ItemOutcome:
    family: str
    correct: bool
    prior: float
    confidence: float
    signals: dict[str, float] = field(default_factory=dict)


def token_signals(logprobs: Sequence[float], entropies: Sequence[float], finish_reason: str) -> dict[str, float]:
    """The single signals whose AUROC is reported (higher = more likely correct)."""
    f = answer_features(0.5, logprobs, entropies)
    return {
        "p_min": float(f[1]),
        "p_q10": float(f[2]),
        "p_q25": float(f[3]),
        "mean_logprob": float(f[4]),
        "neg_mean_entropy": -float(f[6]),
        "neg_log_tokens": -float(f[8]),
        "finished": float(finish_reason == "stop"),
    }


def auroc(labels: Sequence[bool] | np.ndarray, scores: Sequence[float] | np.ndarray) -> float | None:
    """Area under the ROC curve (ties count half); None when only one class is present."""
    y = np.asarray(labels, dtype=bool)
    s = np.asarray(scores, dtype=np.float64)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def local_figures(correct: np.ndarray, local: np.ndarray) -> dict[str, float | None]:
    """Local precision (accuracy of what is kept), local recall (share of the edge's right answers kept),
    edge share, and overall accuracy with upstream right on everything else."""
    correct = np.asarray(correct, dtype=bool)
    local = np.asarray(local, dtype=bool)
    n = len(correct)
    kept = int(local.sum())
    right = int(correct.sum())
    return {
        "local_precision": float((correct & local).sum() / kept) if kept else None,
        "local_recall": float((correct & local).sum() / right) if right else None,
        "edge_share": float(kept / n) if n else None,
        "overall_accuracy": float(((correct & local) | ~local).sum() / n) if n else None,
        "kept": kept,
        "items": n,
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(float(value), 4)


def policy_report(items: Sequence[ItemOutcome], gate: float, confidence: float, prior_only: float) -> dict[str, Any]:
    """The four policies side by side at these thresholds."""
    y = np.asarray([i.correct for i in items], dtype=bool)
    prior = np.asarray([i.prior for i in items], dtype=np.float64)
    conf = np.asarray([i.confidence for i in items], dtype=np.float64)
    out: dict[str, Any] = {
        "prior_only": local_figures(y, prior >= prior_only),
        "cascade_only": local_figures(y, conf >= confidence),
        "prior_cascade": {**local_figures(y, (prior >= gate) & (conf >= confidence)), "edge_generated_share": float((prior >= gate).mean()) if len(y) else None},
    }
    share = out["prior_cascade"]["edge_share"] or 0.0
    base = float(y.mean()) if len(y) else 0.0
    out["random"] = {
        "local_precision": base,
        "local_recall": share,
        "edge_share": share,
        "overall_accuracy": share * base + (1.0 - share),
        "kept": round(share * len(y), 1),
        "items": len(y),
    }
    return {k: {m: (_r(v) if isinstance(v, float) else v) for m, v in row.items()} for k, row in out.items()}


def signal_aurocs(items: Sequence[ItemOutcome]) -> dict[str, float | None]:
    y = [i.correct for i in items]
    out: dict[str, float | None] = {}
    for name in SIGNALS:
        if name == "prior":
            scores = [i.prior for i in items]
        elif name == "confidence":
            scores = [i.confidence for i in items]
        else:
            scores = [i.signals.get(name, 0.0) for i in items]
        out[name] = _r(auroc(y, scores))
    return out


def family_accuracy(items: Sequence[ItemOutcome]) -> dict[str, dict[str, float | int]]:
    by: dict[str, list[bool]] = {}
    for i in items:
        by.setdefault(i.family, []).append(i.correct)
    return {f: {"accuracy": round(sum(v) / len(v), 4), "items": len(v)} for f, v in sorted(by.items())}


def full_report(items: Sequence[ItemOutcome], thresholds: Mapping[str, float]) -> dict[str, Any]:
    """Edge accuracy per family, AUROC per signal, and the policies at `thresholds` (gate, confidence, prior_only)."""
    return {
        "items": len(items),
        "edge_accuracy": _r(float(np.mean([i.correct for i in items]))) if items else None,
        "edge_accuracy_by_family": family_accuracy(items),
        "auroc": signal_aurocs(items),
        "policies": policy_report(items, thresholds["gate"], thresholds["confidence"], thresholds["prior_only"]),
        "policies_by_family": {
            f: policy_report([i for i in items if i.family == f], thresholds["gate"], thresholds["confidence"], thresholds["prior_only"])["prior_cascade"]
            for f in sorted({i.family for i in items})
        },
    }
