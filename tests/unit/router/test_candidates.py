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
    return TrainSet(
        emb=emb, txt=txt, label=label, weak_wrong=label, gain=label,
        math_emb=rng.normal(size=(60, d)).astype(np.float32), math_txt=rng.normal(size=(60, t)),
        math_level=rng.integers(1, 6, 60),
    )


@pytest.mark.parametrize("features", ["embedding", "text", "both"])
def test_folded_weights_match_the_pipeline(data: TrainSet, features: str) -> None:
    fitted = fit_candidate(Candidate("x", "lr", features, c=0.5), data, seed=0)
    ridge = fit_candidate(Candidate("r", "ridge", features, c=0.5, target="gain"), data, seed=0)
    cols = {"embedding": data.emb, "text": data.txt, "both": np.hstack([data.emb, data.txt])}[features]
    expected = fitted.estimator.decision_function(cols.astype(np.float64))
    np.testing.assert_allclose(decision(fitted, data.emb, data.txt), expected, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(decision(ridge, data.emb, data.txt), ridge.estimator.predict(cols.astype(np.float64)),
                               rtol=1e-6, atol=1e-8)


def test_stacked_math_feature_folds_too(data: TrainSet) -> None:
    fitted = fit_candidate(Candidate("x", "lr", "both", c=0.5, aux="math_difficulty"), data, seed=0)
    assert fitted.linear is not None
    w_emb, w_text, _ = fitted.linear
    assert w_emb.shape == (data.emb.shape[1],) and w_text.shape == (len(FEATURE_NAMES),)
    scores = decision(fitted, data.emb, data.txt)
    # The planted signal (first embedding column) must be picked up.
    assert np.corrcoef(scores, data.emb[:, 0])[0, 1] > 0.5


def test_nonlinear_families_give_probabilities(data: TrainSet) -> None:
    for cand in [Candidate("h", "hgb", "both"), Candidate("k", "knn", "embedding")]:
        p = decision(fit_candidate(cand, data, seed=0), data.emb, data.txt)
        assert p.shape == (len(data.label),) and (p >= 0).all() and (p <= 1).all()
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
