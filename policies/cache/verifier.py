"""The previous cache verifier: a small MLP over the two embeddings and lexical pair features.

No longer on the serving path (the cross-encoder of policies/cache/cross_encoder.py replaced it:
this model reached QQP precision 0.98 only at recall 0.02). Kept, with its artifact, as the
baseline bench/cache_quality.py reports beside the cross-encoder on the same pairs. Inputs, all
symmetric in the two texts:

- u*v and |u-v| of the two L2-normalised all-MiniLM-L6-v2 vectors (384 each): the lookup already
  has both, the query's from the embedder and the candidate's from the vector index;
- cosine, and lexical features: word and content-word overlap, unmatched content words, length
  ratio, mismatched numbers, named entities, negations, question words (who / when / where / how
  many ...), opposite words and swapped direction.

Two scorers, an MLP over the whole pair vector and gradient-boosted trees over the lexical
features, combined by a logistic calibration fitted on the selection split. Inference is plain
numpy and Python (no scikit-learn at run time). The artifact is an .npz written by
policies/cache/verifier_train.py; see policies/cache/MODEL_CARD.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from policies.cache.verify import STOPWORDS, Features, VerifyConfig, _opposed, _stem, features

BUNDLED = Path(__file__).resolve().parent / "artifacts" / "verifier.npz"
# The probability the previous policy served at (chosen on the selection split for precision >= 0.97).
PREVIOUS_MIN_PROBABILITY = 0.96
FORMAT = 1

_QUESTION_WORDS = ("who", "whom", "whose", "what", "when", "where", "why", "which", "how")
_HOW_OF = frozenset("many much long old often far big large fast tall".split())

LEXICAL_NAMES: tuple[str, ...] = (
    "cosine",
    "jaccard_words",
    "jaccard_content",
    "unmatched_content_min",
    "unmatched_content_max",
    "unmatched_content_count",
    "length_ratio",
    "length_log_mean",
    "numbers_mismatch",
    "numbers_any",
    "entities_unmatched",
    "entities_any",
    "negation_diff",
    "question_word_mismatch",
    "question_word_any",
    "opposites",
    "direction",
    "same_content",
)


class PairText:
    """What the lexical features need of one text, extracted once (the query's is reused per candidate)."""

    __slots__ = ("features", "content", "questions")

    def __init__(self, text: str, cfg: VerifyConfig) -> None:
        if not (cfg.entities and cfg.direction):
            # The model was trained with every feature extracted; a check switched off only stops its veto.
            cfg = dataclasses.replace(cfg, entities=True, direction=True)
        self.features: Features = features(text, cfg)
        tokens = self.features.tokens
        self.content = {_stem(t) for t in tokens if t not in STOPWORDS}
        self.questions = _question_words(tokens)


def _question_words(tokens: list[str]) -> frozenset[str]:
    found: set[str] = set()
    for i, token in enumerate(tokens):
        if token in _QUESTION_WORDS:
            if token == "how" and i + 1 < len(tokens) and tokens[i + 1] in _HOW_OF:
                found.add("how " + tokens[i + 1])
            elif token in ("whom", "whose"):
                found.add("who")
            else:
                found.add(token)
    return frozenset(found)


def _jaccard(a: set[str], b: set[str]) -> float:
    union = len(a | b)
    return len(a & b) / union if union else 1.0


def lexical(cosine: float, a: PairText, b: PairText, cfg: VerifyConfig) -> list[float]:
    """The lexical pair features, in LEXICAL_NAMES order; symmetric in a and b."""
    fa, fb = a.features, b.features
    ca, cb = a.content, b.content
    only_a = len(ca - cb) / len(ca) if ca else 0.0
    only_b = len(cb - ca) / len(cb) if cb else 0.0
    na, nb = len(fa.tokens), len(fb.tokens)
    entities = len(fa.entities - fb.vocabulary) + len(fb.entities - fa.vocabulary)
    direction = any(
        (y, x) in fb.relations and (x, y) not in fb.relations and (y, x) not in fa.relations for x, y in fa.relations
    )
    return [
        cosine,
        _jaccard(fa.vocabulary, fb.vocabulary),
        _jaccard(ca, cb),
        min(only_a, only_b),
        max(only_a, only_b),
        math.log1p(len(ca ^ cb)),
        min(na, nb) / max(na, nb) if max(na, nb) else 1.0,
        (math.log1p(na) + math.log1p(nb)) / 2,
        float(fa.numbers != fb.numbers),
        float(bool(fa.numbers) or bool(fb.numbers)),
        math.log1p(entities),
        float(bool(fa.entities) or bool(fb.entities)),
        float(abs(fa.negations - fb.negations)),
        float(a.questions != b.questions),
        float(bool(a.questions) or bool(b.questions)),
        float(_opposed(fa, fb, cfg)),
        float(direction),
        float(ca == cb),
    ]


def pair_vector(u: np.ndarray, v: np.ndarray, a: PairText, b: PairText, cfg: VerifyConfig) -> np.ndarray:
    """The model's input for one pair: u*v, |u-v|, then the lexical features (float32)."""
    u = np.asarray(u, dtype=np.float32).reshape(-1)
    v = np.asarray(v, dtype=np.float32).reshape(-1)
    cosine = float(u @ v)
    return np.concatenate([u * v, np.abs(u - v), np.asarray(lexical(cosine, a, b, cfg), dtype=np.float32)])


class VerifierModel:
    """Two scorers and their calibration, from an .npz artifact.

    - an MLP (standardised inputs, one ReLU layer) over the whole pair vector: what the
      embeddings say;
    - gradient-boosted trees over the lexical features alone: numbers, names, question words;
    - a logistic calibration of the two logits, fitted on the selection split over the pairs a
      lookup verifies (past the cosine threshold and the rule vetoes): the probability the policy
      compares with `min_probability`.
    """

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.arrays = arrays
        self.meta = meta
        mean, scale = arrays["mean"].astype(np.float32), arrays["scale"].astype(np.float32)
        w0 = arrays["w0"].astype(np.float32)
        # The standardisation folded into the first layer: one matmul per call.
        self._w = (w0 / scale[:, None]).astype(np.float32)
        self._b = (arrays["b0"].astype(np.float32) - (mean / scale) @ w0).astype(np.float32)
        self._w1 = arrays["w1"].astype(np.float32).reshape(-1)
        self._b1 = float(arrays["b1"].reshape(-1)[0])
        # Trees as plain lists: a Python walk of ~100 shallow trees beats numpy for one row.
        self._roots: list[int] = arrays["tree_roots"].astype(np.int64).tolist()
        self._feature: list[int] = arrays["tree_feature"].astype(np.int64).tolist()
        self._threshold: list[float] = arrays["tree_threshold"].astype(np.float64).tolist()
        self._left: list[int] = arrays["tree_left"].astype(np.int64).tolist()
        self._right: list[int] = arrays["tree_right"].astype(np.int64).tolist()
        self._leaf: list[bool] = arrays["tree_leaf"].astype(bool).tolist()
        self._value: list[float] = arrays["tree_value"].astype(np.float64).tolist()
        self._tree_base = float(arrays["tree_baseline"].reshape(-1)[0])
        self.calibration = [float(c) for c in arrays["calibration"].reshape(-1)]  # bias, mlp, trees

    @property
    def inputs(self) -> int:
        return int(self._w.shape[0])

    def mlp_logits(self, x: np.ndarray) -> np.ndarray:
        hidden = np.maximum(np.atleast_2d(np.asarray(x, dtype=np.float32)) @ self._w + self._b, 0.0)
        return np.asarray(hidden @ self._w1 + self._b1, dtype=np.float64)

    def tree_logit(self, lexical_row: list[float]) -> float:
        total = self._tree_base
        feature, threshold, left, right, leaf, value = (
            self._feature, self._threshold, self._left, self._right, self._leaf, self._value
        )
        for node in self._roots:
            while not leaf[node]:
                node = left[node] if lexical_row[feature[node]] <= threshold[node] else right[node]
            total += value[node]
        return total

    def tree_logits(self, x: np.ndarray) -> np.ndarray:
        rows = np.atleast_2d(np.asarray(x, dtype=np.float64))[:, 2 * 384 :]
        return np.asarray([self.tree_logit(row) for row in rows.tolist()], dtype=np.float64)

    def calibrate(self, mlp: np.ndarray, trees: np.ndarray) -> np.ndarray:
        bias, a, b = self.calibration
        z = np.clip(bias + a * mlp + b * trees, -60.0, 60.0)
        return np.asarray(1.0 / (1.0 + np.exp(-z)), dtype=np.float64)

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        """Calibrated probabilities for rows of pair vectors."""
        return self.calibrate(self.mlp_logits(x), self.tree_logits(x))

    def probability(self, x: np.ndarray) -> float:
        """The calibrated probability for one pair vector."""
        bias, a, b = self.calibration
        mlp = float(self.mlp_logits(x)[0])
        trees = self.tree_logit(np.asarray(x, dtype=np.float64)[2 * 384 :].tolist())
        z = min(max(bias + a * mlp + b * trees, -60.0), 60.0)
        return 1.0 / (1.0 + math.exp(-z))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, Any] = {**self.arrays, "meta": np.asarray(json.dumps(self.meta, sort_keys=True))}
        np.savez_compressed(path, **arrays)


@lru_cache(maxsize=8)
def load_verifier(path: str) -> VerifierModel:
    """The model in an .npz artifact (memoised per path); ValueError when it is not one this code reads."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    meta = json.loads(str(arrays.pop("meta"))) if "meta" in arrays else {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: verifier artifact format {meta.get('format')!r}, expected {FORMAT}")
    model = VerifierModel(arrays, meta)
    expected = 2 * 384 + len(LEXICAL_NAMES)
    if max(model._feature, default=0) >= len(LEXICAL_NAMES):
        raise ValueError(f"{path}: the trees read a lexical feature this code does not make")
    if model.inputs != expected:
        raise ValueError(f"{path}: verifier takes {model.inputs} inputs, this code makes {expected}")
    return model
