"""The model families and feature sets the trainer compares, each fit the same way."""

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

FeatureSet = str  # "embedding" | "text" | "both"


@dataclass(slots=True)
class TrainSet:
    """Inputs of one fit: embeddings, text features, routing label, and the auxiliary MATH data."""

    emb: np.ndarray
    txt: np.ndarray
    label: np.ndarray
    weak_wrong: np.ndarray
    gain: np.ndarray  # strong correct - weak correct: +1 strong-only win, -1 weak-only win
    math_emb: np.ndarray | None = None
    math_txt: np.ndarray | None = None
    math_level: np.ndarray | None = None


@dataclass(slots=True)
class Candidate:
    """One model family on one feature set; `aux` names how MATH levels are used, if at all."""

    name: str
    family: str  # "lr" | "ridge" | "hgb" | "mlp" | "knn"
    features: FeatureSet
    c: float = 0.1
    target: str = "strong_needed"  # or "weak_wrong"
    aux: str | None = None  # None | "math_rows" | "math_difficulty"
    shippable: bool = True
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Fitted:
    """A fitted candidate; `linear` holds folded numpy weights when the model is linear."""

    candidate: Candidate
    estimator: Any
    linear: tuple[np.ndarray, np.ndarray, float] | None  # (w_emb, w_text, bias) on raw features


def default_candidates() -> list[Candidate]:
    return [
        Candidate("lr_text", "lr", "text", c=1.0),
        Candidate("lr_embedding", "lr", "embedding", c=0.02),
        Candidate("lr_both_c0.005", "lr", "both", c=0.005),
        Candidate("lr_both_c0.02", "lr", "both", c=0.02),
        Candidate("lr_both_c0.1", "lr", "both", c=0.1),
        Candidate("lr_both_weak_wrong", "lr", "both", c=0.02, target="weak_wrong",
                  note="trained on 'weak model wrong' instead of 'weak wrong and strong right'"),
        Candidate("ridge_both_gain", "ridge", "both", c=0.02, target="gain",
                  note="ridge regression on strong-minus-weak correctness (-1/0/+1): losses count too"),
        Candidate("lr_both_math_rows", "lr", "both", c=0.02, aux="math_rows",
                  note="MATH level 4-5 added as positives, level 1-2 as negatives, weight 0.3"),
        Candidate("lr_both_math_difficulty", "lr", "both", c=0.02, aux="math_difficulty",
                  note="a ridge MATH-level predictor added as one feature"),
        Candidate("hgb_both", "hgb", "both", note="gradient boosting on text features + 32 PCA components of the embedding"),
        Candidate("hgb_both_pca16", "hgb", "both", extra={"pca": 16},
                  note="gradient boosting on text features + 16 PCA components"),
        Candidate("hgb_both_slow", "hgb", "both", extra={"pca": 32, "learning_rate": 0.03, "max_iter": 400,
                                                          "max_leaf_nodes": 7, "min_samples_leaf": 80},
                  note="gradient boosting, smaller steps and leaves, up to 400 rounds (early stopping)"),
        Candidate("hgb_text", "hgb", "text", note="gradient boosting on the text features alone"),
        Candidate("mlp_both", "mlp", "both", extra={"pca": 64, "hidden": 32, "alpha": 1.0},
                  note="one-hidden-layer MLP (32 units) on standardised text features + 64 PCA components"),
        Candidate("knn_embedding", "knn", "embedding", shippable=False,
                  note="stores every training vector (~15 MB): over the 2 MB artifact budget"),
    ]


def _columns(features: FeatureSet, emb: np.ndarray, txt: np.ndarray) -> np.ndarray:
    if features == "embedding":
        return emb.astype(np.float64)
    if features == "text":
        return txt
    return np.hstack([emb.astype(np.float64), txt])


def _math_difficulty_model(data: TrainSet) -> tuple[np.ndarray, np.ndarray, float]:
    """Ridge from (embedding, text) to MATH level, as raw-feature weights."""
    assert data.math_emb is not None and data.math_txt is not None and data.math_level is not None
    scaler = StandardScaler().fit(data.math_txt)
    x = np.hstack([data.math_emb.astype(np.float64), scaler.transform(data.math_txt)])
    ridge = Ridge(alpha=10.0).fit(x, data.math_level.astype(np.float64))
    d = data.math_emb.shape[1]
    r_emb, r_txt_scaled = ridge.coef_[:d], ridge.coef_[d:]
    r_txt = r_txt_scaled / scaler.scale_
    r0 = float(ridge.intercept_ - r_txt @ scaler.mean_)
    return r_emb, r_txt, r0


def fit_candidate(candidate: Candidate, data: TrainSet, seed: int) -> Fitted:
    """Fit on `data`; linear candidates also get their weights folded back to raw features."""
    y = {"weak_wrong": data.weak_wrong, "gain": data.gain}.get(candidate.target, data.label)
    emb, txt = data.emb, data.txt
    weights: np.ndarray | None = None
    d = emb.shape[1]
    if candidate.aux == "math_rows":
        assert data.math_emb is not None and data.math_txt is not None and data.math_level is not None
        keep = data.math_level != 3
        emb = np.vstack([emb, data.math_emb[keep]])
        txt = np.vstack([txt, data.math_txt[keep]])
        y = np.concatenate([y, (data.math_level[keep] >= 4).astype(y.dtype)])  # only with 0/1 targets
        weights = np.concatenate([np.ones(len(data.label)), np.full(int(keep.sum()), 0.3)])
    extra = None
    if candidate.aux == "math_difficulty":
        extra = _math_difficulty_model(data)
    x = _columns(candidate.features, emb, txt)
    if extra is not None:
        x = np.hstack([x, (emb @ extra[0] + txt @ extra[1] + extra[2])[:, None]])
    if candidate.family == "lr":
        est: Any = make_pipeline(StandardScaler(), LogisticRegression(C=candidate.c, max_iter=2000))
        est.fit(x, y, logisticregression__sample_weight=weights)
        return Fitted(candidate, est, _fold_linear(est, candidate.features, d, txt.shape[1], extra))
    if candidate.family == "ridge":
        # alpha = 1/C on standardized columns, so C means the same as for logistic regression
        est = make_pipeline(StandardScaler(), Ridge(alpha=1.0 / candidate.c))
        est.fit(x, y.astype(np.float64), ridge__sample_weight=weights)
        return Fitted(candidate, est, _fold_linear(est, candidate.features, d, txt.shape[1], extra))
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
            est.fit(x, y, hgb__sample_weight=weights)
        return Fitted(candidate, est, None)
    if candidate.family == "mlp":
        if candidate.features != "both" or weights is not None:
            raise ValueError("the mlp candidate takes the 'both' feature set and no sample weights")
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
            est.fit(x, y)
        return Fitted(candidate, est, None)
    if candidate.family == "knn":
        est = KNeighborsClassifier(n_neighbors=100, algorithm="brute")
        est.fit(x, y)
        return Fitted(candidate, est, None)
    raise ValueError(f"unknown model family {candidate.family!r}")


def _fold_linear(
    est: Pipeline, features: FeatureSet, d: int, t: int, extra: tuple[np.ndarray, np.ndarray, float] | None
) -> tuple[np.ndarray, np.ndarray, float]:
    """Undo the scaler (and any stacked ridge feature) so the decision is w_emb·e + w_text·f + b."""
    scaler: StandardScaler = est[0]
    model = est[-1]  # LogisticRegression or Ridge: both linear in the scaled columns
    w = np.ravel(model.coef_) / scaler.scale_
    b = float(np.ravel(model.intercept_)[0] - w @ scaler.mean_)
    w_emb, w_text = np.zeros(d), np.zeros(t)
    if features == "embedding":
        w_emb += w[:d]
    elif features == "text":
        w_text += w[:t]
    else:
        w_emb += w[:d]
        w_text += w[d : d + t]
    if extra is not None:
        w_extra = w[-1]
        w_emb += w_extra * extra[0]
        w_text += w_extra * extra[1]
        b += w_extra * extra[2]
    return w_emb, w_text, b


def decision(fitted: Fitted, emb: np.ndarray, txt: np.ndarray) -> np.ndarray:
    """Raw scores (logits for linear models, probabilities otherwise) on new rows."""
    if fitted.linear is not None:
        w_emb, w_text, b = fitted.linear
        return np.asarray(emb.astype(np.float64) @ w_emb + txt @ w_text + b, dtype=np.float64)
    x = _columns(fitted.candidate.features, emb, txt)
    return np.asarray(fitted.estimator.predict_proba(x)[:, 1], dtype=np.float64)
