"""Train, calibrate and select the previous cache verifier (development time; scikit-learn).

    HF_HUB_OFFLINE=1 .venv/bin/python -m policies.cache.verifier_train

The model this writes no longer serves (policies/cache/cross_encoder_train.py builds the
verifier the gateway runs, `make cache-verifier`); it is the baseline bench/cache_quality.py
reports beside it.

1. Pairs of QQP, STS-B dev and GPTCache with their component splits (verifier_data.py); each text
   embedded once with the gateway's encoder (kept under /tmp between runs).
2. On the train split of all three sources (pairs with cosine >= 0.75, the small sources
   up-weighted): an MLP (one ReLU layer) over the whole pair vector, and gradient-boosted trees
   over the lexical features.
3. A logistic calibration of the two logits is fitted on the selection split, over the pairs a
   lookup verifies (cosine >= the policy threshold, no rule veto): the probability the policy reads.
4. The policy's `min_probability` is chosen on the selection split: the lowest value from which
   precision stays >= 0.975 on every source (>= 20 pairs served), with the policy's cosine
   threshold and the rule vetoes applied as matcher.decide applies them. Test is never looked at
   here; bench/cache_quality.py reports it, through matcher.decide itself.

Writes policies/cache/artifacts/verifier.npz and prints the selection figures.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from policies.cache.verifier import BUNDLED, FORMAT, LEXICAL_NAMES, PairText, VerifierModel, pair_vector
from policies.cache.verifier_data import SPLITS, STSB_POSITIVE_MIN, EmbeddingCache, Pair, load_all
from policies.cache.verify import VerifyConfig, mismatch
from policies.embedding.embedder import PRECISIONS, vector_space

DEFAULT_EMBEDDINGS = Path("/tmp/tierlane_verifier/emb.npz")
SOURCES = ("qqp", "stsb", "gptcache")
TARGET_PRECISION = 0.97
SELECTION_MARGIN = 0.005  # selection must show target + margin: test is a fresh sample
MIN_SERVED = 20  # a precision over fewer served pairs is noise, not evidence
SOURCE_WEIGHT = {"qqp": 1.0, "stsb": 4.0, "gptcache": 2.0}
TRAIN_MIN_COSINE = 0.75
TREES = 100
LEXICAL = slice(2 * 384, None)


@dataclass(slots=True)
class Matrix:
    """Pair vectors and what the gateway's decision needs besides the model."""

    pairs: list[Pair]
    x: np.ndarray
    y: np.ndarray
    cosine: np.ndarray
    vetoed: np.ndarray  # a rule check of verify.py fails (numbers, negation, entities, ...)
    source: np.ndarray
    split: np.ndarray


def build(pairs: Sequence[Pair], embed: EmbeddingCache, cfg: VerifyConfig) -> Matrix:
    from tqdm import tqdm

    texts: dict[str, PairText] = {}

    def text(t: str) -> PairText:
        found = texts.get(t)
        if found is None:
            found = texts[t] = PairText(t, cfg)
        return found

    u = embed([p.a for p in pairs])
    v = embed([p.b for p in pairs])
    rows, vetoed = [], []
    for i, p in enumerate(tqdm(pairs, desc="pair features", unit="pair", mininterval=2.0)):
        a, b = text(p.a), text(p.b)
        rows.append(pair_vector(u[i], v[i], a, b, cfg))
        vetoed.append(mismatch(a.features, b.features, cfg) is not None)
    return Matrix(
        pairs=list(pairs), x=np.stack(rows), y=np.asarray([p.label for p in pairs], np.int64),
        cosine=np.einsum("ij,ij->i", u, v), vetoed=np.asarray(vetoed),
        source=np.asarray([p.source for p in pairs]), split=np.asarray([p.split for p in pairs]),
    )  # fmt: skip


def _weights(m: Matrix, rows: np.ndarray) -> np.ndarray:
    return np.asarray([SOURCE_WEIGHT[s] for s in m.source[rows]])


def fit_mlp(m: Matrix, rows: np.ndarray, hidden: int, alpha: float, seed: int = 0) -> tuple[Any, Any]:
    """An sklearn MLP on `rows` (features standardised); returns (scaler, mlp)."""
    from sklearn.neural_network import MLPClassifier
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(m.x[rows])
    mlp = MLPClassifier(
        hidden_layer_sizes=(hidden,), alpha=alpha, batch_size=256, learning_rate_init=1e-3, max_iter=40,
        early_stopping=True, validation_fraction=0.1, n_iter_no_change=4, random_state=seed,
    )  # fmt: skip
    mlp.fit(scaler.transform(m.x[rows]), m.y[rows], sample_weight=_weights(m, rows))
    return scaler, mlp


def fit_trees(m: Matrix, rows: np.ndarray, seed: int = 0) -> Any:
    """Gradient-boosted trees on the lexical features of `rows`."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    trees = HistGradientBoostingClassifier(max_iter=TREES, learning_rate=0.1, max_depth=5, random_state=seed)
    trees.fit(m.x[rows][:, LEXICAL], m.y[rows], sample_weight=_weights(m, rows))
    return trees


def flat_trees(hgb: Any) -> dict[str, np.ndarray]:
    """Every tree's nodes in flat arrays (children as global indices), for VerifierModel's walk."""
    if getattr(hgb, "is_categorical_", None) is not None and np.any(hgb.is_categorical_):
        raise ValueError("categorical features are not supported")
    roots: list[int] = []
    feature: list[int] = []
    threshold: list[float] = []
    left: list[int] = []
    right: list[int] = []
    leaf: list[bool] = []
    value: list[float] = []
    for stage in hgb._predictors:
        nodes = stage[0].nodes
        offset = len(feature)
        roots.append(offset)
        feature += nodes["feature_idx"].tolist()
        threshold += nodes["num_threshold"].tolist()
        left += (nodes["left"] + offset).tolist()
        right += (nodes["right"] + offset).tolist()
        leaf += nodes["is_leaf"].astype(bool).tolist()
        value += nodes["value"].tolist()
    return {
        "tree_roots": np.asarray(roots, np.int32), "tree_feature": np.asarray(feature, np.int16),
        "tree_threshold": np.asarray(threshold, np.float64), "tree_left": np.asarray(left, np.int32),
        "tree_right": np.asarray(right, np.int32), "tree_leaf": np.asarray(leaf, bool),
        "tree_value": np.asarray(value, np.float64),
        "tree_baseline": np.asarray([float(np.ravel(hgb._baseline_prediction)[0])]),
    }  # fmt: skip


def to_model(scaler: Any, mlp: Any, hgb: Any, calibration: Sequence[float], meta: dict[str, Any]) -> VerifierModel:
    scale = np.where(scaler.scale_ > 0, scaler.scale_, 1.0)
    arrays = {
        "mean": scaler.mean_.astype(np.float32), "scale": scale.astype(np.float32),
        "w0": mlp.coefs_[0].astype(np.float32), "b0": mlp.intercepts_[0].astype(np.float32),
        "w1": mlp.coefs_[1].astype(np.float32).reshape(-1), "b1": mlp.intercepts_[1].astype(np.float32),
        "calibration": np.asarray(calibration, np.float64), **flat_trees(hgb),
    }  # fmt: skip
    return VerifierModel(arrays, meta)


def fit_calibration(mlp: np.ndarray, trees: np.ndarray, y: np.ndarray) -> list[float]:
    """Logistic regression of the label on the two logits: (bias, mlp weight, trees weight)."""
    from sklearn.linear_model import LogisticRegression

    lr = LogisticRegression(C=1.0).fit(np.column_stack([mlp, trees]), y)
    return [float(lr.intercept_[0]), float(lr.coef_[0, 0]), float(lr.coef_[0, 1])]


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def served(m: Matrix, prob: np.ndarray, threshold: float, min_probability: float, vetoes: bool) -> np.ndarray:
    """What the gateway would serve: cosine threshold, then the rule vetoes, then the verifier."""
    ok = (m.cosine >= threshold) & (prob >= min_probability)
    return ok & ~m.vetoed if vetoes else ok


def figures(hit: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    tp = int((hit & (y == 1)).sum())
    fp = int((hit & (y == 0)).sum())
    pos = int((y == 1).sum())
    return {"precision": round(tp / (tp + fp), 4) if tp + fp else None, "recall": round(tp / pos, 4) if pos else None,
            "served": tp + fp, "true_hits": tp, "false_hits": fp, "positives": pos, "pairs": int(len(y))}  # fmt: skip


def choose_min_probability(
    m: Matrix, prob: np.ndarray, threshold: float, vetoes: bool, split: str = "selection",
    target: float = TARGET_PRECISION + SELECTION_MARGIN,
) -> float | None:  # fmt: skip
    """The lowest grid value from which precision >= target on every source (served >= MIN_SERVED)."""
    grid = np.round(np.arange(0.500, 0.9995, 0.001), 3)
    ok_from: float | None = None
    for t in grid[::-1]:
        good = True
        for source in SOURCES:
            rows = (m.split == split) & (m.source == source)
            hit = served(m, prob, threshold, float(t), vetoes)[rows]
            y = m.y[rows]
            n = int(hit.sum())
            if n >= MIN_SERVED and (hit & (y == 1)).sum() / n < target:
                good = False
                break
        if not good:
            break
        ok_from = float(t)
    return ok_from


def report(m: Matrix, prob: np.ndarray, threshold: float, min_probability: float, vetoes: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    hit = served(m, prob, threshold, min_probability, vetoes)
    for split in SPLITS:
        for source in SOURCES:
            rows = (m.split == split) & (m.source == source)
            out.setdefault(split, {})[source] = figures(hit[rows], m.y[rows])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="train the cache verifier")
    parser.add_argument("--embeddings", type=Path, default=DEFAULT_EMBEDDINGS, help="embedding cache (.npz)")
    parser.add_argument("--out", type=Path, default=BUNDLED)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=1e-3)
    parser.add_argument("--threshold", type=float, default=0.82, help="the policy's cosine threshold")
    parser.add_argument("--augment", action="store_true", help="add train-only repeats and light edits (verifier_data.augment)")
    parser.add_argument("--matrix", type=Path, help="reuse (or write) the pair matrix here (a pickle, for development)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS,
                        help="the embedder precision whose vectors the verifier reads (pairs are built from float32 ones "
                             "either way, so both precisions train on the same pairs); int8 keeps its vectors in "
                             "<embeddings>-int8.npz")  # fmt: skip
    args = parser.parse_args(argv)
    from tqdm import tqdm

    started = time.time()
    cfg = VerifyConfig.from_policy({})
    if args.matrix is not None and args.matrix.exists():
        m = pickle.loads(args.matrix.read_bytes())
    else:
        embed = EmbeddingCache(args.embeddings)
        pairs = load_all(embed, with_augment=args.augment)
        m = build(pairs, EmbeddingCache.for_precision(args.embeddings, args.precision), cfg)
        if args.matrix is not None:
            args.matrix.write_bytes(pickle.dumps(m))
    # Fitted where the decision is hard: pairs near or past the cosine threshold.
    train = (m.split == "train") & (m.cosine >= TRAIN_MIN_COSINE)
    # Calibrated on what a lookup verifies: selection pairs past the threshold and the rule vetoes.
    verified = (m.split == "selection") & (m.cosine >= args.threshold) & ~m.vetoed
    steps = tqdm(total=3, desc="fit", unit="step")
    scaler, mlp = fit_mlp(m, train, args.hidden, args.alpha)
    steps.update()
    hgb = fit_trees(m, train)
    steps.update()
    raw = to_model(scaler, mlp, hgb, [0.0, 1.0, 1.0], {})
    mlp_logit, tree_logit = raw.mlp_logits(m.x), raw.tree_logits(m.x)
    calibration = fit_calibration(mlp_logit[verified], tree_logit[verified], m.y[verified])
    steps.update()
    steps.close()
    meta: dict[str, Any] = {
        "format": FORMAT, "features": ["u*v[384]", "|u-v|[384]", *LEXICAL_NAMES],
        "mlp": {"hidden": args.hidden, "alpha": args.alpha, "epochs": int(mlp.n_iter_)},
        "trees": {"max_iter": TREES, "max_depth": 5, "learning_rate": 0.1, "inputs": list(LEXICAL_NAMES)},
        "trained_on": f"train split (cosine >= {TRAIN_MIN_COSINE}) of qqp_train_pairs.json, STS-B dev, GPTCache mock pairs",
        "calibrated_on": f"selection split, pairs with cosine >= {args.threshold} that pass the rule vetoes",
        "stsb_positive_min": STSB_POSITIVE_MIN, "source_weight": SOURCE_WEIGHT, "embedding_model": "all-MiniLM-L6-v2",
        "vectors": vector_space(args.precision),
        "splits": "connected text components per source, seeded hash (verifier_data.py)", "augment": args.augment,
    }  # fmt: skip
    model = to_model(scaler, mlp, hgb, calibration, meta)
    prob = model.calibrate(mlp_logit, tree_logit)
    sel = m.split == "selection"
    tqdm.write(f"selection log-loss (verified pairs) {log_loss(prob[verified], m.y[verified]):.4f}; all {log_loss(prob[sel], m.y[sel]):.4f}")
    t = choose_min_probability(m, prob, args.threshold, vetoes=True)
    figures_at = report(m, prob, args.threshold, t, True)["selection"] if t is not None else None
    tqdm.write(f"min_probability {t} (precision >= {TARGET_PRECISION + SELECTION_MARGIN} on every source's selection split)")
    tqdm.write(json.dumps(figures_at))
    meta["selection"] = {"min_probability": t, "target_precision": TARGET_PRECISION + SELECTION_MARGIN,
                         "min_served": MIN_SERVED, "figures": figures_at}  # fmt: skip
    model.meta = meta
    model.save(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes) in {time.time() - started:.0f} s; "
          f"set cache.verify.min_probability to {t}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
