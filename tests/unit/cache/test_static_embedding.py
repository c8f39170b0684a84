"""The static embedding: the shipped table loads without torch, encodes like model2vec, refuses damage."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from policies.embedding.static import ARTIFACT_DIR, StaticEmbedding, StaticEmbeddingError, manifest_of
from policies.embedding.static.distill import quantise, write_npz


@pytest.fixture(scope="module")
def static() -> StaticEmbedding:
    return StaticEmbedding.load()


def test_shipped_table_matches_its_manifest_and_encodes_unit_rows(static: StaticEmbedding) -> None:
    manifest = manifest_of()
    assert static.dimension == manifest["storage"]["dimension"]
    assert static.vocabulary == manifest["distillation"]["vocabulary"]
    texts = ["How do I reverse a list in Python?", "hi", "", "Zürich's café — 5€ 🍮"]
    rows = static.encode(texts)
    assert rows.shape == (4, static.dimension) and rows.dtype == np.float32
    assert np.allclose(np.linalg.norm(rows[[0, 1, 3]], axis=1), 1.0, atol=1e-5)
    assert not rows[2].any()  # nothing to average: a zero row, never NaN
    alone = np.stack([static.encode([t])[0] for t in texts])
    assert np.array_equal(alone, rows)
    assert static.encode([]).shape == (0, static.dimension)


def test_a_paraphrase_is_nearer_than_another_request(static: StaticEmbedding) -> None:
    query, paraphrase, other = static.encode(
        ["How do I reverse a list in Python?", "python: reverse the order of a list", "What is the capital of France?"]
    )
    assert float(query @ paraphrase) > float(query @ other) + 0.1


def test_serving_imports_neither_torch_nor_model2vec() -> None:
    code = ("import sys; from policies.embedding.static import StaticEmbedding; StaticEmbedding.load().encode(['hi']);"
            "print(sorted(m for m in ('torch', 'model2vec', 'transformers', 'sentence_transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])  # fmt: skip
    assert out.stdout.strip() == "[]"


def test_a_damaged_or_foreign_artifact_is_refused(tmp_path: Path) -> None:
    copy = tmp_path / "static"
    shutil.copytree(ARTIFACT_DIR, copy)
    vectors = copy / "vectors.npz"
    vectors.write_bytes(vectors.read_bytes()[:-10])
    with pytest.raises(StaticEmbeddingError, match="does not match its manifest's hash"):
        StaticEmbedding.load(copy)
    shutil.copy(ARTIFACT_DIR / "vectors.npz", vectors)
    manifest = copy / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"format": 1', '"format": 99'))
    with pytest.raises(StaticEmbeddingError, match="format 99"):
        StaticEmbedding.load(copy)


def test_int8_rows_round_trip_and_the_archive_is_byte_stable(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(50, 16)).astype(np.float32) * rng.uniform(0.01, 3, size=(50, 1)).astype(np.float32)
    vectors[7] = 0.0
    table, scales = quantise(vectors)
    assert table.dtype == np.int8 and scales[7] == 1.0 and not table[7].any()
    back = table.astype(np.float32) * scales[:, None]
    assert np.abs(back - vectors).max(axis=1).max() <= (scales / 2 + 1e-6).max()
    write_npz(tmp_path / "a.npz", {"table": table, "scales": scales})
    write_npz(tmp_path / "b.npz", {"table": table, "scales": scales})
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    with np.load(tmp_path / "a.npz") as data:
        assert np.array_equal(data["table"], table)


@pytest.mark.slow
def test_distillation_of_a_small_transformer_is_offline_and_checked(tmp_path: Path) -> None:
    pytest.importorskip("model2vec", reason="model2vec is in the `distill` extra (make static-embedding)")
    pytest.importorskip("skeletoken", reason="skeletoken is in the `distill` extra (make static-embedding)")
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from policies.embedding.sentence_model import bundled_model_path
    from policies.embedding.static.distill import build

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_model_path()), local_files_only=True)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(tmp_path / "model")  # fmt: skip
    tokenizer.save_pretrained(tmp_path / "model")
    manifest = build(tmp_path / "out", pca_dims=8, model_dir=tmp_path / "model")
    assert manifest["probe_cosine_to_float_min"] >= 0.999  # the loader agrees with model2vec's own encode
    static = StaticEmbedding.load(tmp_path / "out")
    assert static.dimension == 8 and static.vocabulary == manifest["distillation"]["vocabulary"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["manifest.json", "tokenizer.json", "vectors.npz"]
