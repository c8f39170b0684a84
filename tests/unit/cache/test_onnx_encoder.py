"""The ONNX embedding backend: the same vectors as sentence-transformers, cached, self-repairing."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from policies.embedding.embedder import DIMENSION, Embedder, bundled_model_path, encode, load_encoder
from policies.embedding.onnx_encoder import onnx_path_for

pytestmark = pytest.mark.slow

TEXTS = [
    "hi",
    "How do I convert Celsius to Fahrenheit?",
    "How do I convert Fahrenheit to Celsius?",
    "Zürich's café serves crème brûlée — 5€ 🍮",
    "def f(x):\n    return x ** 2  # square",
    # Longer than the model's 256 word pieces: both backends must truncate the same way.
    " ".join(f"token{i}" for i in range(600)),
]


def test_matches_sentence_transformers_alone_and_in_mixed_batches(sentence_encoder, sentence_model) -> None:
    want = encode(sentence_model, TEXTS)
    batched = sentence_encoder.encode(TEXTS)
    alone = np.stack([sentence_encoder.encode([t])[0] for t in TEXTS])
    for got in (batched, alone):
        assert got.shape == (len(TEXTS), DIMENSION) and got.dtype == np.float32
        cosines = (got * want).sum(1)
        assert cosines.min() > 0.99999, cosines
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    assert sentence_encoder.encode([]).shape == (0, DIMENSION)


def test_cached_graph_is_reused_and_a_damaged_one_is_exported_again(sentence_encoder, tmp_path: Path, caplog) -> None:
    cached = onnx_path_for(bundled_model_path(), tmp_path)
    shutil.copyfile(sentence_encoder.path, cached)
    before = cached.stat().st_mtime_ns
    reused = load_encoder("onnx", cache_dir=tmp_path)
    assert reused.backend == "onnx" and reused.path == cached and cached.stat().st_mtime_ns == before

    cached.write_bytes(b"not an onnx graph")
    with caplog.at_level(logging.WARNING):
        repaired = load_encoder("onnx", cache_dir=tmp_path)
    assert "does not load" in caplog.text
    assert repaired.backend == "onnx"
    assert cached.stat().st_size > 1_000_000
    assert not list(tmp_path.glob("*.tmp")), "the export left a temporary file behind"
    assert cached.stat().st_mode & 0o777 == 0o644, "readable by a gateway running as another user than the export"
    vector = repaired.encode(["How do I convert Celsius to Fahrenheit?"])[0]
    assert float(vector @ sentence_encoder.encode(["How do I convert Celsius to Fahrenheit?"])[0]) > 0.99999


def test_unusable_cache_dir_falls_back_to_torch(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING):
        encoder = load_encoder("onnx", cache_dir=blocker / "models")
    assert encoder.backend == "torch"
    assert "using torch" in caplog.text
    assert encoder.encode(["hello"]).shape == (1, DIMENSION)


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="backend"):
        load_encoder("tensorflow")


async def test_embedder_serves_with_the_onnx_backend_by_default(sentence_encoder) -> None:
    emb = Embedder(cache_dir=Path(sentence_encoder.path).parent)
    await emb.start()
    try:
        assert emb.backend_name == "onnx"
        vector = await emb.embed("How do I convert Celsius to Fahrenheit?")
        assert float(vector @ sentence_encoder.encode(["How do I convert Celsius to Fahrenheit?"])[0]) > 0.99999
    finally:
        await emb.close()


def test_int8_graph_is_quantised_from_the_float32_export_checked_and_reused(sentence_encoder, tmp_path: Path) -> None:
    shutil.copyfile(sentence_encoder.path, onnx_path_for(bundled_model_path(), tmp_path))
    int8 = load_encoder("onnx", cache_dir=tmp_path, precision="int8")
    path = onnx_path_for(bundled_model_path(), tmp_path, "int8")
    assert int8.backend == "onnx" and int8.precision == "int8" and int8.path == path
    # the word-piece table (47 MB) stays float32; the matmul weights (~42 MB) shrink to a quarter
    assert path.stat().st_size < 0.7 * sentence_encoder.path.stat().st_size, "the matmul weights are stored as int8"
    assert path.stat().st_mode & 0o777 == 0o644 and not list(tmp_path.glob("*.tmp"))
    got, want = int8.encode(TEXTS), sentence_encoder.encode(TEXTS)
    cosines = (got * want).sum(1)
    assert cosines.min() > 0.98, cosines
    assert cosines.max() < 0.99999, "int8 vectors identical to float32 ones: the graph was not quantised"
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # a text's vector does not depend on what it is batched with (activations are scaled per token)
    alone = np.stack([int8.encode([t])[0] for t in TEXTS])
    assert (alone * got).sum(1).min() > 0.99999
    before = path.stat().st_mtime_ns
    again = load_encoder("onnx", cache_dir=tmp_path, precision="int8")
    assert again.path == path and path.stat().st_mtime_ns == before
    assert np.allclose(again.encode(TEXTS[:2]), got[:2], atol=1e-5)
    # a start with the int8 graph cached reads nothing else: the float32 export is neither opened nor made
    onnx_path_for(bundled_model_path(), tmp_path).unlink()
    assert load_encoder("onnx", cache_dir=tmp_path, precision="int8").path == path
    assert not onnx_path_for(bundled_model_path(), tmp_path).exists()


def test_unknown_precision_and_int8_torch_are_rejected() -> None:
    with pytest.raises(ValueError, match="precision"):
        load_encoder("onnx", precision="fp16")
    with pytest.raises(ValueError, match="float32 only"):
        load_encoder("torch", precision="int8")


async def test_embedder_serves_the_configured_precision(sentence_encoder, tmp_path: Path) -> None:
    shutil.copyfile(sentence_encoder.path, onnx_path_for(bundled_model_path(), tmp_path))
    emb = Embedder(cache_dir=tmp_path, precision="int8")
    await emb.start()
    try:
        assert (emb.backend_name, emb.precision_name) == ("onnx", "int8")
        vector = await emb.embed("How do I convert Celsius to Fahrenheit?")
        assert float(vector @ sentence_encoder.encode(["How do I convert Celsius to Fahrenheit?"])[0]) > 0.97
    finally:
        await emb.close()


def test_a_model_dir_without_its_weights_serves_the_graphs_made_from_them(sentence_encoder, tmp_path: Path) -> None:
    """The image's layout: graphs made at build time, the weights (and torch) left out of the runtime."""
    from policies.embedding.onnx_encoder import WEIGHTS_DIGEST_FILE, export, strip_weights

    model = tmp_path / "model"
    shutil.copytree(bundled_model_path(), model)
    cache = tmp_path / "graphs"
    cache.mkdir()
    graph = onnx_path_for(model, cache)
    assert graph.name == onnx_path_for(bundled_model_path(), cache).name  # named by the weights' digest
    shutil.copyfile(sentence_encoder.path, graph)
    strip_weights(model)
    assert not (model / "model.safetensors").exists() and (model / WEIGHTS_DIGEST_FILE).exists()
    assert onnx_path_for(model, cache) == graph  # the recorded digest names the same graph
    served = load_encoder("onnx", model_path=model, cache_dir=cache)
    assert served.backend == "onnx"
    text = ["How do I convert Celsius to Fahrenheit?"]
    assert float(served.encode(text)[0] @ sentence_encoder.encode(text)[0]) > 0.99999
    # nothing to make a missing graph from, and no torch fallback without weights: a clear error, not a crash later
    with pytest.raises(RuntimeError, match="weights"):
        export(model, tmp_path / "again.onnx")
    with pytest.raises(RuntimeError, match="no torch backend"):
        load_encoder("onnx", model_path=model, cache_dir=tmp_path / "empty")
