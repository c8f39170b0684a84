"""Features, the artifact round trip, threshold curves and the policy figures, on synthetic fits."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policies.edge_quality.artifact import MANIFEST_FILE, MODEL_FILE, EdgeCalibrationError, default_artifact_dir, save_artifact
from policies.edge_quality.calibrate import build_curve, limit_probes
from policies.edge_quality.evaluate import ItemOutcome, auroc, local_figures, policy_report
from policies.edge_quality.features import ANSWER_FEATURES, PROMPT_FEATURES, answer_features, prompt_features
from policies.edge_quality.model import NEVER, Curve, EdgeCalibration, load_for_model
from policies.edge_quality.probes import load_probes


@dataclass(frozen=True)
class Tok:
    logprob: float
    entropy: float


def test_prompt_features_shape_and_cues() -> None:
    f = dict(zip(PROMPT_FEATURES, prompt_features("What is 1234 * 5678?")))
    assert len(prompt_features("")) == len(PROMPT_FEATURES)
    assert f["op_multiply_divide"] == 1.0 and f["op_add_sub"] == 0.0
    assert f["operand_digits"] == 8.0 and f["mult_digit_load"] == 8.0
    assert f["max_number_digits"] == 4.0 and f["q_what"] == 1.0
    mc = dict(zip(PROMPT_FEATURES, prompt_features("Which is a gas?\nA. iron\nB. oxygen\nC. salt\nD. wood")))
    assert mc["mc_options"] == 4.0 and mc["op_multiply_divide"] == 0.0
    yn = dict(zip(PROMPT_FEATURES, prompt_features("Is 17 greater than 23? Answer yes or no.")))
    assert yn["yes_no_cue"] == 1.0
    word = dict(zip(PROMPT_FEATURES, prompt_features("Write the word 'banana' in uppercase.")))
    assert word["word_task_cue"] == 1.0 and word["quoted_len"] > 0
    assert np.isfinite(prompt_features("x" * 100_000)).all()


def test_prompt_features_same_for_raw_and_embedded_text() -> None:
    from policies.cache.scope import embedding_text

    raw = "Pick one.\n\nWhich is a gas?\nA. iron\nB. oxygen\n  C. salt\nD. wood\n"
    embedded = embedding_text({"messages": [{"role": "user", "content": raw}]}) or ""
    assert embedded != raw
    assert np.array_equal(prompt_features(raw), prompt_features(embedded))


def test_answer_features() -> None:
    f = dict(zip(ANSWER_FEATURES, answer_features(0.5, [-0.1, -2.0, -0.01], [0.5, 3.0, 0.1])))
    assert f["prior_logit"] == pytest.approx(0.0)
    assert f["p_min"] == pytest.approx(np.exp(-2.0))
    assert f["mean_logprob"] == pytest.approx(-0.7033333)
    assert f["first_logprob"] == pytest.approx(-0.1)
    assert f["max_entropy"] == pytest.approx(3.0)
    assert f["log_tokens"] == pytest.approx(np.log(4))
    assert np.isfinite(answer_features(1.0, [], [])).all()
    assert np.isfinite(answer_features(0.0, [float("-inf")], [1.0])).all()


def synthetic(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    rng = np.random.default_rng(seed)
    scores = rng.random(500)
    correct = rng.random(500) < scores
    curve = build_curve(scores, correct)
    params = {
        "prior_w_embedding": rng.normal(size=384) * 0.1,
        "prior_w_features": rng.normal(size=len(PROMPT_FEATURES)) * 0.1,
        "prior_mean": np.zeros(len(PROMPT_FEATURES)),
        "prior_scale": np.ones(len(PROMPT_FEATURES)),
        "prior_bias": np.asarray([0.1]),
        "confidence_w": rng.normal(size=len(ANSWER_FEATURES)),
        "confidence_mean": np.zeros(len(ANSWER_FEATURES)),
        "confidence_scale": np.ones(len(ANSWER_FEATURES)),
        "confidence_bias": np.asarray([-0.2]),
    }
    manifest = {
        "gguf": {"file": "model.gguf", "sha256": "0" * 64, "size": 1},
        "curves": {"prior": curve.to_manifest(), "confidence": curve.to_manifest()},
        "defaults": {"target_local_accuracy": 0.9, "gate": 0.2, "confidence": 0.6, "prior_only": 0.7},
    }
    return params, manifest


def test_artifact_round_trip_is_byte_stable(tmp_path: Path) -> None:
    params, manifest = synthetic()
    a = save_artifact(tmp_path / "a", params, manifest)
    b = save_artifact(tmp_path / "b", params, manifest)
    assert (a / MODEL_FILE).read_bytes() == (b / MODEL_FILE).read_bytes()
    loaded = EdgeCalibration.load(a)
    direct = EdgeCalibration(params, json.loads((a / MANIFEST_FILE).read_text()))
    emb = np.random.default_rng(1).normal(size=384).astype(np.float32)
    emb /= np.linalg.norm(emb)
    text = "What is 7 + 5?"
    assert loaded.prior(text, emb) == pytest.approx(direct.prior(text, emb))
    assert loaded.prior_batch([text], emb[None, :])[0] == pytest.approx(loaded.prior(text, emb))
    toks = [Tok(-0.1, 0.3), Tok(-1.5, 2.0)]
    c = loaded.confidence(0.7, toks, "stop")
    assert 0.0 < c < 1.0
    assert c == pytest.approx(loaded.confidence_from_arrays(0.7, [-0.1, -1.5], [0.3, 2.0], "stop"))
    assert loaded.defaults.confidence == 0.6 and loaded.defaults.gate == 0.2


def test_unfinished_or_empty_answers_get_zero_confidence() -> None:
    params, manifest = synthetic()
    cal = EdgeCalibration(params, manifest)
    toks = [Tok(-0.01, 0.1)]
    for reason in ("length", "loop", "low_confidence"):
        assert cal.confidence(0.9, toks, reason) == 0.0
    assert cal.confidence(0.9, [], "stop") == 0.0


def test_tampered_or_missing_artifact_is_refused(tmp_path: Path) -> None:
    params, manifest = synthetic()
    out = save_artifact(tmp_path / "a", params, manifest)
    with (out / MODEL_FILE).open("ab") as fh:
        fh.write(b"x")
    with pytest.raises(EdgeCalibrationError, match="hash"):
        EdgeCalibration.load(out)
    with pytest.raises(EdgeCalibrationError):
        EdgeCalibration.load(tmp_path / "nowhere")
    bad = save_artifact(tmp_path / "b", params, manifest)
    row = json.loads((bad / MANIFEST_FILE).read_text())
    row["feature_version"] = -1
    (bad / MANIFEST_FILE).write_text(json.dumps(row))
    with pytest.raises(EdgeCalibrationError, match="features"):
        EdgeCalibration.load(bad)


def test_matches_and_fallback(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from policies.artifact_dir import sha256_file

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake model")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF other model")
    params, manifest = synthetic()
    manifest["gguf"] = {"file": gguf.name, "sha256": sha256_file(gguf), "size": gguf.stat().st_size}
    out = save_artifact(tmp_path / "a", params, manifest)
    cal = EdgeCalibration.load(out)
    assert cal.matches(gguf) and not cal.matches(other) and not cal.matches(tmp_path / "missing.gguf")
    assert load_for_model(gguf, out) is not None
    with caplog.at_level(logging.WARNING):
        assert load_for_model(other, out) is None
        assert load_for_model(gguf, tmp_path / "nowhere") is None
    assert "without an edge prior" in caplog.text


def test_curve_monotone_and_thresholds_ordered() -> None:
    rng = np.random.default_rng(3)
    scores = rng.random(2000)
    correct = rng.random(2000) < scores**0.5
    curve = build_curve(scores, correct)
    assert np.all(np.diff(curve.thresholds) > 0)
    assert np.all(np.diff(curve.kept_share) <= 1e-12)
    assert np.all(np.diff(curve.local_recall) <= 1e-12)
    assert np.all(np.diff(curve.local_accuracy) >= -1e-12)
    accs = [curve.threshold("min_local_accuracy", v) for v in (0.7, 0.8, 0.85, 0.9, 0.95)]
    assert accs == sorted(accs)
    esc = [curve.threshold("max_escalation_share", v) for v in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert esc == sorted(esc)
    rec = [curve.threshold("min_local_recall", v) for v in (0.99, 0.9, 0.7, 0.5)]
    assert rec == sorted(rec)
    assert curve.threshold("min_local_accuracy", 1.01) == NEVER
    t = curve.threshold("max_escalation_share", 0.3)
    assert (scores >= t).mean() >= 0.7 - 1e-9
    with pytest.raises(ValueError):
        curve.threshold("nonsense", 0.5)
    again = Curve.from_manifest(curve.to_manifest())
    assert again.threshold("min_local_accuracy", 0.9) == pytest.approx(curve.threshold("min_local_accuracy", 0.9))


def test_auroc_and_figures() -> None:
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(5)
    y = rng.random(300) < 0.4
    s = np.round(rng.random(300) + y * 0.3, 2)  # with ties
    assert auroc(y, s) == pytest.approx(roc_auc_score(y, s))
    assert auroc([True, True], [0.1, 0.2]) is None
    f = local_figures(np.array([True, False, True, True]), np.array([True, True, False, False]))
    assert f["local_precision"] == 0.5 and f["local_recall"] == pytest.approx(1 / 3)
    assert f["edge_share"] == 0.5 and f["overall_accuracy"] == 0.75
    items = [ItemOutcome("a", bool(c), float(p), float(p)) for c, p in zip(y, s / 1.3)]
    report = policy_report(items, gate=0.1, confidence=0.5, prior_only=0.5)
    assert set(report) == {"prior_only", "cascade_only", "prior_cascade", "random"}
    assert report["random"]["edge_share"] == report["prior_cascade"]["edge_share"]


def test_limit_spreads_over_families() -> None:
    probes = limit_probes(load_probes(), 14)
    assert len(probes) == 28
    assert len({p.family for p in probes if p.split == "held_out"}) == 7


def test_shipped_artifact_loads_fast() -> None:
    if not (default_artifact_dir() / MANIFEST_FILE).is_file():
        pytest.skip("no shipped artifact yet")
    cal = EdgeCalibration.load()
    emb = np.ones(384, dtype=np.float32) / np.sqrt(384)
    toks = [Tok(-0.2, 0.5)] * 12
    text = "What is the capital of France?"
    rounds = []
    for _ in range(5):  # the best round: what the machine's other work added to a round is left out
        started = time.perf_counter()
        for _ in range(40):
            p = cal.prior(text, emb)
            cal.confidence(p, toks, "stop")
        rounds.append((time.perf_counter() - started) / 40)
    # ~0.1 ms measured. Not a latency target (those belong in bench/): a bound 200x that, which only
    # work of another kind per call (loading the artifact, running a model) reaches on any machine.
    assert min(rounds) < 20e-3
    for stage in ("prior", "confidence"):
        assert 0.0 <= cal.threshold(stage, "max_escalation_share", 0.5) <= 1.0
    d = cal.defaults
    assert 0.0 <= d.gate <= d.prior_only or d.prior_only == NEVER
