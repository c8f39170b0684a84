"""The complexity router at serving time: probability that a prompt needs the strong lane."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from policies.router.artifact import Artifact, RouterArtifactError, load_artifact
from policies.router.calibration import GapCurve, RankMap, threshold_for_target
from policies.router.features import FEATURE_NAMES, Prompt, text_feature_matrix, text_features
from policies.router.trees import FlatForest, FlatMLP


@dataclass(slots=True)
class Router:
    """Scores prompts with the fitted model; linear models skip sklearn and use one dot product."""

    kind: str  # "linear": w_emb·e + w_text·f + bias, Platt-calibrated; "sklearn": estimator.predict_proba
    dimension: int
    w_emb: np.ndarray | None
    w_text: np.ndarray | None
    bias: float
    estimator: Any
    features: str  # columns the sklearn estimator takes: "embedding" | "text" | "both"
    platt: tuple[float, float]  # slope, offset over the sklearn estimator's log-odds
    curve: GapCurve | None
    default_threshold: float
    manifest: dict[str, Any]
    fast: FlatForest | FlatMLP | None = None  # numpy copy of the estimator for one-row scoring
    # Linear models with a format gate: when text feature `gate_index` is 1 (e.g. a multiple-choice
    # question), g_emb·e + g_text·f + g_bias is added to the shared log-odds.
    gate_index: int | None = None
    g_emb: np.ndarray | None = None
    g_text: np.ndarray | None = None
    g_bias: float = 0.0
    # Linear models calibrated per task family: the log-odds are mapped to a rank among the
    # family's calibration prompts (`ranks[0]` when text feature `family_index` is 0, open prompts;
    # `ranks[1]` when it is 1, multiple choice), so one threshold sends the same share of each family.
    family_index: int | None = None
    ranks: tuple[RankMap, RankMap] | None = None

    @classmethod
    def load(cls, path: str | Path | None = None) -> Router:
        """Load the shipped artifact (or the one at `path`) after checking its manifest."""
        return cls.from_artifact(load_artifact(path))

    @classmethod
    def from_artifact(cls, artifact: Artifact) -> Router:
        table = artifact.manifest.get("calibration", {}).get("curve")
        return cls.from_params(
            artifact.params,
            curve=GapCurve.from_table(table) if table else None,
            default_threshold=float(artifact.manifest.get("default_threshold", 0.5)),
            manifest=artifact.manifest,
        )

    @classmethod
    def from_params(
        cls, p: dict[str, Any], *, curve: GapCurve | None, default_threshold: float, manifest: dict[str, Any]
    ) -> Router:
        """A router from fitted parameters (what `router.joblib` holds)."""
        kind = p.get("kind")
        if kind not in ("linear", "sklearn"):
            raise RouterArtifactError(f"router artifact has unknown kind {kind!r}")
        dimension = int(p["dimension"])
        w_emb = w_text = None
        if kind == "linear":
            w_emb = np.ascontiguousarray(p["w_emb"], dtype=np.float32)
            w_text = np.ascontiguousarray(p["w_text"], dtype=np.float64)
            if w_emb.shape != (dimension,) or w_text.shape != (len(FEATURE_NAMES),):
                raise RouterArtifactError("router artifact coefficients do not match its dimensions")
        gate_index: int | None = None
        g_emb = g_text = None
        g_bias = 0.0
        gate = p.get("gate")
        if kind == "linear" and gate is not None:
            gate_index = int(gate["feature"])
            g_emb = np.ascontiguousarray(gate["w_emb"], dtype=np.float32)
            g_text = np.ascontiguousarray(gate["w_text"], dtype=np.float64)
            g_bias = float(gate["bias"])
            if g_emb.shape != (dimension,) or g_text.shape != (len(FEATURE_NAMES),) or not 0 <= gate_index < len(FEATURE_NAMES):
                raise RouterArtifactError("router artifact gate coefficients do not match its dimensions")
        family_index: int | None = None
        ranks: tuple[RankMap, RankMap] | None = None
        family = p.get("families")
        if kind == "linear" and family is not None:
            family_index = int(family["feature"])
            if not 0 <= family_index < len(FEATURE_NAMES):
                raise RouterArtifactError("router artifact family feature is out of range")
            try:
                ranks = (RankMap.from_table(family["open"]), RankMap.from_table(family["closed"]))
            except (KeyError, ValueError) as exc:
                raise RouterArtifactError(f"router artifact has a damaged family rank map: {exc}") from exc
        slope, offset = p.get("platt", (1.0, 0.0))
        fast: FlatForest | FlatMLP | None = None
        estimator = p.get("estimator")
        if kind == "sklearn" and p.get("features") == "both" and estimator is not None and hasattr(estimator, "named_steps"):
            if "hgb" in estimator.named_steps:
                fast = FlatForest.from_pipeline(estimator)
            elif "mlp" in estimator.named_steps:
                fast = FlatMLP.from_pipeline(estimator)
        return cls(
            kind=kind,
            dimension=dimension,
            w_emb=w_emb,
            w_text=w_text,
            bias=float(p.get("bias", 0.0)),
            estimator=p.get("estimator"),
            features=str(p.get("features", "both")),
            platt=(float(slope), float(offset)),
            curve=curve,
            default_threshold=default_threshold,
            manifest=manifest,
            fast=fast,
            gate_index=gate_index,
            g_emb=g_emb,
            g_text=g_text,
            g_bias=g_bias,
            family_index=family_index,
            ranks=ranks,
        )

    def _embedding(self, embedding: Any) -> np.ndarray:
        vec = np.asarray(embedding, dtype=np.float32).reshape(-1)
        if vec.shape[0] != self.dimension:
            raise ValueError(f"router needs a {self.dimension}-d embedding, got {vec.shape[0]}-d")
        return vec

    def score(self, prompt: Prompt, embedding: Any) -> float:
        """A score in [0, 1] that grows with the need for the strong model.

        With family rank maps (the shipped model): the share of the prompt's task family's
        calibration prompts that score lower. Without: the Platt-calibrated probability.
        """
        vec = self._embedding(embedding)
        feats = text_features(prompt)
        if self.kind == "linear":
            assert self.w_emb is not None and self.w_text is not None
            z = float(self.w_emb @ vec) + float(self.w_text @ feats) + self.bias
            if self.gate_index is not None and feats[self.gate_index] > 0.5:
                assert self.g_emb is not None and self.g_text is not None
                z += float(self.g_emb @ vec) + float(self.g_text @ feats) + self.g_bias
            if self.ranks is not None:
                assert self.family_index is not None
                return self.ranks[int(feats[self.family_index] > 0.5)](z)
            return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0
        if self.fast is not None:
            # sklearn's per-call overhead (validation, thread pools) is milliseconds; the walk is microseconds.
            slope, offset = self.platt
            z = slope * self.fast.raw(vec, feats) + offset
            return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0
        return float(self._sklearn(vec[None, :], feats[None, :])[0])

    def score_batch(self, prompts: Sequence[Prompt], embeddings: np.ndarray) -> np.ndarray:
        """Scores for many prompts at once (evaluation, the score CLI)."""
        emb = np.asarray(embeddings, dtype=np.float32)
        if emb.ndim != 2 or emb.shape != (len(prompts), self.dimension):
            raise ValueError(f"need {len(prompts)} embeddings of {self.dimension} dims, got shape {emb.shape}")
        feats = text_feature_matrix(prompts)
        if self.kind == "linear":
            assert self.w_emb is not None and self.w_text is not None
            z = emb.astype(np.float64) @ self.w_emb.astype(np.float64) + feats @ self.w_text + self.bias
            if self.gate_index is not None:
                assert self.g_emb is not None and self.g_text is not None
                on = feats[:, self.gate_index] > 0.5
                z = z + on * (emb.astype(np.float64) @ self.g_emb.astype(np.float64) + feats @ self.g_text + self.g_bias)
            if self.ranks is not None:
                assert self.family_index is not None
                closed = feats[:, self.family_index] > 0.5
                return np.where(closed, self.ranks[1].batch(z), self.ranks[0].batch(z))
            return np.asarray(1.0 / (1.0 + np.exp(-np.clip(z, -700, 700))), dtype=np.float64)
        return self._sklearn(emb, feats)

    def _sklearn(self, emb: np.ndarray, feats: np.ndarray) -> np.ndarray:
        cols = {"embedding": emb.astype(np.float64), "text": feats}.get(self.features)
        x = np.hstack([emb.astype(np.float64), feats]) if cols is None else cols
        # NOTE: one OpenMP thread: tree prediction on a busy machine otherwise spins for milliseconds.
        with threadpool_limits(limits=1):
            p = np.clip(self.estimator.predict_proba(x)[:, 1], 1e-6, 1 - 1e-6)
        slope, offset = self.platt
        return np.asarray(1.0 / (1.0 + np.exp(-(slope * np.log(p / (1 - p)) + offset))), dtype=np.float64)

    def threshold_for(self, mode: str, value: float) -> float:
        """A score threshold for a target, calibrated on the held-out curve shipped in the manifest."""
        if mode == "threshold":
            return float(value)
        if self.curve is None:
            raise RouterArtifactError(f"router artifact has no calibration curve; target mode {mode!r} needs one")
        return threshold_for_target(self.curve, mode, value)
