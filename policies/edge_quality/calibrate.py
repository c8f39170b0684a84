"""`tierlane edge calibrate`: run the edge model over the probe set, fit both models, choose thresholds.

1. Every probe (calibration and held-out split) is answered by EdgeEngine, greedy, at most
   `MAX_TOKENS` tokens, and checked (runner.py, checkers.py).
2. Prior: logistic regression on [embedding * scale, standardised prompt features]; C and the
   embedding scale chosen by 5-fold cross-validated log loss on the calibration split only.
3. Confidence: logistic regression on the answer features (features.ANSWER_FEATURES) of answers
   that ended on their own, with the prior taken out-of-fold so the confidence model learns how
   much a *fresh* prior is worth; C chosen the same way.
4. Curves and thresholds from out-of-fold calibration scores only.
5. Held-out split: scored once with the final models and reported (never used above). As a
   stress test, each family is also scored by models fitted without it (leave-one-family-out).

With a time budget (`budget_s`) probes run in an order that spreads over splits and families,
none starts once the budget is spent, and the fit uses what was answered; the manifest's `run`
block says whether the run was cut short and how many probes it used. Fewer answered
calibration probes than `min_probes` (or than were asked for, if fewer) is an error: no artifact.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from policies.artifact_dir import sha256_file
from policies.edge_quality.artifact import library_versions, save_artifact
from policies.edge_quality.evaluate import ItemOutcome, auroc, full_report, token_signals
from policies.edge_quality.features import ANSWER_FEATURES, PROMPT_FEATURES, answer_features, prompt_features
from policies.edge_quality.model import Curve, EdgeCalibration
from policies.edge_quality.probes import FAMILIES, Probe, load_probes, probe_set_hash
from policies.edge_quality.runner import MAX_TOKENS, EdgeRecord, run_probes

if TYPE_CHECKING:
    from edge_engine import EdgeEngine

log = logging.getLogger(__name__)

FOLDS = 5
PRIOR_GRID = tuple((c, s) for c in (0.003, 0.01, 0.03, 0.1) for s in (1.0, 2.0, 4.0))
CONFIDENCE_GRID = (0.03, 0.1, 0.3, 1.0, 3.0)
CURVE_POINTS = 401
MIN_KEPT = 20  # accuracy points resting on fewer kept items are not trusted (see model.Curve)
GATE_RECALL = 0.95  # the prior gate keeps 95% of the calibration items the edge gets right
DEFAULT_TARGET = 0.90
TARGET_TABLE = (0.70, 0.75, 0.80, 0.85, 0.90)  # min_local_accuracy targets whose held-out figures are reported
# Curves may report a Wilson lower bound of the local accuracy instead of the ratio (z > 0). With
# the bundled model the calibration precision plateaus near 0.85 below ~30% local recall, so any
# margin (z = 0.5 already) leaves no threshold for a 0.90 target: the point estimate is used, and
# MIN_KEPT plus the envelope (model.Curve) are the only guards against small-count flukes.
CURVE_Z = 0.0
EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
MIN_PROBES = 50  # answered calibration-split probes a run cut short by its budget must still have


class CalibrationTooShort(ValueError):
    """Too few probes were answered (the time budget ran out) to fit a calibration worth writing."""


@dataclass(slots=True)
class CalibrationConfig:
    model_path: Path | None = None  # None: the bundled SmolLM2 GGUF
    out: Path | None = None  # artifact directory; None: write nothing
    seed: int = 13
    limit: int | None = None  # at most this many probes per split, spread over families
    threads: int = 1
    concurrency: int = 8
    target: float = DEFAULT_TARGET
    cache: Path | None = field(default_factory=lambda: Path(".tierlane/cache/edge_quality/records.jsonl"))
    probes_path: Path | None = None
    budget_s: float | None = None  # stop starting probes after this many seconds; None: run them all
    min_probes: int = MIN_PROBES  # fewest answered calibration probes to write from (capped at those asked for)


def resolve_model(path: Path | None) -> Path:
    from edge_engine import bundled_model_path

    return Path(path) if path is not None else bundled_model_path()


def limit_probes(probes: Sequence[Probe], limit: int | None) -> list[Probe]:
    """At most `limit` probes per split, taken round-robin over families in file order."""
    if limit is None:
        return list(probes)
    out: list[Probe] = []
    for split in ("calibration", "held_out"):
        by_family = {f: [p for p in probes if p.split == split and p.family == f] for f in FAMILIES}
        taken = 0
        depth = 0
        while taken < limit and any(depth < len(v) for v in by_family.values()):
            for f in FAMILIES:
                if depth < len(by_family[f]) and taken < limit:
                    out.append(by_family[f][depth])
                    taken += 1
            depth += 1
    return out


def embedding_texts(probes: Sequence[Probe]) -> list[str]:
    """What the gateway embeds for each probe's request (last user turn, normalised)."""
    from policies.cache.scope import embedding_text

    return [embedding_text({"messages": p.messages}) or "" for p in probes]


def embed(texts: Sequence[str], cache_dir: Path | None) -> np.ndarray:
    """all-MiniLM-L6-v2 vectors as the gateway computes them (policies.embedding.embedder.load_encoder), cached."""
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16]
    path = cache_dir / f"embeddings-{digest}.npy" if cache_dir is not None else None
    if path is not None and path.is_file():
        return np.asarray(np.load(path), dtype=np.float32)
    from policies.embedding.embedder import load_encoder

    encoder = load_encoder()
    rows = [encoder.encode(list(texts[i : i + 64])) for i in range(0, len(texts), 64)]
    vectors = np.asarray(np.concatenate(rows), dtype=np.float32)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, vectors)
    return vectors


# ---- fitting ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Linear:
    """A fitted logistic regression in the artifact's terms: raw inputs -> probability."""

    w: np.ndarray
    mean: np.ndarray
    scale: np.ndarray
    bias: float

    def score(self, x: np.ndarray) -> np.ndarray:
        z = ((x - self.mean) / self.scale) @ self.w + self.bias
        return np.asarray(1.0 / (1.0 + np.exp(-z)), dtype=np.float64)


def _fit_lr(x: np.ndarray, y: np.ndarray, c: float, standardise: np.ndarray) -> Linear:
    """Logistic regression; columns where `standardise` is set are centred and scaled first."""
    from sklearn.linear_model import LogisticRegression

    if len(x) == 0:
        return Linear(np.zeros(x.shape[1]), np.zeros(x.shape[1]), np.ones(x.shape[1]), 0.0)
    mean = np.where(standardise, x.mean(axis=0), 0.0)
    scale = np.where(standardise, x.std(axis=0), 1.0)
    scale = np.where(scale < 1e-9, 1.0, scale)
    model = LogisticRegression(C=c, max_iter=5000, tol=1e-8)
    if len(set(y.tolist())) < 2:
        prior = float(np.clip(y.mean(), 1e-3, 1 - 1e-3))
        return Linear(np.zeros(x.shape[1]), mean, scale, math.log(prior / (1 - prior)))
    model.fit((x - mean) / scale, y.astype(int))
    return Linear(np.asarray(model.coef_[0], dtype=np.float64), mean, scale, float(model.intercept_[0]))


def _folds(y: np.ndarray, groups: Sequence[str], seed: int, k: int = FOLDS) -> list[np.ndarray]:
    """Stratified by family and label: each fold holds a share of every family's right and wrong items."""
    rng = np.random.default_rng(seed)
    fold_of = np.zeros(len(y), dtype=int)
    keys = sorted({(g, bool(v)) for g, v in zip(groups, y)})
    for key in keys:
        idx = np.asarray([i for i, (g, v) in enumerate(zip(groups, y)) if (g, bool(v)) == key])
        rng.shuffle(idx)
        fold_of[idx] = (np.arange(len(idx)) + rng.integers(k)) % k
    return [np.flatnonzero(fold_of == f) for f in range(k)]


def _log_loss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def prior_design(embeddings: np.ndarray, texts: Sequence[str], emb_scale: float) -> tuple[np.ndarray, np.ndarray]:
    feats = np.stack([prompt_features(t) for t in texts]) if texts else np.zeros((0, len(PROMPT_FEATURES)))
    x = np.hstack([np.asarray(embeddings, dtype=np.float64) * emb_scale, feats])
    standardise = np.concatenate([np.zeros(embeddings.shape[1], dtype=bool), np.ones(len(PROMPT_FEATURES), dtype=bool)])
    return x, standardise


def fit_prior(embeddings: np.ndarray, texts: Sequence[str], y: np.ndarray, c: float, emb_scale: float) -> Linear:
    x, standardise = prior_design(embeddings, texts, emb_scale)
    return _fit_lr(x, y, c, standardise)


def prior_scores(model: Linear, embeddings: np.ndarray, texts: Sequence[str], emb_scale: float) -> np.ndarray:
    x, _ = prior_design(embeddings, texts, emb_scale)
    return model.score(x)


def oof_prior(
    embeddings: np.ndarray, texts: Sequence[str], y: np.ndarray, folds: list[np.ndarray], c: float, emb_scale: float
) -> np.ndarray:
    out = np.zeros(len(y))
    for test in folds:
        train = np.setdiff1d(np.arange(len(y)), test)
        model = fit_prior(embeddings[train], [texts[i] for i in train], y[train], c, emb_scale)
        out[test] = prior_scores(model, embeddings[test], [texts[i] for i in test], emb_scale)
    return out


def answer_matrix(records: Sequence[EdgeRecord], priors: np.ndarray) -> np.ndarray:
    if not records:
        return np.zeros((0, len(ANSWER_FEATURES)))
    return np.stack([answer_features(float(p), r.logprobs, r.entropies) for r, p in zip(records, priors)])


def _finished(records: Sequence[EdgeRecord]) -> np.ndarray:
    return np.asarray([r.finish_reason == "stop" and bool(r.logprobs) for r in records], dtype=bool)


def fit_confidence(records: Sequence[EdgeRecord], priors: np.ndarray, y: np.ndarray, c: float) -> Linear:
    ok = _finished(records)
    x = answer_matrix([r for r, k in zip(records, ok) if k], priors[ok])
    return _fit_lr(x, y[ok], c, np.ones(len(ANSWER_FEATURES), dtype=bool))


def confidence_scores(model: Linear, records: Sequence[EdgeRecord], priors: np.ndarray) -> np.ndarray:
    out = np.zeros(len(records))
    ok = _finished(records)
    if ok.any():
        out[ok] = model.score(answer_matrix([r for r, k in zip(records, ok) if k], priors[ok]))
    return out


def oof_confidence(records: Sequence[EdgeRecord], priors: np.ndarray, y: np.ndarray, folds: list[np.ndarray], c: float) -> np.ndarray:
    out = np.zeros(len(y))
    for test in folds:
        train = np.setdiff1d(np.arange(len(y)), test)
        model = fit_confidence([records[i] for i in train], priors[train], y[train], c)
        out[test] = confidence_scores(model, [records[i] for i in test], priors[test])
    return out


def wilson_lower(right: np.ndarray, kept: np.ndarray, z: float) -> np.ndarray:
    """Lower end of the Wilson score interval of right/kept (z = 0: the plain ratio)."""
    n = np.maximum(kept, 1.0)
    p = right / n
    if z <= 0:
        return np.asarray(p, dtype=np.float64)
    centre = p + z * z / (2 * n)
    spread = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return np.asarray((centre - spread) / (1 + z * z / n), dtype=np.float64)


def build_curve(
    scores: np.ndarray, correct: np.ndarray, points: int = CURVE_POINTS, min_kept: int = MIN_KEPT, z: float = 0.0
) -> Curve:
    """Kept share, conservative local accuracy and local recall for thresholds 0..1 (see model.Curve).

    With z > 0 the accuracy is the Wilson lower bound, so a target is met with that much margin
    for the calibration split's sampling noise."""
    scores = np.asarray(scores, dtype=np.float64)
    correct = np.asarray(correct, dtype=bool)
    thresholds = np.linspace(0.0, 1.0, points)
    kept = np.asarray([(scores >= t).sum() for t in thresholds], dtype=np.float64)
    right = np.asarray([((scores >= t) & correct).sum() for t in thresholds], dtype=np.float64)
    n, n_right = max(len(scores), 1), max(int(correct.sum()), 1)
    raw = np.where(kept > 0, wilson_lower(right, kept, z), np.nan)
    last = float(correct.mean()) if len(correct) else 0.0
    reliable = np.empty(points)
    for i in range(points):
        if kept[i] >= min_kept and not np.isnan(raw[i]):
            last = float(raw[i])
        reliable[i] = last
    envelope = np.minimum.accumulate(reliable[::-1])[::-1]
    return Curve(thresholds, kept / n, envelope, right / n_right)


# ---- the whole run ---------------------------------------------------------------------------------


def _outcomes(records: Sequence[EdgeRecord], priors: np.ndarray, confs: np.ndarray) -> list[ItemOutcome]:
    return [
        ItemOutcome(r.family, r.correct, float(p), float(c), token_signals(r.logprobs, r.entropies, r.finish_reason))
        for r, p, c in zip(records, priors, confs)
    ]


def _choose_prior(emb: np.ndarray, texts: list[str], y: np.ndarray, folds: list[np.ndarray]) -> tuple[float, float, dict[str, float]]:
    losses: dict[str, float] = {}
    best: tuple[float, float, float] | None = None
    for c, s in PRIOR_GRID:
        loss = _log_loss(y, oof_prior(emb, texts, y, folds, c, s))
        losses[f"C={c},scale={s}"] = round(loss, 5)
        if best is None or loss < best[0] - 1e-9:
            best = (loss, c, s)
    assert best is not None
    return best[1], best[2], losses


def _choose_confidence(records: list[EdgeRecord], priors: np.ndarray, y: np.ndarray, folds: list[np.ndarray]) -> tuple[float, dict[str, float]]:
    ok = _finished(records)
    losses: dict[str, float] = {}
    best: tuple[float, float] | None = None
    for c in CONFIDENCE_GRID:
        p = oof_confidence(records, priors, y, folds, c)
        loss = _log_loss(y[ok], p[ok]) if ok.any() else 0.0
        losses[f"C={c}"] = round(loss, 5)
        if best is None or loss < best[0] - 1e-9:
            best = (loss, c)
    assert best is not None
    return best[1], losses


def fit_all(
    cal: list[EdgeRecord], cal_emb: np.ndarray, cal_texts: list[str], seed: int
) -> tuple[Linear, float, Linear, np.ndarray, np.ndarray, dict[str, Any]]:
    """Both models fitted on the calibration split, plus their out-of-fold calibration scores."""
    y = np.asarray([r.correct for r in cal], dtype=bool)
    folds = _folds(y, [r.family for r in cal], seed)
    c_prior, emb_scale, prior_losses = _choose_prior(cal_emb, cal_texts, y, folds)
    oof_p = oof_prior(cal_emb, cal_texts, y, folds, c_prior, emb_scale)
    prior_model = fit_prior(cal_emb, cal_texts, y, c_prior, emb_scale)
    c_conf, conf_losses = _choose_confidence(cal, oof_p, y, folds)
    oof_c = oof_confidence(cal, oof_p, y, folds, c_conf)
    conf_model = fit_confidence(cal, oof_p, y, c_conf)
    info = {
        "prior": {"model": "logistic regression", "C": c_prior, "embedding_scale": emb_scale, "cv_log_loss": prior_losses},
        "confidence": {"model": "logistic regression", "C": c_conf, "cv_log_loss": conf_losses},
        "folds": FOLDS,
        "seed": seed,
    }
    return prior_model, emb_scale, conf_model, oof_p, oof_c, info


def leave_one_family_out(
    cal: list[EdgeRecord], cal_emb: np.ndarray, cal_texts: list[str], held: list[EdgeRecord], held_emb: np.ndarray,
    held_texts: list[str], c_prior: float, emb_scale: float, c_conf: float, thresholds: dict[str, float], seed: int,
) -> dict[str, Any]:
    """Each held-out family scored by models fitted on the other families' calibration items only."""
    y_cal = np.asarray([r.correct for r in cal], dtype=bool)
    priors = np.zeros(len(held))
    confs = np.zeros(len(held))
    for family in FAMILIES:
        train = np.asarray([r.family != family for r in cal])
        test = np.asarray([r.family == family for r in held])
        if not test.any() or not train.any():
            continue
        tr_idx = np.flatnonzero(train)
        tr_texts = [cal_texts[i] for i in tr_idx]
        tr_recs = [cal[i] for i in tr_idx]
        folds = _folds(y_cal[train], [r.family for r in tr_recs], seed)
        oof_p = oof_prior(cal_emb[train], tr_texts, y_cal[train], folds, c_prior, emb_scale)
        pm = fit_prior(cal_emb[train], tr_texts, y_cal[train], c_prior, emb_scale)
        cm = fit_confidence(tr_recs, oof_p, y_cal[train], c_conf)
        te_idx = np.flatnonzero(test)
        p = prior_scores(pm, held_emb[test], [held_texts[i] for i in te_idx], emb_scale)
        priors[test] = p
        confs[test] = confidence_scores(cm, [held[i] for i in te_idx], p)
    items = _outcomes(held, priors, confs)
    report = full_report(items, thresholds)
    return {"auroc": report["auroc"], "policies": report["policies"], "policies_by_family": report["policies_by_family"]}


def interleave(probes: Sequence[Probe]) -> list[Probe]:
    """The probes in an order where any prefix spreads over both splits and every family
    (round-robin over (split, family), each list in file order): what a run cut short keeps."""
    queues = {
        (split, family): [p for p in probes if p.split == split and p.family == family]
        for split in ("calibration", "held_out") for family in FAMILIES
    }
    rest = [p for p in probes if (p.split, p.family) not in queues]
    out: list[Probe] = []
    depth = 0
    while any(depth < len(q) for q in queues.values()):
        out.extend(q[depth] for q in queues.values() if depth < len(q))
        depth += 1
    return out + rest


def calibrate(
    config: CalibrationConfig, progress: Callable[[int], None] | None = None, total: Callable[[int], None] | None = None,
    model_sha256: str | None = None,
) -> dict[str, Any]:
    """The whole run; writes the artifact when `config.out` is set and returns its manifest."""
    return asyncio.run(calibrate_async(config, progress=progress, total=total, model_sha256=model_sha256))


async def calibrate_async(
    config: CalibrationConfig, *, progress: Callable[[int], None] | None = None, total: Callable[[int], None] | None = None,
    engine: EdgeEngine | None = None, model_sha256: str | None = None,
) -> dict[str, Any]:
    """`calibrate` on a running loop: probes are submitted from it, hashing, embedding and fitting run
    in a worker thread. `engine`: a started engine serving `config.model_path` (None: one is started
    for the run); `model_sha256`: the model file's digest where it is already known."""
    began = time.monotonic()
    model_path = resolve_model(config.model_path)
    gguf_sha: str = model_sha256 if model_sha256 else await asyncio.to_thread(sha256_file, model_path)
    planned = limit_probes(load_probes(config.probes_path), config.limit)
    deadline = None if config.budget_s is None else began + config.budget_s
    if deadline is not None:
        planned = interleave(planned)
    if total is not None:
        total(len(planned))
    records = await run_probes(
        planned, model_path=model_path, model_sha256=gguf_sha, threads=config.threads,
        concurrency=config.concurrency, cache=config.cache, progress=progress, engine=engine, deadline=deadline,
    )
    answered = {r.id for r in records}
    probes = [p for p in planned if p.id in answered]
    check_enough(planned, probes, config)
    run = {
        "budget_s": config.budget_s,
        "cut_short": len(probes) < len(planned),
        "probes_used": len(probes),
        "probes_planned": len(planned),
    }
    gguf = {"file": model_path.name, "sha256": gguf_sha, "size": model_path.stat().st_size}

    def fit() -> dict[str, Any]:
        texts = embedding_texts(probes)
        vectors = embed(texts, config.cache.parent if config.cache is not None else None)
        return fit_and_report(probes, records, texts, vectors, config, gguf, run=run)

    return await asyncio.to_thread(fit)


def check_enough(planned: Sequence[Probe], answered: Sequence[Probe], config: CalibrationConfig) -> None:
    """Raise CalibrationTooShort when the answered probes are too few to fit on."""
    want_cal = sum(p.split == "calibration" for p in planned)
    need = min(config.min_probes, want_cal)
    got_cal = sum(p.split == "calibration" for p in answered)
    got_held = sum(p.split == "held_out" for p in answered)
    want_held = sum(p.split == "held_out" for p in planned)
    if got_cal < max(need, 1) or (want_held and not got_held):
        raise CalibrationTooShort(
            f"only {got_cal} of {want_cal} calibration probes (and {got_held} of {want_held} held-out) were answered "
            f"within the {config.budget_s:g} s budget; at least {max(need, 1)} calibration probes and one held-out probe "
            "are needed to fit a calibration, so nothing was written. Give it more time (--budget-s), fewer probes "
            "(--limit) or a lower --min-probes; answers are kept in the probe cache, so a rerun continues where this "
            "one stopped." if config.budget_s is not None else
            f"only {got_cal} calibration probes to fit on; at least {max(need, 1)} are needed"
        )


def fit_and_report(
    probes: Sequence[Probe], records: Sequence[EdgeRecord], texts: Sequence[str], vectors: np.ndarray,
    config: CalibrationConfig, gguf: dict[str, Any], run: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fit, choose thresholds, evaluate on the held-out split; writes the artifact when `config.out` is set."""
    cal_idx = [i for i, p in enumerate(probes) if p.split == "calibration"]
    held_idx = [i for i, p in enumerate(probes) if p.split == "held_out"]
    cal, held = [records[i] for i in cal_idx], [records[i] for i in held_idx]
    cal_emb, held_emb = vectors[cal_idx], vectors[held_idx]
    cal_texts, held_texts = [texts[i] for i in cal_idx], [texts[i] for i in held_idx]
    y_cal = np.asarray([r.correct for r in cal], dtype=bool)

    prior_model, emb_scale, conf_model, oof_p, oof_c, fit_info = fit_all(cal, cal_emb, cal_texts, config.seed)
    curves = {"prior": build_curve(oof_p, y_cal, z=CURVE_Z), "confidence": build_curve(oof_c, y_cal, z=CURVE_Z)}
    gate = curves["prior"].threshold("min_local_recall", GATE_RECALL)
    defaults = {
        "target_local_accuracy": config.target,
        "gate": gate,
        "gate_local_recall": GATE_RECALL,
        "confidence": curves["confidence"].threshold("min_local_accuracy", config.target),
        "prior_only": curves["prior"].threshold("min_local_accuracy", config.target),
    }
    n_emb = cal_emb.shape[1]
    params = {
        "prior_w_embedding": prior_model.w[:n_emb] * emb_scale,
        "prior_w_features": prior_model.w[n_emb:],
        "prior_mean": prior_model.mean[n_emb:],
        "prior_scale": prior_model.scale[n_emb:],
        "prior_bias": np.asarray([prior_model.bias]),
        "confidence_w": conf_model.w,
        "confidence_mean": conf_model.mean,
        "confidence_scale": conf_model.scale,
        "confidence_bias": np.asarray([conf_model.bias]),
    }
    defaults_json = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in defaults.items()}
    manifest: dict[str, Any] = {
        "gguf": gguf,
        "probe_set": {
            "sha256": probe_set_hash(probes),
            "probes": len(probes),
            "calibration": len(cal),
            "held_out": len(held),
            "limit_per_split": config.limit,
        },
        # whether the time budget cut the run short, and how many of the probes asked for it used
        "run": run or {"budget_s": None, "cut_short": False, "probes_used": len(probes), "probes_planned": len(probes)},
        "embedding": {"model": EMBEDDING_MODEL, "text": "policies.cache.scope.embedding_text (last user turn)"},
        "decoding": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "stop_on_loop": True, "low_confidence_run": 0},
        "libraries": library_versions(),
        "fit": {**fit_info, "curve": {"points": CURVE_POINTS, "min_kept": MIN_KEPT, "wilson_z": CURVE_Z}},
        "defaults": defaults_json,  # null: no threshold meets the target (keep nothing local)
        "curves": {k: v.to_manifest() for k, v in curves.items()},
    }
    # thresholds in force: score the held-out split with the artifact's own code path
    calibration = EdgeCalibration(params, manifest)
    held_p = calibration.prior_batch(held_texts, held_emb)
    held_c = np.asarray([
        calibration.confidence_from_arrays(float(p), r.logprobs, r.entropies, r.finish_reason) for r, p in zip(held, held_p)
    ])
    thresholds = {k: float(defaults[k]) for k in ("gate", "confidence", "prior_only")}
    cal_items = _outcomes(cal, oof_p, oof_c)
    held_items = _outcomes(held, held_p, held_c)
    lofo = leave_one_family_out(
        cal, cal_emb, cal_texts, held, held_emb, held_texts, fit_info["prior"]["C"], emb_scale,
        fit_info["confidence"]["C"], thresholds, config.seed,
    )
    by_target = {}
    for target in TARGET_TABLE:
        t = {**thresholds, "confidence": curves["confidence"].threshold("min_local_accuracy", target),
             "prior_only": curves["prior"].threshold("min_local_accuracy", target)}
        policies = full_report(held_items, t)["policies"]
        by_target[f"{target:.2f}"] = {
            "confidence_threshold": None if math.isinf(t["confidence"]) else t["confidence"],
            "prior_cascade": policies["prior_cascade"],
            "cascade_only": policies["cascade_only"],
        }
    manifest["metrics"] = {
        "held_out_by_target": by_target,
        "calibration_out_of_fold": full_report(cal_items, thresholds),
        "held_out": full_report(held_items, thresholds),
        "held_out_leave_one_family_out": lofo,
        "held_out_prior_auroc_within_family": {
            f: _r(auroc([i.correct for i in held_items if i.family == f], [i.prior for i in held_items if i.family == f]))
            for f in FAMILIES
        },
    }
    if config.out is not None:
        save_artifact(config.out, params, manifest)
    return manifest


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
