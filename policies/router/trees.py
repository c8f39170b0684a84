"""A numpy copy of a fitted PCA + HistGradientBoosting pipeline, for one-row scoring without sklearn overhead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

FIELDS = ("feature_idx", "num_threshold", "missing_go_to_left", "left", "right", "is_leaf", "value")


@dataclass(slots=True, frozen=True)
class FlatForest:
    """The PCA as arrays and every tree as plain lists, walked in Python for one row."""

    pca_mean: np.ndarray | None  # PCA over the embedding columns, when the pipeline has one
    pca_components: np.ndarray | None
    baseline: float
    trees: tuple[tuple[list[Any], ...], ...]  # per tree: FIELDS as python lists

    @classmethod
    def from_pipeline(cls, pipeline: Any) -> FlatForest:
        """Copy a Pipeline([reduce, HistGradientBoostingClassifier]) of a binary classifier."""
        reduce, hgb = pipeline[0], pipeline[-1]
        pca_mean = pca_components = None
        if reduce != "passthrough":
            pca = reduce.named_transformers_["pca"]
            if getattr(pca, "whiten", False):
                raise ValueError("whitened PCA is not supported by the flat forest")
            pca_mean = np.asarray(pca.mean_, dtype=np.float64)
            pca_components = np.asarray(pca.components_, dtype=np.float64)
        categorical = getattr(hgb, "is_categorical_", None)
        if categorical is not None and np.any(categorical):
            raise ValueError("categorical features are not supported by the flat forest")
        return cls(
            pca_mean=pca_mean,
            pca_components=pca_components,
            baseline=float(np.ravel(hgb._baseline_prediction)[0]),
            trees=tuple(tuple(stage[0].nodes[f].tolist() for f in FIELDS) for stage in hgb._predictors),
        )

    def raw(self, embedding: np.ndarray, text: np.ndarray) -> float:
        """The model's log-odds for one row (embedding, text features)."""
        if self.pca_components is not None:
            assert self.pca_mean is not None
            x = np.concatenate([self.pca_components @ (embedding.astype(np.float64) - self.pca_mean), text])
        else:
            x = np.concatenate([embedding.astype(np.float64), text])
        row = x.tolist()
        total = self.baseline
        # A plain loop beats vectorising here: ~30 shallow trees, one row.
        for feature, threshold, missing_left, left, right, leaf, value in self.trees:
            node = 0
            while not leaf[node]:
                v = row[feature[node]]
                if v != v:  # NaN
                    node = left[node] if missing_left[node] else right[node]
                else:
                    node = left[node] if v <= threshold[node] else right[node]
            total += value[node]
        return total


@dataclass(slots=True, frozen=True)
class FlatMLP:
    """A numpy copy of Pipeline([PCA + passthrough, StandardScaler, one-hidden-layer MLPClassifier])."""

    pca_mean: np.ndarray
    pca_components: np.ndarray
    scale_mean: np.ndarray
    scale_scale: np.ndarray
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: float

    @classmethod
    def from_pipeline(cls, pipeline: Any) -> FlatMLP:
        reduce, scaler, mlp = pipeline[0], pipeline[1], pipeline[-1]
        pca = reduce.named_transformers_["pca"]
        if getattr(pca, "whiten", False):
            raise ValueError("whitened PCA is not supported by the flat MLP")
        if len(mlp.coefs_) != 2 or mlp.activation != "relu" or mlp.out_activation_ != "logistic":
            raise ValueError("the flat MLP copies one relu hidden layer with a logistic output only")
        return cls(
            pca_mean=np.asarray(pca.mean_, dtype=np.float64),
            pca_components=np.asarray(pca.components_, dtype=np.float64),
            scale_mean=np.asarray(scaler.mean_, dtype=np.float64),
            scale_scale=np.asarray(scaler.scale_, dtype=np.float64),
            w1=np.asarray(mlp.coefs_[0], dtype=np.float64),
            b1=np.asarray(mlp.intercepts_[0], dtype=np.float64),
            w2=np.asarray(mlp.coefs_[1], dtype=np.float64).reshape(-1),
            b2=float(np.ravel(mlp.intercepts_[1])[0]),
        )

    def raw(self, embedding: np.ndarray, text: np.ndarray) -> float:
        """The model's log-odds for one row (embedding, text features)."""
        x = np.concatenate([self.pca_components @ (embedding.astype(np.float64) - self.pca_mean), text])
        h = np.maximum((x - self.scale_mean) / self.scale_scale @ self.w1 + self.b1, 0.0)
        return float(h @ self.w2 + self.b2)
