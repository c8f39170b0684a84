"""The shipped artifact loads without ../shared, scores in [0, 1], and refuses mismatched manifests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import sklearn

from policies.router import Router, RouterArtifactError
from policies.router.artifact import MANIFEST_FILE, MODEL_FILE, default_artifact_dir
from policies.router.features import FEATURE_VERSION


def edit_manifest(directory: Path, **changes: object) -> None:
    path = directory / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "sklearn":
            manifest["libraries"]["scikit-learn"] = value
        else:
            manifest[key] = value
    path.write_text(json.dumps(manifest))


def unit_vectors(n: int, d: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_shipped_artifact_is_small_and_described() -> None:
    directory = default_artifact_dir()
    assert (directory / MODEL_FILE).stat().st_size + (directory / MANIFEST_FILE).stat().st_size < 2_000_000
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    assert manifest["feature_version"] == FEATURE_VERSION
    assert {c["name"] for c in manifest["candidates"]} >= {"mmlu_only_lr", "lr_embedding", "lr_text", "lr_both_fe_source"}
    assert manifest["model"]["name"] in {c["name"] for c in manifest["candidates"] if c["shippable"]}


def test_scores_are_probabilities(shipped_router: Router) -> None:
    emb = unit_vectors(50, shipped_router.dimension, 0)
    mcq = "Which gas is most abundant in air?\nA. Oxygen\nB. Nitrogen\nC. Argon\nD. Carbon dioxide\nAnswer:"
    prompts = ["hi"] * 17 + ["Prove that $\\sum_{k=1}^n k = n(n+1)/2$ step by step."] * 17 + [mcq] * 16
    batch = shipped_router.score_batch(prompts, emb)
    assert ((batch >= 0) & (batch <= 1)).all()
    single = [shipped_router.score(p, e) for p, e in zip(prompts, emb)]
    np.testing.assert_allclose(single, batch, rtol=1e-5, atol=1e-7)
    assert len(set(np.round(batch, 6))) > 1  # the score depends on its input


def test_multiple_choice_gate_is_part_of_the_score(shipped_router: Router, sentence_model) -> None:
    from policies.embedding.embedder import encode

    if shipped_router.gate_index is None:
        pytest.skip("the shipped model has no format gate")
    from policies.router.features import FEATURE_NAMES

    assert FEATURE_NAMES[shipped_router.gate_index] == "closed_question"
    mcq = "Which gas is most abundant in air?\nA. Oxygen\nB. Nitrogen\nC. Argon\nD. Carbon dioxide\nAnswer:"
    plain = "Which gas is most abundant in air? Oxygen, nitrogen, argon or carbon dioxide?"
    emb = encode(sentence_model, [mcq])[0]  # one vector for both: only the text features differ
    assert 0.0 < shipped_router.score(mcq, emb) < 1.0
    assert shipped_router.score(mcq, emb) != pytest.approx(shipped_router.score(plain, emb), abs=1e-9)


def test_wrong_embedding_size_is_a_clear_error(shipped_router: Router) -> None:
    with pytest.raises(ValueError, match="384-d embedding, got 10-d"):
        shipped_router.score("hi", np.zeros(10))


def test_feature_version_mismatch(artifact_copy: Path) -> None:
    edit_manifest(artifact_copy, feature_version=FEATURE_VERSION + 1)
    with pytest.raises(RouterArtifactError, match="text features v.*make router-model"):
        Router.load(artifact_copy)


def test_sklearn_version_mismatch(artifact_copy: Path) -> None:
    edit_manifest(artifact_copy, sklearn="0.1.0")
    with pytest.raises(RouterArtifactError, match=f"scikit-learn 0.1.0 but {sklearn.__version__}"):
        Router.load(artifact_copy)


def test_damaged_model_file(artifact_copy: Path) -> None:
    with (artifact_copy / MODEL_FILE).open("ab") as fh:
        fh.write(b"x")
    with pytest.raises(RouterArtifactError, match="does not match its manifest's hash"):
        Router.load(artifact_copy)


def test_missing_artifact(tmp_path: Path) -> None:
    with pytest.raises(RouterArtifactError, match="no router manifest"):
        Router.load(tmp_path)


def test_loads_from_a_copy_by_manifest_path(artifact_copy: Path, shipped_router: Router) -> None:
    router = Router.load(artifact_copy / MANIFEST_FILE)
    emb = unit_vectors(1, router.dimension, 1)[0]
    assert router.score("why?", emb) == pytest.approx(shipped_router.score("why?", emb))


def test_embeddings_other_than_the_gateways_are_refused(artifact_copy: Path) -> None:
    manifest = json.loads((artifact_copy / MANIFEST_FILE).read_text())
    embedding = manifest["embedding"]
    assert embedding["model"] == "all-MiniLM-L6-v2" and embedding["train_max_seq_length"] == 256
    edit_manifest(artifact_copy, embedding={**embedding, "train_max_seq_length": 128})
    with pytest.raises(RouterArtifactError, match="128 word pieces, the gateway embeds 256"):
        Router.load(artifact_copy)
    edit_manifest(artifact_copy, embedding={**embedding, "model": "bge-small"})
    with pytest.raises(RouterArtifactError, match="'bge-small' embeddings"):
        Router.load(artifact_copy)
