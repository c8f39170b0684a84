"""EdgeCalibration: the two learned decisions of the edge lane, read from one artifact.

* ``prior(text, embedding)``: P(the edge model answers correctly | prompt), before generation,
  from the prompt's all-MiniLM-L6-v2 embedding (the vector the gateway already computes for the
  last user turn) and cheap prompt features. A logistic regression: one dot product.
* ``confidence(prior, tokens, finish_reason)``: P(correct | prior, token statistics), after
  generation. A logistic regression on Chow-style low quantiles of token probability, mean
  log-probability, entropy and length. An answer that did not finish on its own ("length",
  "loop", "low_confidence") scores 0.
* ``threshold(stage, mode, value)``: the score a policy compares against, chosen on the
  calibration split's out-of-fold scores for a target (``min_local_accuracy``,
  ``max_escalation_share`` or ``min_local_recall``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from policies.artifact_dir import sha256_file
from policies.edge_quality.artifact import EdgeCalibrationError, load_artifact
from policies.edge_quality.features import TokenStat, answer_features, prompt_features, token_arrays

log = logging.getLogger(__name__)

Stage = Literal["prior", "confidence"]
MODES = ("min_local_accuracy", "max_escalation_share", "min_local_recall")
NEVER = math.inf  # a threshold no score reaches: nothing is kept local
FINISHED = "stop"


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def _threshold(value: Any) -> float:
    """A stored threshold; null (no threshold met the target) is NEVER."""
    return NEVER if value is None else float(value)


@dataclass(frozen=True, slots=True)
class Curve:
    """What keeping items with score >= t local gives, on the calibration split, for ascending t.

    `local_accuracy` is the conservative envelope min over t' >= t of the accuracy of what is
    kept (points keeping fewer than a minimum count carry the last reliable value), so it never
    decreases with t and a higher accuracy target never gives a lower threshold.
    """

    thresholds: np.ndarray
    kept_share: np.ndarray
    local_accuracy: np.ndarray
    local_recall: np.ndarray

    @classmethod
    def from_manifest(cls, row: Mapping[str, Any]) -> Curve:
        return cls(*(np.asarray(row[k], dtype=np.float64) for k in ("thresholds", "kept_share", "local_accuracy", "local_recall")))

    def to_manifest(self) -> dict[str, list[float]]:
        return {
            "thresholds": [round(float(v), 6) for v in self.thresholds],
            "kept_share": [round(float(v), 6) for v in self.kept_share],
            "local_accuracy": [round(float(v), 6) for v in self.local_accuracy],
            "local_recall": [round(float(v), 6) for v in self.local_recall],
        }

    def threshold(self, mode: str, value: float) -> float:
        """The threshold meeting the target; NEVER when no threshold does (keep nothing local)."""
        t = self.thresholds
        if mode == "min_local_accuracy":
            ok = np.flatnonzero(self.local_accuracy >= value)
            return float(t[ok[0]]) if ok.size else NEVER
        if mode == "max_escalation_share":
            ok = np.flatnonzero(self.kept_share >= 1.0 - value - 1e-12)
            return float(t[ok[-1]]) if ok.size else float(t[0])
        if mode == "min_local_recall":
            ok = np.flatnonzero(self.local_recall >= value - 1e-12)
            return float(t[ok[-1]]) if ok.size else float(t[0])
        raise ValueError(f"unknown threshold mode {mode!r}: expected one of {', '.join(MODES)}")


@dataclass(frozen=True, slots=True)
class DefaultThresholds:
    """The shipped policy: route to the edge when prior >= gate, keep its answer when confidence >= confidence.

    `prior_only` is the threshold a router without a cascade would use for the same accuracy target.
    """

    target_local_accuracy: float
    gate: float
    confidence: float
    prior_only: float


class EdgeCalibration:
    """A loaded calibration artifact; inference is numpy only (tens of microseconds, no embedding)."""

    def __init__(self, params: Mapping[str, np.ndarray], manifest: Mapping[str, Any], directory: Path | None = None) -> None:
        self.manifest = dict(manifest)
        self.directory = directory
        self._prior_w = np.asarray(params["prior_w_embedding"], dtype=np.float64)
        self._prior_wf = np.asarray(params["prior_w_features"], dtype=np.float64)
        self._prior_mu = np.asarray(params["prior_mean"], dtype=np.float64)
        self._prior_sd = np.asarray(params["prior_scale"], dtype=np.float64)
        self._prior_b = float(np.asarray(params["prior_bias"]).reshape(-1)[0])
        self._conf_w = np.asarray(params["confidence_w"], dtype=np.float64)
        self._conf_mu = np.asarray(params["confidence_mean"], dtype=np.float64)
        self._conf_sd = np.asarray(params["confidence_scale"], dtype=np.float64)
        self._conf_b = float(np.asarray(params["confidence_bias"]).reshape(-1)[0])
        curves = self.manifest.get("curves") or {}
        try:
            self._curves = {stage: Curve.from_manifest(curves[stage]) for stage in ("prior", "confidence")}
            d = self.manifest["defaults"]
            self.defaults = DefaultThresholds(
                target_local_accuracy=float(d["target_local_accuracy"]),
                gate=_threshold(d["gate"]),
                confidence=_threshold(d["confidence"]),
                prior_only=_threshold(d["prior_only"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EdgeCalibrationError(f"edge calibration manifest lacks curves or defaults: {exc}") from exc
        self._matched: dict[tuple[str, int, int], bool] = {}

    @classmethod
    def load(cls, path: str | Path | None = None) -> EdgeCalibration:
        """Load and verify an artifact directory (or its manifest.json); None: the shipped one."""
        params, manifest, directory = load_artifact(path)
        try:
            return cls(params, manifest, directory)
        except KeyError as exc:
            raise EdgeCalibrationError(f"edge calibration weights lack {exc}") from exc

    # ---- which model it describes ---------------------------------------------------------

    @property
    def gguf_name(self) -> str:
        return str((self.manifest.get("gguf") or {}).get("file", ""))

    @property
    def gguf_sha256(self) -> str:
        return str((self.manifest.get("gguf") or {}).get("sha256", ""))

    def matches(self, model_path: str | Path) -> bool:
        """Whether `model_path` is the very GGUF file this calibration measured (by size, then sha256).

        The hash is computed once per file version (path, size, mtime) and remembered.
        """
        path = Path(model_path)
        try:
            st = path.stat()
        except OSError:
            return False
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in self._matched:
            size = (self.manifest.get("gguf") or {}).get("size")
            self._matched[key] = (size is None or int(size) == st.st_size) and sha256_file(path) == self.gguf_sha256
        return self._matched[key]

    # ---- the two scores ---------------------------------------------------------------------

    def prior(self, text: str, embedding: np.ndarray) -> float:
        """P(edge answer correct | prompt). `text`: what the gateway embeds (last user turn, normalised);
        `embedding`: its 384-d L2-normalised all-MiniLM-L6-v2 vector."""
        feats = (prompt_features(text) - self._prior_mu) / self._prior_sd
        z = float(np.dot(self._prior_w, np.asarray(embedding, dtype=np.float64).reshape(-1)))
        return _sigmoid(z + float(np.dot(self._prior_wf, feats)) + self._prior_b)

    def prior_batch(self, texts: Sequence[str], embeddings: np.ndarray) -> np.ndarray:
        feats = (np.stack([prompt_features(t) for t in texts]) - self._prior_mu) / self._prior_sd
        z = np.asarray(embeddings, dtype=np.float64) @ self._prior_w + feats @ self._prior_wf + self._prior_b
        return np.asarray(1.0 / (1.0 + np.exp(-z)), dtype=np.float64)

    def confidence(self, prior: float, tokens: Sequence[TokenStat], finish_reason: str) -> float:
        """P(edge answer correct | prior, the answer's tokens); 0 for an answer that did not end on its own."""
        logprobs, entropies = token_arrays(tokens)
        return self.confidence_from_arrays(prior, logprobs, entropies, finish_reason)

    def confidence_from_arrays(
        self, prior: float, logprobs: Sequence[float], entropies: Sequence[float], finish_reason: str
    ) -> float:
        if finish_reason != FINISHED or not logprobs:
            return 0.0
        x = (answer_features(prior, logprobs, entropies) - self._conf_mu) / self._conf_sd
        return _sigmoid(float(np.dot(self._conf_w, x)) + self._conf_b)

    # ---- thresholds -----------------------------------------------------------------------------

    def curve(self, stage: Stage) -> Curve:
        return self._curves[stage]

    def threshold(self, stage: Stage, mode: str, value: float) -> float:
        """The score threshold for a policy target on one stage ("prior" or "confidence").

        mode "min_local_accuracy" (e.g. 0.90: accuracy of what is kept local), "max_escalation_share"
        (share sent upstream at most), "min_local_recall" (share of the edge's correct answers kept).
        Keep local when score >= threshold; math.inf means no threshold meets the target.
        """
        if stage not in self._curves:
            raise ValueError(f"unknown stage {stage!r}: expected 'prior' or 'confidence'")
        return self._curves[stage].threshold(mode, value)


def load_for_model(model_path: str | Path, path: str | Path | None = None) -> EdgeCalibration | None:
    """The calibration for the configured GGUF, or None (logged) when it is missing, broken or for another model.

    None means "no edge prior": the caller routes and keeps answers without these scores.
    """
    try:
        calibration = EdgeCalibration.load(path)
    except EdgeCalibrationError as exc:
        log.warning("edge calibration unavailable, running without an edge prior: %s", exc)
        return None
    if not calibration.matches(model_path):
        log.warning(
            "edge calibration was measured on %s (sha256 %s...), not on %s; running without an edge prior. %s",
            calibration.gguf_name, calibration.gguf_sha256[:12], os.fspath(model_path),
            "Calibrate this model with `tierlane edge calibrate --model GGUF --out DIR`.",
        )
        return None
    return calibration
