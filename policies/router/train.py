"""Train the router: compare candidates on subject-held-out folds, calibrate, and write the artifact."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GroupKFold
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from policies.embedder import DIMENSION
from policies.router.artifact import save_artifact
from policies.router.calibration import gap_curve, threshold_for_target
from policies.router.candidates import Candidate, Fitted, TrainSet, decision, default_candidates, fit_candidate
from policies.router.data import (
    EMBEDDING_MODEL_NAME,
    PER_SUBJECT,
    RUNTIME_MAX_SEQ_LENGTH,
    SUBJECT_SEED,
    Encoder,
    MMLUData,
    RuntimeEncoder,
    grouped_embeddings,
    load_everyday,
    load_math,
    load_mmlu,
    mmlu_embeddings,
    runtime_text,
    subject_sample,
)
from policies.router.evaluate import routing_metrics, target_checks
from policies.router.features import text_feature_matrix

log = logging.getLogger(__name__)

# The target the shipped default threshold meets on held-out subjects ("keep 95% of strong quality").
DEFAULT_TARGET = ("min_strong_quality", 0.95)


@dataclass(slots=True)
class TrainConfig:
    """Where the data lives, where the artifact goes, and the fixed seeds that make it reproducible."""

    data_dir: Path
    cache_dir: Path
    out: Path | None
    seed: int = 13
    test_fraction: float = 0.2
    folds: int = 8
    only: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Corpus:
    """Everything embedded once: MMLU with labels, MATH with levels, everyday prompts."""

    mmlu: MMLUData
    emb: np.ndarray
    txt: np.ndarray
    math_emb: np.ndarray
    math_txt: np.ndarray
    math_level: np.ndarray
    everyday: list[str]
    everyday_emb: np.ndarray


# MATH is an auxiliary signal; a seeded sample keeps its embedding pass short on 2 cores.
MATH_SAMPLE = 2000
MATH_SEED = 7


def math_sample(data_dir: Path) -> tuple[list[str], np.ndarray]:
    """A fixed, seeded sample of MATH problems and their levels."""
    problems, levels = load_math(data_dir)
    keep = np.sort(np.random.RandomState(MATH_SEED).permutation(len(problems))[:MATH_SAMPLE])
    return [problems[i] for i in keep], levels[keep]


def _embed_all(texts: list[str], encoder: Encoder, cache_dir: Path, label: str) -> np.ndarray:
    runtime = [runtime_text(t) for t in texts]
    return grouped_embeddings(runtime, np.full(len(runtime), "all"), ["all"], encoder, cache_dir, label)


def load_corpus(data_dir: Path, cache_dir: Path) -> Corpus:
    """Read the shared data and embed it the way the gateway does (cached after the first run)."""
    mmlu = subject_sample(load_mmlu(data_dir))
    problems, levels = math_sample(data_dir)
    everyday = load_everyday(data_dir)
    encoder = RuntimeEncoder()
    emb = mmlu_embeddings(mmlu, cache_dir, encoder=encoder)
    tag = f"rt{RUNTIME_MAX_SEQ_LENGTH}"
    math_emb = _embed_all(problems, encoder, cache_dir, f"math-{tag}")
    everyday_emb = _embed_all(everyday, encoder, cache_dir, f"everyday-{tag}")
    return Corpus(
        mmlu=mmlu,
        emb=emb,
        txt=text_feature_matrix(mmlu.prompts),
        math_emb=math_emb,
        math_txt=text_feature_matrix(problems),
        math_level=levels,
        everyday=everyday,
        everyday_emb=everyday_emb,
    )


def split_subjects(subjects: np.ndarray, test_fraction: float, seed: int) -> list[str]:
    """Whole subjects, drawn in a seeded order until they hold `test_fraction` of the rows."""
    names, counts = np.unique(subjects, return_counts=True)
    order = np.random.RandomState(seed).permutation(len(names))
    chosen: list[str] = []
    total = 0
    for i in order:
        if total >= test_fraction * len(subjects):
            break
        chosen.append(str(names[i]))
        total += int(counts[i])
    return sorted(chosen)


def _trainset(c: Corpus, idx: np.ndarray) -> TrainSet:
    m = c.mmlu
    return TrainSet(
        emb=c.emb[idx],
        txt=c.txt[idx],
        label=m.label[idx],
        weak_wrong=(m.weak[idx] == 0).astype(np.int64),
        gain=(m.strong[idx] - m.weak[idx]).astype(np.int64),
        math_emb=c.math_emb,
        math_txt=c.math_txt,
        math_level=c.math_level,
    )


def out_of_fold(candidate: Candidate, c: Corpus, dev: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Scores for every dev row from a model that never saw that row's subject."""
    scores = np.zeros(len(dev))
    for fit_idx, pred_idx in GroupKFold(n_splits=folds).split(dev, groups=c.mmlu.subjects[dev]):
        fitted = fit_candidate(candidate, _trainset(c, dev[fit_idx]), seed)
        scores[pred_idx] = decision(fitted, c.emb[dev[pred_idx]], c.txt[dev[pred_idx]])
    return scores


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.asarray(np.log(p / (1 - p)), dtype=np.float64)


def _platt(raw: np.ndarray, label: np.ndarray, logits: bool) -> tuple[float, float]:
    """Slope and offset mapping a raw score to a calibrated log-odds."""
    z = raw if logits else _logit(raw)
    lr = LogisticRegression(C=1e6, max_iter=1000).fit(z[:, None], label)
    return float(lr.coef_[0, 0]), float(lr.intercept_[0])


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 / (1.0 + np.exp(-np.clip(z, -700, 700))), dtype=np.float64)


def _ship_params(fitted: Fitted, slope: float, offset: float, c: Corpus) -> dict[str, Any]:
    if fitted.linear is not None:
        w_emb, w_text, b = fitted.linear
        return {
            "kind": "linear",
            "dimension": int(c.emb.shape[1]),
            "w_emb": (slope * w_emb).astype(np.float32),
            "w_text": slope * w_text,
            "bias": slope * b + offset,
            "estimator": None,
        }
    # Non-linear models keep sklearn on the hot path, with the same Platt map over their log-odds.
    return {"kind": "sklearn", "dimension": int(c.emb.shape[1]), "estimator": fitted.estimator,
            "features": fitted.candidate.features, "platt": (slope, offset), "bias": 0.0}


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the whole comparison; write the artifact when `cfg.out` is set; return the manifest body."""
    started = time.perf_counter()
    corpus = load_corpus(cfg.data_dir, cfg.cache_dir)
    if corpus.emb.shape[1] != DIMENSION:
        raise ValueError(f"embeddings are {corpus.emb.shape[1]}-d, expected {DIMENSION}")
    m = corpus.mmlu
    test_subjects = split_subjects(m.subjects, cfg.test_fraction, cfg.seed)
    is_test = np.isin(m.subjects, test_subjects)
    dev, test = np.flatnonzero(~is_test), np.flatnonzero(is_test)
    candidates = [k for k in default_candidates() if not cfg.only or k.name in cfg.only]
    if not candidates:
        raise ValueError(f"--only matched no candidate; known: {', '.join(k.name for k in default_candidates())}")

    rows: list[dict[str, Any]] = []
    oof: dict[str, np.ndarray] = {}
    fitted_all: dict[str, Fitted] = {}
    # NOTE: single-threaded BLAS/OpenMP: on a small shared machine extra threads spin and slow every fit.
    limits = threadpool_limits(limits=1)
    for cand in tqdm(candidates, desc="candidates", unit="model"):
        t0 = time.perf_counter()
        oof[cand.name] = out_of_fold(cand, corpus, dev, cfg.folds, cfg.seed)
        fitted_all[cand.name] = fit_candidate(cand, _trainset(corpus, dev), cfg.seed)
        test_raw = decision(fitted_all[cand.name], corpus.emb[test], corpus.txt[test])
        rows.append({
            "name": cand.name, "family": cand.family, "features": cand.features, "target": cand.target,
            "aux": cand.aux, "shippable": cand.shippable, "note": cand.note,
            "dev_oof": routing_metrics(oof[cand.name], m.take(dev)),
            "test": routing_metrics(test_raw, m.take(test)),
            "seconds": round(time.perf_counter() - t0, 2),
        })

    # Selection looks only at dev out-of-fold figures; the test subjects stay unseen until the report.
    ranked = sorted((r for r in rows if r["shippable"]),
                    key=lambda r: (r["dev_oof"]["apgr"], r["dev_oof"]["auc"]), reverse=True)
    best = ranked[0]["name"]
    chosen = fitted_all[best]
    # A steadier figure than one test split: every subject held out once, same configuration.
    everything = np.arange(len(m.prompts))
    all_cv = routing_metrics(out_of_fold(chosen.candidate, corpus, everything, cfg.folds, cfg.seed), m)
    limits.restore_original_limits()
    slope, offset = _platt(oof[best], m.label[dev], logits=chosen.linear is not None)
    params = _ship_params(chosen, slope, offset, corpus)

    from policies.router.model import Router  # local: the router module imports this package's artifact code

    dev_prob = _sigmoid(slope * (oof[best] if chosen.linear is not None else _logit(oof[best])) + offset)
    curve = gap_curve(dev_prob, m.weak[dev], m.strong[dev])
    default_threshold = threshold_for_target(curve, *DEFAULT_TARGET)
    router = Router.from_params(params, curve=curve, default_threshold=default_threshold, manifest={})
    test_prob = router.score_batch([m.prompts[i] for i in test], corpus.emb[test])
    test_metrics = routing_metrics(test_prob, m.take(test), calibrated=True)
    everyday_prob = router.score_batch(corpus.everyday, corpus.everyday_emb)
    math_prob = router.score_batch(math_sample(cfg.data_dir)[0], corpus.math_emb)

    manifest: dict[str, Any] = {
        "model": {"name": best, "kind": params["kind"], "features": chosen.candidate.features,
                  "family": chosen.candidate.family, "target": chosen.candidate.target,
                  "aux": chosen.candidate.aux, "platt": {"slope": slope, "offset": offset}},
        "embedding": {"model": EMBEDDING_MODEL_NAME, "dimension": int(corpus.emb.shape[1]),
                      "text": "policies.cache.scope.embedding_text (last user turn, NFKC + whitespace "
                              "normalised, first 4000 chars)",
                      "normalized": True, "train_max_seq_length": RUNTIME_MAX_SEQ_LENGTH,
                      "same_as_runtime": True},
        "label": "strong needed = weak model wrong and strong model right",
        "data": {
            "mmlu_rows": len(m.prompts), "mmlu_subjects": int(len(np.unique(m.subjects))),
            "weak_model": "mistralai/Mixtral-8x7B-Instruct-v0.1", "strong_model": "gpt-4-1106-preview",
            "mmlu_rows_per_subject_cap": PER_SUBJECT, "mmlu_sample_seed": SUBJECT_SEED,
            "math_rows": int(len(corpus.math_level)), "math_sample_seed": MATH_SEED,
            "everyday_rows": len(corpus.everyday),
            "source": "../shared/data/router (RouteLLM MMLU, MATH levels, OpenAssistant prompts)",
        },
        "split": {"method": "hold out whole subjects", "seed": cfg.seed, "folds": cfg.folds,
                  "dev_rows": int(len(dev)), "test_rows": int(len(test)), "test_subjects": test_subjects},
        "selection": "highest dev out-of-fold APGR (subject-grouped folds) among shippable candidates",
        "candidates": rows,
        "metrics": {"held_out_test": test_metrics,
                    "all_subjects_cv": {**all_cv, "note": f"{cfg.folds}-fold, folds are whole subjects"},
                    "target_checks": target_checks(curve, test_prob, m.take(test)),
                    "math_levels": _math_signal(math_prob, corpus.math_level),
                    "everyday": _everyday_signal(everyday_prob, default_threshold)},
        "calibration": {"source": "dev out-of-fold calibrated scores, subjects held out",
                        "curve": curve.to_table()},
        "default_target": {"mode": DEFAULT_TARGET[0], "value": DEFAULT_TARGET[1]},
        "default_threshold": default_threshold,
        "seed": cfg.seed,
        "train_seconds": round(time.perf_counter() - started, 1),
    }
    if cfg.out is not None:
        save_artifact(cfg.out, params, manifest)
    return manifest


def _math_signal(prob: np.ndarray, level: np.ndarray) -> dict[str, float | dict[str, float]]:
    """Does the router rank harder MATH problems higher? (never seen as routing labels)."""
    from scipy.stats import spearmanr
    from sklearn.metrics import roc_auc_score

    hard, easy = level >= 4, level <= 2
    mask = hard | easy
    return {
        "spearman_score_vs_level": round(float(spearmanr(prob, level).statistic), 4),
        "auc_level45_vs_level12": round(float(roc_auc_score(hard[mask], prob[mask])), 4),
        "mean_score_by_level": {str(lv): round(float(prob[level == lv].mean()), 4) for lv in range(1, 6)},
    }


def _everyday_signal(prob: np.ndarray, threshold: float) -> dict[str, float]:
    """How real first prompts would be split at the default threshold (unlabelled: shape only)."""
    return {
        "rows": int(prob.size),
        "strong_share_at_default_threshold": round(float((prob >= threshold).mean()), 4),
        "score_p10": round(float(np.quantile(prob, 0.1)), 4),
        "score_p50": round(float(np.quantile(prob, 0.5)), 4),
        "score_p90": round(float(np.quantile(prob, 0.9)), 4),
    }
