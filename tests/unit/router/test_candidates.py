"""Folding a fitted scaler + logistic regression into raw-feature weights keeps its decisions."""

from __future__ import annotations

import numpy as np
import pytest

from policies.router.candidates import Candidate, TrainSet, decision, fit_candidate
from policies.router.features import FEATURE_NAMES


@pytest.fixture(scope="module")
def data() -> TrainSet:
    rng = np.random.default_rng(3)
    n, d, t = 400, 16, len(FEATURE_NAMES)
    emb = rng.normal(size=(n, d)).astype(np.float32)
    txt = rng.normal(loc=2.0, scale=3.0, size=(n, t))
    label = ((emb[:, 0] + 0.3 * txt[:, 1] + rng.normal(scale=0.5, size=n)) > 0.5).astype(int)
    return TrainSet(emb=emb, txt=txt, target=label.astype(float), weight=np.ones(n),
                    group=np.where(np.arange(n) % 3 == 0, "a", "b"))


@pytest.mark.parametrize("features", ["embedding", "text", "both"])
def test_folded_weights_match_the_fit(data: TrainSet, features: str) -> None:
    fitted = fit_candidate(Candidate("x", "lr", features, c=0.5), data, seed=0)
    ridge = fit_candidate(Candidate("r", "ridge", features, c=0.5), data, seed=0)
    cols = {"embedding": data.emb, "text": data.txt, "both": np.hstack([data.emb, data.txt])}[features]
    scaled = (cols.astype(np.float64) - cols.mean(axis=0)) / np.where(cols.std(axis=0) > 0, cols.std(axis=0), 1.0)
    np.testing.assert_allclose(decision(fitted, data.emb, data.txt), fitted.estimator.decision_function(scaled),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(decision(ridge, data.emb, data.txt), ridge.estimator.predict(cols.astype(np.float64)),
                               rtol=1e-6, atol=1e-8)


def test_group_intercepts_are_dropped_at_serving_time(data: TrainSet) -> None:
    # Shift the base rate of group "a" only: with group intercepts the shared weights stay on the
    # planted signal, and the served bias is the average group's.
    shifted = TrainSet(emb=data.emb, txt=data.txt, target=np.where(data.group == "a", 1.0, data.target),
                       weight=data.weight, group=data.group)
    fe = fit_candidate(Candidate("fe", "lr", "both", c=0.5, fe="source"), shifted, seed=0)
    assert fe.linear is not None
    w_emb, w_text, bias = fe.linear
    assert w_emb.shape == (data.emb.shape[1],) and w_text.shape == (len(FEATURE_NAMES),) and np.isfinite(bias)
    b = data.group == "b"
    assert np.corrcoef(decision(fe, data.emb[b], data.txt[b]), data.emb[b, 0])[0, 1] > 0.5


def test_soft_targets_sit_between_hard_ones(data: TrainSet) -> None:
    def mean_prob(target: float) -> float:
        soft = TrainSet(emb=data.emb, txt=data.txt, target=np.full(len(data.target), target), weight=data.weight,
                        group=data.group)
        z = decision(fit_candidate(Candidate("s", "lr", "text", c=0.5), soft, seed=0), data.emb, data.txt)
        return float(np.mean(1 / (1 + np.exp(-z))))

    assert mean_prob(0.2) == pytest.approx(0.2, abs=0.02)
    assert mean_prob(0.7) == pytest.approx(0.7, abs=0.02)


def test_trainset_rejects_ragged_columns(data: TrainSet) -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        TrainSet(emb=data.emb, txt=data.txt[:-1], target=data.target, weight=data.weight, group=data.group)


def test_nonlinear_families_give_probabilities(data: TrainSet) -> None:
    for cand in [Candidate("h", "hgb", "both"), Candidate("k", "knn", "embedding")]:
        p = decision(fit_candidate(cand, data, seed=0), data.emb, data.txt)
        assert p.shape == (len(data.target),) and (p >= 0).all() and (p <= 1).all()
    with pytest.raises(ValueError, match="unknown model family"):
        fit_candidate(Candidate("z", "svm", "both"), data, seed=0)


def test_flat_forest_walk_matches_sklearn(data: TrainSet) -> None:
    from policies.router.model import Router

    fitted = fit_candidate(Candidate("h", "hgb", "both"), data, seed=0)
    router = Router.from_params(
        {"kind": "sklearn", "dimension": data.emb.shape[1], "estimator": fitted.estimator,
         "features": "both", "platt": (1.3, -0.2)},
        curve=None, default_threshold=0.5, manifest={},
    )
    assert router.fast is not None
    # Fresh rows: training rows can sit exactly on a split threshold, where rounding in the last bit decides.
    fresh = np.random.default_rng(9).normal(size=(60, data.emb.shape[1])).astype(np.float32)
    prompts = ["q", "Why?", "Solve $x^2=4$ step by step"] * 20
    batch = router.score_batch(prompts, fresh)
    np.testing.assert_allclose([router.score(p, e) for p, e in zip(prompts, fresh)], batch, rtol=1e-9, atol=1e-12)
    logits = np.log(batch / (1 - batch))
    assert np.ptp(logits) > 0.1  # the trees split these rows apart


def test_mlp_candidate_and_its_numpy_copy_match_sklearn(data: TrainSet) -> None:
    from policies.router.model import Router
    from policies.router.trees import FlatMLP

    fitted = fit_candidate(Candidate("m", "mlp", "both", extra={"pca": 8, "hidden": 8, "alpha": 0.1}), data, seed=0)
    router = Router.from_params(
        {"kind": "sklearn", "dimension": data.emb.shape[1], "estimator": fitted.estimator,
         "features": "both", "platt": (0.9, 0.1)},
        curve=None, default_threshold=0.5, manifest={},
    )
    assert isinstance(router.fast, FlatMLP)
    fresh = np.random.default_rng(5).normal(size=(40, data.emb.shape[1])).astype(np.float32)
    prompts = ["q", "Why?", "Solve $x^2=4$ step by step", "list three colours"] * 10
    batch = router.score_batch(prompts, fresh)  # sklearn's predict_proba
    np.testing.assert_allclose([router.score(p, e) for p, e in zip(prompts, fresh)], batch, rtol=1e-7, atol=1e-9)
    assert np.ptp(batch) > 0.01


def test_hgb_hyperparameters_come_from_extra(data: TrainSet) -> None:
    fitted = fit_candidate(Candidate("h", "hgb", "both", extra={"pca": 4, "max_leaf_nodes": 3}), data, seed=0)
    assert fitted.estimator[0].named_transformers_["pca"].n_components == 4
    assert fitted.estimator[-1].max_leaf_nodes == 3
