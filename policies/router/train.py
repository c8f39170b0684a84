"""Train the router on MMLU and AlpacaEval: compare candidates on held-out groups, calibrate, write the artifact.

Splits (fixed, seeded):
- test: whole MMLU subjects (`split_subjects`, seed 13, ~20 % of rows) and whole AlpacaEval
  sources (ALPACA_TEST_SOURCES). Never used for selection, calibration or tuning: reported only.
- selection: out-of-fold scores on the rest (dev), from GroupKFold over MMLU subjects and
  AlpacaEval sources, so every dev score comes from a model that never saw that row's group.
  Candidates are ranked, the Platt map is fitted and the strong-share curve is measured there.
"""

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

from policies.embedding.embedder import DIMENSION
from policies.router.artifact import save_artifact
from policies.router.calibration import GapCurve, RankMap, gap_curve, rank_map, threshold_for_target
from policies.router.candidates import Candidate, Fitted, TrainSet, decision, default_candidates, fit_candidate
from policies.router.data import (
    ALPACA_CLEAR_LOSS,
    ALPACA_FILE,
    ALPACA_PANEL,
    ALPACA_REFERENCE,
    ALPACA_WEAK,
    EMBEDDING_MODEL_NAME,
    PER_SUBJECT,
    RUNTIME_MAX_SEQ_LENGTH,
    STRONG_COLUMN,
    SUBJECT_SEED,
    WEAK_COLUMN,
    AlpacaData,
    MMLUData,
    RuntimeEncoder,
    alpaca_embeddings,
    embed_all,
    load_alpaca,
    load_everyday,
    load_math,
    load_mmlu,
    mmlu_embeddings,
    subject_sample,
)
from policies.router.evaluate import pooled_target_checks, routing_metrics, target_checks, within_group_auc
from policies.router.features import FEATURE_NAMES, text_feature_matrix

log = logging.getLogger(__name__)

# The shipped default target (policies/defaults/router.yaml) is a strong share, chosen on the
# selection folds alone for the tier decision's aim: cost <= TIER_COST_CEILING x all-strong at
# quality >= TIER_QUALITY_FLOOR x all-strong on MMLU, with the cost tier priced at
# COST_TIER_PRICE of the strong tier (so cost = COST_TIER_PRICE + (1 - COST_TIER_PRICE) x share).
TARGET_MODE = "max_strong_share"
TARGET_GRID = tuple(round(0.05 * k, 2) for k in range(1, 20))
TIER_QUALITY_FLOOR = 0.95
TIER_COST_CEILING = 0.50
COST_TIER_PRICE = 0.1
# Task families, each with its own rank map: the multiple-choice feature splits them.
FAMILY_FEATURE = "closed_question"
# Whole AlpacaEval sources kept out of training and selection, reported as the held-out test.
# vicuna's 80 prompts span MT-Bench-like categories (math, coding, fermi, roleplay, writing).
ALPACA_TEST_SOURCES = ("koala", "vicuna")


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
    """Everything embedded once: MMLU and AlpacaEval with labels, MATH with levels, everyday prompts."""

    mmlu: MMLUData
    emb: np.ndarray
    txt: np.ndarray
    alpaca: AlpacaData
    alpaca_emb: np.ndarray
    alpaca_txt: np.ndarray
    math_emb: np.ndarray
    math_txt: np.ndarray
    math_level: np.ndarray
    everyday: list[str]
    everyday_emb: np.ndarray


@dataclass(slots=True)
class Split:
    """Row indices of each source's dev (selection) and test part."""

    m_dev: np.ndarray
    m_test: np.ndarray
    a_dev: np.ndarray
    a_test: np.ndarray
    test_subjects: list[str]


# MATH is an auxiliary signal; a seeded sample keeps its embedding pass short on 2 cores.
MATH_SAMPLE = 2000
MATH_SEED = 7


def math_sample(data_dir: Path) -> tuple[list[str], np.ndarray]:
    """A fixed, seeded sample of MATH problems and their levels."""
    problems, levels = load_math(data_dir)
    keep = np.sort(np.random.RandomState(MATH_SEED).permutation(len(problems))[:MATH_SAMPLE])
    return [problems[i] for i in keep], levels[keep]


def load_corpus(data_dir: Path, cache_dir: Path) -> Corpus:
    """Read the shared data and embed it the way the gateway does (cached after the first run)."""
    mmlu = subject_sample(load_mmlu(data_dir))
    alpaca = load_alpaca(data_dir)
    problems, levels = math_sample(data_dir)
    everyday = load_everyday(data_dir)
    encoder = RuntimeEncoder()
    tag = f"rt{RUNTIME_MAX_SEQ_LENGTH}"
    alpaca_emb = alpaca_embeddings(alpaca, cache_dir, encoder)
    emb = mmlu_embeddings(mmlu, cache_dir, encoder=encoder)
    everyday_emb = embed_all(everyday, encoder, cache_dir, f"everyday-{tag}")
    math_emb = embed_all(problems, encoder, cache_dir, f"math-{tag}")
    return Corpus(
        mmlu=mmlu,
        emb=emb,
        txt=text_feature_matrix(mmlu.prompts),
        alpaca=alpaca,
        alpaca_emb=alpaca_emb,
        alpaca_txt=text_feature_matrix(alpaca.prompts),
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


def make_split(c: Corpus, cfg: TrainConfig) -> Split:
    test_subjects = split_subjects(c.mmlu.subjects, cfg.test_fraction, cfg.seed)
    m_test = np.isin(c.mmlu.subjects, test_subjects)
    a_test = np.isin(c.alpaca.subjects, list(ALPACA_TEST_SOURCES))
    return Split(np.flatnonzero(~m_test), np.flatnonzero(m_test), np.flatnonzero(~a_test), np.flatnonzero(a_test),
                 test_subjects)


def assemble(cand: Candidate, c: Corpus, m_idx: np.ndarray, a_idx: np.ndarray) -> TrainSet:
    """The rows one fit of `cand` trains on: MMLU rows, AlpacaEval rows (weighted), MATH rows if asked."""
    m = c.mmlu
    by_subject = cand.fe == "subject"
    emb = [c.emb[m_idx]]
    txt = [c.txt[m_idx]]
    target = [mmlu_target(m, cand.mmlu_target)[m_idx]]
    weight = [np.ones(len(m_idx))]
    domain = [np.char.add("mmlu:", m.subjects[m_idx].astype(str))]
    group = [domain[0] if by_subject else np.full(len(m_idx), "mmlu")]
    if cand.alpaca_weight > 0 and len(a_idx):
        emb.append(c.alpaca_emb[a_idx])
        txt.append(c.alpaca_txt[a_idx])
        target.append(c.alpaca.target(cand.alpaca_label)[a_idx])
        weight.append(np.full(len(a_idx), cand.alpaca_weight))
        domain.append(np.char.add("alpaca:", c.alpaca.subjects[a_idx].astype(str)))
        group.append(domain[-1] if by_subject else np.full(len(a_idx), "alpaca"))
    if cand.math_weight > 0:
        # Even rows train; odd rows stay out: 1 mod 4 break selection ties, 3 mod 4 are the manifest's diagnostic.
        keep = (c.math_level != 3) & (np.arange(len(c.math_level)) % 2 == 0)
        emb.append(c.math_emb[keep])
        txt.append(c.math_txt[keep])
        target.append((c.math_level[keep] >= 4).astype(np.float64))
        weight.append(np.full(int(keep.sum()), cand.math_weight))
        group.append(np.full(int(keep.sum()), "math"))
        domain.append(group[-1])
    return TrainSet(emb=np.vstack(emb), txt=np.vstack(txt), target=np.concatenate(target),
                    weight=np.concatenate(weight), group=np.concatenate(group), domain=np.concatenate(domain))


def mmlu_target(m: MMLUData, kind: str) -> np.ndarray:
    """The MMLU training target in [0, 1] (see Candidate.mmlu_target)."""
    if kind == "strong_needed":
        return m.label.astype(np.float64)
    if kind == "gain":
        return np.asarray((m.strong - m.weak + 1) / 2.0, dtype=np.float64)
    if kind == "weak_wrong":
        return np.asarray(m.weak == 0, dtype=np.float64)
    raise ValueError(f"unknown MMLU target {kind!r}; expected strong_needed, gain or weak_wrong")


# MATH rows (of the seeded sample) no candidate trains on: odd rows. Of those, 1 mod 4 break
# selection ties (MATH_SELECT), 3 mod 4 are the manifest's held-out diagnostic (MATH_REPORT).
MATH_SELECT, MATH_REPORT = 1, 3
# Candidates whose mean selection-fold APGR is within this of the best are tied (the spread of one
# candidate's APGR across seeds and fold draws is about this size); the tie goes to the one that
# ranks MATH levels best on the MATH_SELECT rows: a difficulty signal on a family no APGR sees.
APGR_TIE = 0.005


def math_rows(c: Corpus, part: int) -> np.ndarray:
    return np.flatnonzero(np.arange(len(c.math_level)) % 4 == part)


def math_level_auc(scores: np.ndarray, level: np.ndarray) -> float:
    """AUC of level 4-5 against 1-2 (0.5 when one side is missing)."""
    from sklearn.metrics import roc_auc_score

    hard, easy = level >= 4, level <= 2
    mask = hard | easy
    if hard[mask].all() or not hard[mask].any():
        return 0.5
    return float(roc_auc_score(hard[mask], scores[mask]))


def select(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The shippable candidate with the highest mean selection-fold APGR, ties (within APGR_TIE) going
    to the best MATH level ranking on the selection rows, then to the mean within-subject AUC."""
    shippable = [r for r in rows if r["shippable"]]
    top = max(r["selection"]["mean_apgr"] for r in shippable)
    tied = [r for r in shippable if r["selection"]["mean_apgr"] >= top - APGR_TIE]
    return max(tied, key=lambda r: (r["selection"].get("math_level_auc", 0.5), r["selection"]["mean_apgr"],
                                    r["selection"]["mmlu"]["mean_within_subject_auc"]))


def out_of_fold(cand: Candidate, c: Corpus, m_idx: np.ndarray, a_idx: np.ndarray, folds: int, seed: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scores for every given MMLU and AlpacaEval row from a model that never saw that row's group,
    and for the MATH_SELECT rows (no candidate trains on them) the mean over the folds' models.

    Groups are MMLU subjects and AlpacaEval sources, folded together (GroupKFold, deterministic).
    """
    groups = np.concatenate([c.mmlu.subjects[m_idx].astype(str), np.char.add("alpaca:", c.alpaca.subjects[a_idx].astype(str))])
    n_m = len(m_idx)
    m_scores, a_scores = np.zeros(n_m), np.zeros(len(a_idx))
    selecting = math_rows(c, MATH_SELECT)
    math_scores = np.zeros(len(selecting))
    for fit_rows, pred_rows in GroupKFold(n_splits=folds).split(groups, groups=groups):
        fit_m, fit_a = m_idx[fit_rows[fit_rows < n_m]], a_idx[fit_rows[fit_rows >= n_m] - n_m]
        fitted = fit_candidate(cand, assemble(cand, c, fit_m, fit_a), seed)
        math_scores += decision(fitted, c.math_emb[selecting], c.math_txt[selecting]) / folds
        pm, pa = pred_rows[pred_rows < n_m], pred_rows[pred_rows >= n_m] - n_m
        if len(pm):
            m_scores[pm] = decision(fitted, c.emb[m_idx[pm]], c.txt[m_idx[pm]])
        if len(pa):
            a_scores[pa] = decision(fitted, c.alpaca_emb[a_idx[pa]], c.alpaca_txt[a_idx[pa]])
    return m_scores, a_scores, math_scores


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.asarray(np.log(p / (1 - p)), dtype=np.float64)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 / (1.0 + np.exp(-np.clip(z, -700, 700))), dtype=np.float64)


def source_weights(n_mmlu: int, n_alpaca: int) -> np.ndarray:
    """Row weights giving MMLU and AlpacaEval half of the total each (pooled curves and Platt)."""
    return np.concatenate([np.full(n_mmlu, 0.5 / max(n_mmlu, 1)), np.full(n_alpaca, 0.5 / max(n_alpaca, 1))])


def platt(raw: np.ndarray, label: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """Slope and offset mapping a raw log-odds to a calibrated one (sources weighted equally)."""
    lr = LogisticRegression(C=1e6, max_iter=1000).fit(raw[:, None], label, sample_weight=weights * len(raw))
    return float(lr.coef_[0, 0]), float(lr.intercept_[0])


def pooled_curve(m_prob: np.ndarray, m: MMLUData, a_prob: np.ndarray, a: AlpacaData) -> GapCurve:
    """The strong-share/quality curve of both sources pooled, each weighing half.

    Qualities are divided by the strong model's mean on their own source (MMLU accuracy,
    AlpacaEval win rate), so `quality` reads as "fraction of the strong model's quality",
    averaged over the two sources, and `share` as the average strong share.
    """
    m_strong, a_strong = float(m.strong.mean()), float(a.strong.mean())
    return gap_curve(
        np.concatenate([m_prob, a_prob]),
        np.concatenate([m.weak / m_strong, a.weak / a_strong]),
        np.concatenate([m.strong / m_strong, a.strong / a_strong]),
        weights=source_weights(len(m_prob), len(a_prob)),
    )


def _ship_params(fitted: Fitted, slope: float, offset: float, dimension: int) -> dict[str, Any]:
    if fitted.linear is not None:
        w_emb, w_text, b = fitted.linear
        params: dict[str, Any] = {
            "kind": "linear",
            "dimension": dimension,
            "w_emb": (slope * w_emb).astype(np.float32),
            "w_text": slope * w_text,
            "bias": slope * b + offset,
            "estimator": None,
        }
        if fitted.gated is not None:
            col, v_emb, v_text, v_b = fitted.gated
            params["gate"] = {"feature": int(col), "w_emb": (slope * v_emb).astype(np.float32),
                              "w_text": slope * v_text, "bias": slope * v_b}
        return params
    # Non-linear models keep sklearn on the hot path, with the same Platt map over their log-odds.
    return {"kind": "sklearn", "dimension": dimension, "estimator": fitted.estimator,
            "features": fitted.candidate.features, "platt": (slope, offset), "bias": 0.0}


def _as_logits(fitted: Fitted, raw: np.ndarray) -> np.ndarray:
    return raw if fitted.linear is not None else _logit(raw)


def _candidate_row(cand: Candidate, m_oof: np.ndarray, a_oof: np.ndarray, math_oof: np.ndarray, c: Corpus, s: Split,
                   seconds: float) -> dict[str, Any]:
    m_dev, a_dev = c.mmlu.take(s.m_dev), c.alpaca.take(s.a_dev)
    mm = routing_metrics(m_oof, m_dev)
    am = routing_metrics(a_oof, a_dev)
    return {
        "name": cand.name, "family": cand.family, "features": cand.features, "c": cand.c, "fe": cand.fe,
        "mmlu_target": cand.mmlu_target, "alpaca_weight": cand.alpaca_weight, "alpaca_label": cand.alpaca_label, "math_weight": cand.math_weight, "gate": cand.gate, "neutral": cand.neutral,
        "shippable": cand.shippable, "note": cand.note,
        "selection": {
            "mmlu": {k: mm[k] for k in ("auc", "apgr", "cpt50", "cpt80")}
            | {"mean_within_subject_auc": within_group_auc(m_oof, m_dev)},
            "alpaca": {k: am[k] for k in ("auc", "apgr", "cpt50", "cpt80")},
            "mean_apgr": round((mm["apgr"] + am["apgr"]) / 2, 4),
            "share_spread_at_0.3": share_spread(m_oof, m_dev, a_oof, a_dev, 0.3),
            "math_level_auc": round(math_level_auc(math_oof, c.math_level[math_rows(c, MATH_SELECT)]), 4),
        },
        "seconds": round(seconds, 1),
    }


def family_rank_maps(z: np.ndarray, closed: np.ndarray) -> tuple[RankMap, RankMap]:
    """Rank maps (open prompts, multiple choice) of selection-fold log-odds, one row one vote.

    `z` are out-of-fold scores, each from a model that never saw its row's group (an MMLU subject,
    an AlpacaEval source): how the served model scores a subject it has not seen. Rows count
    once each: on the selection folds, 300 draws of whole MMLU subjects held out (a quarter of
    the rows each) missed a 30 % share by 6.2 points RMS with rows counting once, by 6.4 with
    every subject counting once (40 %: 7.2 against 7.5).
    """
    maps = []
    for flag in (False, True):
        k = closed == flag
        if k.sum() < 2:
            raise ValueError(f"no calibration rows for the {'multiple-choice' if flag else 'open'} family")
        maps.append(rank_map(z[k]))
    return maps[0], maps[1]


def choose_target(curve: GapCurve, m_scores: np.ndarray, m: MMLUData) -> tuple[float, dict[str, float]]:
    """The TARGET_GRID share closest to the tier aim on the MMLU selection rows, and its figures there.

    Closest: the smallest worst shortfall, max(cost - TIER_COST_CEILING, TIER_QUALITY_FLOOR -
    quality); where several shares meet both, the cheapest. Selection folds only: the test rows
    never enter.
    """
    strong = float(m.strong.mean())
    best: tuple[tuple[float, float], float, dict[str, float]] | None = None
    for value in TARGET_GRID:
        sent = m_scores >= threshold_for_target(curve, TARGET_MODE, value)
        share = float(sent.mean())
        quality = float(np.where(sent, m.strong, m.weak).mean()) / strong
        cost = COST_TIER_PRICE + (1.0 - COST_TIER_PRICE) * share
        key = (max(cost - TIER_COST_CEILING, TIER_QUALITY_FLOOR - quality, 0.0), value)
        if best is None or key < best[0]:
            best = (key, value, {"mmlu_selection_share": round(share, 4), "mmlu_selection_quality": round(quality, 4),
                                 "mmlu_selection_cost": round(cost, 4), "shortfall": round(key[0], 4)})
    assert best is not None
    return best[1], best[2]


def share_spread(m_scores: np.ndarray, m: MMLUData, a_scores: np.ndarray, a: AlpacaData, share: float) -> float:
    """RMS over domains (MMLU subjects, AlpacaEval sources) of (domain's strong share - `share`) at the
    threshold that sends `share` of both sources pooled (each weighing half): how far a share
    target drifts when traffic comes from one domain."""
    scores = np.concatenate([m_scores, a_scores])
    domains = np.concatenate([np.char.add("m:", m.subjects.astype(str)), np.char.add("a:", a.subjects.astype(str))])
    w = source_weights(len(m_scores), len(a_scores))
    order = np.argsort(-scores, kind="stable")
    cut = scores[order][min(int(np.searchsorted(np.cumsum(w[order]) / w.sum(), share)), len(scores) - 1)]
    errors = [float((scores[domains == g] >= cut).mean()) - share for g in np.unique(domains)]
    return round(float(np.sqrt(np.mean(np.square(errors)))), 4)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the whole comparison; write the artifact when `cfg.out` is set; return the manifest body."""
    started = time.perf_counter()
    c = load_corpus(cfg.data_dir, cfg.cache_dir)
    if c.emb.shape[1] != DIMENSION:
        raise ValueError(f"embeddings are {c.emb.shape[1]}-d, expected {DIMENSION}")
    s = make_split(c, cfg)
    candidates = [k for k in default_candidates() if not cfg.only or k.name in cfg.only]
    if not candidates:
        raise ValueError(f"--only matched no candidate; known: {', '.join(k.name for k in default_candidates())}")

    rows: list[dict[str, Any]] = []
    oof: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    # NOTE: single-threaded BLAS/OpenMP: on a small shared machine extra threads spin and slow every fit.
    with threadpool_limits(limits=1):
        for cand in tqdm(candidates, desc="candidates (selection folds)", unit="model"):
            t0 = time.perf_counter()
            oof[cand.name] = out_of_fold(cand, c, s.m_dev, s.a_dev, cfg.folds, cfg.seed)
            rows.append(_candidate_row(cand, *oof[cand.name], c, s, time.perf_counter() - t0))
        # Selection reads only the selection folds; the test subjects and sources stay unseen until the report.
        best = next(k for k in candidates if k.name == select(rows)["name"])
        chosen = fit_candidate(best, assemble(best, c, s.m_dev, s.a_dev), cfg.seed)

    m_oof, a_oof, _ = oof[best.name]
    m_dev, a_dev = c.mmlu.take(s.m_dev), c.alpaca.take(s.a_dev)
    dev_logits = _as_logits(chosen, np.concatenate([m_oof, a_oof]))
    dev_label = np.concatenate([m_dev.label, a_dev.label])
    slope, offset = platt(dev_logits, dev_label, source_weights(len(m_oof), len(a_oof)))
    params = _ship_params(chosen, slope, offset, int(c.emb.shape[1]))

    from policies.router.model import Router  # local: the router module imports this package's artifact code

    dev_z = slope * dev_logits + offset
    family_col = FEATURE_NAMES.index(FAMILY_FEATURE)
    dev_closed = np.concatenate([c.txt[s.m_dev, family_col], c.alpaca_txt[s.a_dev, family_col]]) > 0.5
    if params["kind"] == "linear":
        # Per task family: one threshold sends the same share of open prompts and of multiple choice.
        open_map, closed_map = family_rank_maps(dev_z, dev_closed)
        params["families"] = {"feature": family_col, "name": FAMILY_FEATURE,
                              "open": open_map.to_table(), "closed": closed_map.to_table()}
        open_map, closed_map = RankMap.from_table(params["families"]["open"]), RankMap.from_table(params["families"]["closed"])
        dev_prob = np.where(dev_closed, closed_map.batch(dev_z), open_map.batch(dev_z))
    else:
        dev_prob = _sigmoid(dev_z)
    m_dev_prob, a_dev_prob = dev_prob[: len(m_oof)], dev_prob[len(m_oof) :]
    # Through the manifest's table and back: thresholds here are exactly the ones the gateway resolves.
    curve = GapCurve.from_table(pooled_curve(m_dev_prob, m_dev, a_dev_prob, a_dev).to_table())
    target_value, target_figures = choose_target(curve, m_dev_prob, m_dev)
    default_target = (TARGET_MODE, target_value)
    default_threshold = threshold_for_target(curve, *default_target)
    router = Router.from_params(params, curve=curve, default_threshold=default_threshold, manifest={})
    m_test, a_test = c.mmlu.take(s.m_test), c.alpaca.take(s.a_test)
    m_prob = router.score_batch(m_test.prompts, c.emb[s.m_test])
    a_prob = router.score_batch(a_test.prompts, c.alpaca_emb[s.a_test])
    everyday_prob = router.score_batch(c.everyday, c.everyday_emb)
    math_prob = router.score_batch(math_sample(cfg.data_dir)[0], c.math_emb)

    held_out = {
        "mmlu": routing_metrics(m_prob, m_test, calibrated="families" not in params)
        | {"mean_within_subject_auc": within_group_auc(m_prob, m_test)},
        "alpaca": routing_metrics(a_prob, a_test, calibrated="families" not in params)
        | {"mean_within_source_auc": within_group_auc(a_prob, a_test)},
    }
    manifest: dict[str, Any] = {
        "model": {"name": best.name, "kind": params["kind"], "features": best.features, "family": best.family,
                  "c": best.c, "fe": best.fe, "mmlu_target": best.mmlu_target, "alpaca_weight": best.alpaca_weight, "alpaca_label": best.alpaca_label,
                  "math_weight": best.math_weight, "gate": best.gate, "neutral": best.neutral, "platt": {"slope": slope, "offset": offset}},
        "embedding": {"model": EMBEDDING_MODEL_NAME, "dimension": int(c.emb.shape[1]),
                      "text": "policies.cache.scope.embedding_text (last user turn, NFKC + whitespace "
                              "normalised, first 4000 chars)",
                      "normalized": True, "train_max_seq_length": RUNTIME_MAX_SEQ_LENGTH,
                      "same_as_runtime": True},
        "label": {
            "mmlu": "strong needed = weak model wrong and strong model right; quality = correctness",
            "alpaca": f"strong needed = the judge prefers the reference with p >= {1 - (ALPACA_CLEAR_LOSS - 1):.2f} "
                      f"(pref <= {ALPACA_CLEAR_LOSS}); quality = judge's win probability vs the reference "
                      "(weak: pref - 1, strong: the reference itself, 0.5)",
        },
        "data": {
            "mmlu_rows": len(c.mmlu.prompts), "mmlu_subjects": int(len(np.unique(c.mmlu.subjects))),
            "weak_model": WEAK_COLUMN, "strong_model": STRONG_COLUMN,
            "mmlu_rows_per_subject_cap": PER_SUBJECT, "mmlu_sample_seed": SUBJECT_SEED,
            "alpaca_rows": len(c.alpaca.prompts), "alpaca_file": ALPACA_FILE,
            "alpaca_weak_model": ALPACA_WEAK, "alpaca_strong_model": ALPACA_REFERENCE,
            "alpaca_panel": list(ALPACA_PANEL),
            "math_rows": int(len(c.math_level)), "math_sample_seed": MATH_SEED,
            "everyday_rows": len(c.everyday),
            "source": "../shared/data/router (RouteLLM MMLU, AlpacaEval preferences, MATH levels, OpenAssistant prompts)",
        },
        "split": {"method": "hold out whole MMLU subjects and whole AlpacaEval sources", "seed": cfg.seed,
                  "folds": cfg.folds, "dev_rows": int(len(s.m_dev)), "test_rows": int(len(s.m_test)),
                  "test_subjects": s.test_subjects,
                  "alpaca_dev_rows": int(len(s.a_dev)), "alpaca_test_rows": int(len(s.a_test)),
                  "alpaca_test_sources": list(ALPACA_TEST_SOURCES),
                  "selection": "out-of-fold scores on the dev rows, GroupKFold over MMLU subjects and AlpacaEval "
                               "sources; test rows are never used for selection, calibration or thresholds"},
        "selection": f"highest mean of the MMLU and AlpacaEval selection-fold APGR among shippable candidates; "
                     f"candidates within {APGR_TIE} of it are tied, and the tie goes to the best AUC of MATH level 4-5 "
                     "vs 1-2 on a quarter of the MATH sample no candidate trains on (rows 1 mod 4; the manifest's "
                     "math_levels diagnostic reads rows 3 mod 4), then to the mean within-subject AUC",
        "candidates": rows,
        "metrics": {"held_out_test": held_out,
                    "target_checks": {
                        "mmlu": target_checks(curve, m_prob, m_test),
                        "alpaca": target_checks(curve, a_prob, a_test),
                        "pooled": pooled_target_checks(curve, m_prob, m_test, a_prob, a_test),
                    },
                    "math_levels": _math_signal(math_prob[math_rows(c, MATH_REPORT)], c.math_level[math_rows(c, MATH_REPORT)]),
                    "everyday": _everyday_signal(everyday_prob, default_threshold)},
        "calibration": {"source": "selection-fold calibrated scores of MMLU dev subjects and AlpacaEval dev sources, "
                                  "each source weighing half; quality = fraction of the strong model's quality",
                        "curve": curve.to_table()},
        "default_target": {"mode": default_target[0], "value": default_target[1],
                           "chosen": f"the {TARGET_MODE} on a 0.05 grid closest to cost <= {TIER_COST_CEILING} at quality "
                                     f">= {TIER_QUALITY_FLOOR} x all-strong on the MMLU selection folds (cost tier at "
                                     f"{COST_TIER_PRICE} of the strong per token; smallest worst shortfall, then the "
                                     "cheapest); policies/defaults/router.yaml ships it",
                           **target_figures},
        "default_threshold": default_threshold,
        "seed": cfg.seed,
        "train_seconds": round(time.perf_counter() - started, 1),
    }
    if cfg.out is not None:
        save_artifact(cfg.out, params, manifest)
    return manifest


def _math_signal(prob: np.ndarray, level: np.ndarray) -> dict[str, float | dict[str, float]]:
    """Does the router rank harder MATH problems higher? (a difficulty signal, not a routing label).

    Read on the odd rows of the MATH sample, which no candidate trains on.
    """
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
