"""The model families and training mixes the trainer compares, each fit the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.compose import ColumnTransformer
from sklearn.decomposition import PCA
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.neighbors import KNeighborsClassifier
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from policies.router.features import FEATURE_NAMES

FeatureSet = str  # "embedding" | "text" | "both"

# Group intercepts ("fixed effects") enter the logistic regression as one-hot columns multiplied
# by this factor after scaling: their L2 penalty is 1/FE_SCALE² of an ordinary column's, so the
# groups' base rates are absorbed there and the shared weights learn difficulty *within* a group.
FE_SCALE = 10.0


@dataclass(slots=True)
class TrainSet:
    """Inputs of one fit: embeddings, text features, a target in [0, 1], row weights and groups.

    `target` is the probability that the strong model is needed (0/1 on MMLU, a judge's
    preference on AlpacaEval); `group` names each row's fixed-effect group (a subject, a source,
    or one group for all) for the candidates that take group intercepts.
    """

    emb: np.ndarray
    txt: np.ndarray
    target: np.ndarray
    weight: np.ndarray
    group: np.ndarray
    domain: np.ndarray | None = None  # finest grouping (subject/source), for `neutral`; default: group

    def __post_init__(self) -> None:
        n = len(self.target)
        if not (len(self.emb) == len(self.txt) == len(self.weight) == len(self.group) == n):
            raise ValueError("every TrainSet column needs one entry per row")
        if self.domain is not None and len(self.domain) != n:
            raise ValueError("every TrainSet column needs one entry per row")


@dataclass(slots=True)
class Candidate:
    """One model family on one feature set and one training mix.

    alpaca_weight: weight of the AlpacaEval rows, as a multiple of their count's share (0: MMLU only);
    alpaca_label: "weak" (the judge's preference for the reference over the weak model),
    "panel" (the same, averaged over a panel of small and mid-sized models) or "binary"
    (the weak model clearly loses); fe: group intercepts per "none" | "source" | "subject";
    math_weight: weight of MATH level 4-5 (positive) vs level 1-2 (negative) rows, 0 = unused;
    mmlu_target: "strong_needed" (weak wrong and strong right, 0/1), "gain" ((strong - weak + 1) / 2:
    1 strong-only win, 0.5 tie, 0 weak-only win: its expectation orders prompts by expected gain,
    which is what APGR rewards) or "weak_wrong" (0/1);
    gate: a 0/1 text feature (e.g. "closed_question") that switches on a second set of linear
    weights added to the shared ones (shared + per-format deviation, both L2-penalised), so
    multiple-choice and open prompts may weigh the same cues differently;
    neutral: fit on embeddings with the directions between domain centroids (MMLU subjects,
    AlpacaEval sources) projected out, so the score cannot move a whole domain up or down through
    its topic: it ranks within a domain, and a share target holds better on a new one.
    """

    name: str
    family: str  # "lr" | "ridge" | "hgb" | "mlp" | "knn"
    features: FeatureSet
    c: float = 0.02
    fe: str = "none"
    mmlu_target: str = "strong_needed"
    alpaca_weight: float = 1.0
    alpaca_label: str = "weak"
    math_weight: float = 0.0
    gate: str | None = None
    neutral: bool = False
    shippable: bool = True
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Fitted:
    """A fitted candidate; `linear` holds folded numpy weights when the model is linear."""

    candidate: Candidate
    estimator: Any
    linear: tuple[np.ndarray, np.ndarray, float] | None  # (w_emb, w_text, bias) on raw features
    gated: tuple[int, np.ndarray, np.ndarray, float] | None = None  # (gate column, v_emb, v_text, v_bias)


def default_candidates() -> list[Candidate]:
    """What `tierlane router train` compares. Unless a row says otherwise: MMLU target "gain",
    AlpacaEval rows weigh 5 each (~30 % of the loss next to ~10k MMLU rows), target "weak"."""
    base: dict[str, Any] = {"mmlu_target": "gain", "alpaca_weight": 5.0}
    src: dict[str, Any] = {**base, "fe": "source"}
    gated: dict[str, Any] = {**src, "gate": "closed_question"}
    return [
        Candidate("mmlu_only_lr", "lr", "both", mmlu_target="strong_needed", alpaca_weight=0.0,
                  note="the previous recipe's data and label: MMLU alone, weak wrong and strong right"),
        Candidate("mmlu_only_gain", "lr", "both", mmlu_target="gain", alpaca_weight=0.0, note="MMLU alone, gain target"),
        Candidate("lr_text", "lr", "text", c=1.0, **src, note="text features alone"),
        Candidate("lr_embedding", "lr", "embedding", **src, note="the embedding alone"),
        Candidate("lr_both", "lr", "both", **base, note="MMLU + AlpacaEval pooled, no group intercepts"),
        Candidate("lr_both_fe_source", "lr", "both", **src,
                  note="one intercept per data source during training, dropped at serving time"),
        Candidate("lr_both_fe_source_alpaca13", "lr", "both", **{**src, "alpaca_weight": 13.0},
                  note="AlpacaEval rows weigh as much as MMLU's in total"),
        Candidate("lr_both_fe_source_panel", "lr", "both", **src, alpaca_label="panel",
                  note="AlpacaEval target averaged over a panel of small and mid-sized models"),
        Candidate("lr_both_fe_source_binary", "lr", "both", **src, alpaca_label="binary",
                  note="AlpacaEval target: the weak model clearly loses (0/1)"),
        Candidate("lr_both_fe_subject", "lr", "both", **{**base, "fe": "subject"},
                  note="one intercept per MMLU subject and AlpacaEval source: weights learn within-group difficulty only"),
        Candidate("lr_gated", "lr", "both", **gated,
                  note="shared weights + a multiple-choice deviation switched on by the closed_question feature"),
        Candidate("lr_gated_c0.005", "lr", "both", c=0.005, **gated),
        Candidate("lr_gated_c0.1", "lr", "both", c=0.1, **gated),
        Candidate("lr_gated_alpaca13", "lr", "both", **{**gated, "alpaca_weight": 13.0}),
        Candidate("lr_gated_strong_needed", "lr", "both", **{**gated, "mmlu_target": "strong_needed"}),
        Candidate("lr_gated_neutral", "lr", "both", **gated, neutral=True,
                  note="embedding directions between domain centroids projected out"),
        Candidate("lr_gated_math", "lr", "both", **gated, math_weight=0.3,
                  note="plus MATH level 4-5 as positives, 1-2 as negatives (own intercept), weight 0.3"),
        Candidate("lr_gated_c0.005_math", "lr", "both", c=0.005, **gated, math_weight=0.3,
                  note="lr_gated_c0.005 plus MATH level rows at weight 0.3: by leave-one-family-out "
                       "(bench/router_lofo.py) it ranks held-out MATH types' levels better at no APGR cost"),
        Candidate("hgb_both", "hgb", "both", **base,
                  note="gradient boosting on text features + 32 PCA components of the embedding"),
    ]


def _columns(features: FeatureSet, emb: np.ndarray, txt: np.ndarray) -> np.ndarray:
    if features == "embedding":
        return emb.astype(np.float64)
    if features == "text":
        return txt
    return np.hstack([emb.astype(np.float64), txt])


def _soft(x: np.ndarray, target: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Soft targets as two weighted copies of each row (label 1 with weight w·p, label 0 with w·(1-p))."""
    y = np.concatenate([np.ones(len(target)), np.zeros(len(target))])
    w = np.concatenate([weight * target, weight * (1.0 - target)])
    keep = w > 0
    return np.vstack([x, x])[keep], y[keep].astype(np.int64), w[keep]


def fit_candidate(candidate: Candidate, data: TrainSet, seed: int) -> Fitted:
    """Fit on `data`; linear candidates also get their weights folded back to raw features."""
    d, t = data.emb.shape[1], data.txt.shape[1]
    x = _columns(candidate.features, data.emb, data.txt)
    target = np.clip(np.asarray(data.target, dtype=np.float64), 0.0, 1.0)
    weight = np.asarray(data.weight, dtype=np.float64)
    basis: np.ndarray | None = None
    if candidate.neutral:
        basis = domain_basis(data.emb, data.group if data.domain is None else data.domain, weight)
        emb = data.emb.astype(np.float64) - (data.emb.astype(np.float64) @ basis) @ basis.T
        x = _columns(candidate.features, emb, data.txt)
    if candidate.family == "lr":
        scaler = StandardScaler().fit(x, sample_weight=weight)
        xs = scaler.transform(x)
        k = x.shape[1]
        gate_col: int | None = None
        if candidate.gate is not None:
            gate_col = FEATURE_NAMES.index(candidate.gate)
            g = (data.txt[:, gate_col] > 0.5).astype(np.float64)
            xs = np.hstack([xs, g[:, None] * xs, g[:, None]])
        names: np.ndarray | None = None
        if candidate.fe != "none":
            names = np.unique(data.group)
            xs = np.hstack([xs, FE_SCALE * (data.group[:, None] == names[None, :]).astype(np.float64)])
        xx, yy, ww = _soft(xs, target, weight)
        lr = LogisticRegression(C=candidate.c, max_iter=3000).fit(xx, yy, sample_weight=ww)
        coef = np.ravel(lr.coef_)
        w = coef[:k] / scaler.scale_
        bias = float(lr.intercept_[0] - w @ scaler.mean_)
        gated = None
        if gate_col is not None:
            v = coef[k : 2 * k] / scaler.scale_
            v_bias = float(coef[2 * k] - v @ scaler.mean_)
            v_emb, v_text, _ = _split_linear(v, 0.0, candidate.features, d, t)
            gated = (gate_col, _project_out(v_emb, basis), v_text, v_bias)
        if names is not None:
            bias += FE_SCALE * float(np.mean(coef[-len(names) :]))  # the average group: Platt re-centres it anyway
        w_emb, w_text, b = _split_linear(w, bias, candidate.features, d, t)
        return Fitted(candidate, lr, (_project_out(w_emb, basis), w_text, b), gated)
    if candidate.family == "ridge":
        # alpha = 1/C on standardized columns, so C means the same as for logistic regression
        est: Any = make_pipeline(StandardScaler(), Ridge(alpha=1.0 / candidate.c))
        est.fit(x, target, ridge__sample_weight=weight)
        scaler = est[0]
        w = np.ravel(est[-1].coef_) / scaler.scale_
        bias = float(np.ravel(est[-1].intercept_)[0] - w @ scaler.mean_)
        return Fitted(candidate, est, _split_linear(w, bias, candidate.features, d, t))
    xx, yy, ww = _soft(x, target, weight)
    if candidate.family == "hgb":
        # Trees over 384 raw embedding dims are slow and overfit; 32 principal components keep the gist.
        ex = candidate.extra
        reduce = ColumnTransformer(
            [("pca", PCA(n_components=min(int(ex.get("pca", 32)), d), random_state=seed), slice(0, d)),
             ("text", "passthrough", slice(d, None))]
        ) if candidate.features == "both" else "passthrough"
        est = Pipeline([
            ("reduce", reduce),
            ("hgb", HistGradientBoostingClassifier(
                max_iter=int(ex.get("max_iter", 100)), learning_rate=float(ex.get("learning_rate", 0.1)),
                max_leaf_nodes=int(ex.get("max_leaf_nodes", 15)), min_samples_leaf=int(ex.get("min_samples_leaf", 20)),
                l2_regularization=1.0, early_stopping=True, validation_fraction=0.15, random_state=seed,
            )),
        ])
        # NOTE: one OpenMP thread: on a shared 2-core machine more threads spin and slow every fit.
        with threadpool_limits(limits=1):
            est.fit(xx, yy, hgb__sample_weight=ww)
        return Fitted(candidate, est, None)
    if candidate.family == "mlp":
        if candidate.features != "both":
            raise ValueError("the mlp candidate takes the 'both' feature set")
        ex = candidate.extra
        est = Pipeline([
            ("reduce", ColumnTransformer(
                [("pca", PCA(n_components=min(int(ex.get("pca", 64)), d), random_state=seed), slice(0, d)),
                 ("text", "passthrough", slice(d, None))])),
            ("scale", StandardScaler()),
            ("mlp", MLPClassifier(hidden_layer_sizes=(int(ex.get("hidden", 32)),), alpha=float(ex.get("alpha", 1.0)),
                                  early_stopping=True, validation_fraction=0.15, max_iter=300, random_state=seed)),
        ])
        with threadpool_limits(limits=1):
            est.fit(x, (target >= 0.5).astype(np.int64))
        return Fitted(candidate, est, None)
    if candidate.family == "knn":
        est = KNeighborsClassifier(n_neighbors=100, algorithm="brute")
        est.fit(x, (target >= 0.5).astype(np.int64))
        return Fitted(candidate, est, None)
    raise ValueError(f"unknown model family {candidate.family!r}")


def domain_basis(emb: np.ndarray, domain: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning the domain centroids' offsets from the overall mean (d x k)."""
    e = emb.astype(np.float64)
    mean = np.average(e, axis=0, weights=weight)
    names = np.unique(domain)
    offsets = np.vstack([np.average(e[domain == g], axis=0, weights=weight[domain == g]) - mean for g in names])
    u, sv, vt = np.linalg.svd(offsets, full_matrices=False)
    keep = sv > 1e-8 * max(float(sv.max(initial=0.0)), 1e-12)
    return np.ascontiguousarray(vt[keep].T)


def _project_out(w_emb: np.ndarray, basis: np.ndarray | None) -> np.ndarray:
    """w·(I - BBᵀ)e = ((I - BBᵀ)w)·e: the projection folds into the served weights."""
    if basis is None or basis.size == 0:
        return w_emb
    return np.asarray(w_emb - basis @ (basis.T @ w_emb), dtype=np.float64)


def _split_linear(w: np.ndarray, bias: float, features: FeatureSet, d: int, t: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Raw-feature weights as (w_emb, w_text, bias), zeros for the columns a feature set leaves out."""
    w_emb, w_text = np.zeros(d), np.zeros(t)
    if features == "embedding":
        w_emb += w[:d]
    elif features == "text":
        w_text += w[:t]
    else:
        w_emb += w[:d]
        w_text += w[d : d + t]
    return w_emb, w_text, bias


def decision(fitted: Fitted, emb: np.ndarray, txt: np.ndarray) -> np.ndarray:
    """Raw scores (logits for linear models, probabilities otherwise) on new rows."""
    if fitted.linear is not None:
        w_emb, w_text, b = fitted.linear
        z = emb.astype(np.float64) @ w_emb + txt @ w_text + b
        if fitted.gated is not None:
            col, v_emb, v_text, v_b = fitted.gated
            z = z + (txt[:, col] > 0.5) * (emb.astype(np.float64) @ v_emb + txt @ v_text + v_b)
        return np.asarray(z, dtype=np.float64)
    x = _columns(fitted.candidate.features, emb, txt)
    return np.asarray(fitted.estimator.predict_proba(x)[:, 1], dtype=np.float64)
