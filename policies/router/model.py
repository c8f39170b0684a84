"""The complexity router at serving time: probability that a prompt needs the strong lane."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from policies.router.artifact import Artifact, RouterArtifactError, load_artifact
from policies.router.calibration import GapCurve, threshold_for_target
from policies.router.features import FEATURE_NAMES, Prompt, text_feature_matrix, text_features


@dataclass(slots=True)
class Router:
    """Scores prompts with the fitted model; linear models skip sklearn and use one dot product."""

    kind: str  # "linear": w_emb·e + w_text·f + bias, Platt-calibrated; "sklearn": estimator.predict_proba
    dimension: int
    w_emb: np.ndarray | None
    w_text: np.ndarray | None
    bias: float
    estimator: Any
    curve: GapCurve | None
    default_threshold: float
    manifest: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path | None = None) -> Router:
        """Load the shipped artifact (or the one at `path`) after checking its manifest."""
        return cls.from_artifact(load_artifact(path))

    @classmethod
    def from_artifact(cls, artifact: Artifact) -> Router:
        p = artifact.params
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
        table = artifact.manifest.get("calibration", {}).get("curve")
        return cls(
            kind=kind,
            dimension=dimension,
            w_emb=w_emb,
            w_text=w_text,
            bias=float(p.get("bias", 0.0)),
            estimator=p.get("estimator"),
            curve=GapCurve.from_table(table) if table else None,
            default_threshold=float(artifact.manifest.get("default_threshold", 0.5)),
            manifest=artifact.manifest,
        )

    def _embedding(self, embedding: Any) -> np.ndarray:
        vec = np.asarray(embedding, dtype=np.float32).reshape(-1)
        if vec.shape[0] != self.dimension:
            raise ValueError(f"router needs a {self.dimension}-d embedding, got {vec.shape[0]}-d")
        return vec

    def score(self, prompt: Prompt, embedding: Any) -> float:
        """Probability in [0, 1] that the strong lane is needed for this prompt."""
        vec = self._embedding(embedding)
        feats = text_features(prompt)
        if self.kind == "linear":
            assert self.w_emb is not None and self.w_text is not None
            z = float(self.w_emb @ vec) + float(self.w_text @ feats) + self.bias
            return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0
        x = np.concatenate([vec.astype(np.float64), feats])[None, :]
        return float(self.estimator.predict_proba(x)[0, 1])

    def score_batch(self, prompts: Sequence[Prompt], embeddings: np.ndarray) -> np.ndarray:
        """Scores for many prompts at once (evaluation, the score CLI)."""
        emb = np.asarray(embeddings, dtype=np.float32)
        if emb.ndim != 2 or emb.shape != (len(prompts), self.dimension):
            raise ValueError(f"need {len(prompts)} embeddings of {self.dimension} dims, got shape {emb.shape}")
        feats = text_feature_matrix(prompts)
        if self.kind == "linear":
            assert self.w_emb is not None and self.w_text is not None
            z = emb.astype(np.float64) @ self.w_emb.astype(np.float64) + feats @ self.w_text + self.bias
            return 1.0 / (1.0 + np.exp(-np.clip(z, -700, 700)))
        x = np.hstack([emb.astype(np.float64), feats])
        return np.asarray(self.estimator.predict_proba(x)[:, 1], dtype=np.float64)

    def threshold_for(self, mode: str, value: float) -> float:
        """A score threshold for a target, calibrated on the held-out curve shipped in the manifest."""
        if mode == "threshold":
            return float(value)
        if self.curve is None:
            raise RouterArtifactError(f"router artifact has no calibration curve; target mode {mode!r} needs one")
        return threshold_for_target(self.curve, mode, value)
