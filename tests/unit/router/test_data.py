"""The router's embedding cache: one file per subject, only the wanted subjects embedded."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gateway.pipeline.embed import embedding_text
from policies.router.data import grouped_embeddings, runtime_text


class CountingEncoder:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.seen.extend(texts)
        return np.array([[len(t), ord(t[0])] for t in texts], dtype=np.float32)


def test_only_wanted_groups_are_embedded_and_cached(tmp_path: Path) -> None:
    texts = ["aa", "b", "cccc", "dd", "e", "fff"]
    groups = np.array(["x", "y", "x", "z", "y", "x"])
    enc = CountingEncoder()
    got = grouped_embeddings(texts, groups, ["x", "z"], enc, tmp_path, "t", batch_size=2)
    assert sorted(enc.seen) == ["aa", "cccc", "dd", "fff"]  # group y never embedded
    np.testing.assert_array_equal(got[:, 0], [2, 4, 2, 3])  # row order: x, x, z, x
    assert len(list(tmp_path.glob("t-*.npy"))) == 2
    enc2 = CountingEncoder()
    again = grouped_embeddings(texts, groups, ["x", "y", "z"], enc2, tmp_path, "t")
    assert sorted(enc2.seen) == ["b", "e"]  # x and z come from the cache
    np.testing.assert_array_equal(again[:, 0], [2, 1, 4, 2, 1, 3])


def test_changed_text_misses_the_cache(tmp_path: Path) -> None:
    groups = np.array(["x", "x"])
    grouped_embeddings(["a", "b"], groups, ["x"], CountingEncoder(), tmp_path, "t")
    enc = CountingEncoder()
    grouped_embeddings(["a", "c"], groups, ["x"], enc, tmp_path, "t")
    assert enc.seen == ["a", "c"]


def test_runtime_text_is_the_gateways() -> None:
    prompt = "  Ｑuestion:\n\nWhat   is 2+2?\t" + "x" * 5000
    assert runtime_text(prompt) == embedding_text({"messages": [{"role": "user", "content": prompt}]})
    assert runtime_text(prompt).startswith("Question: What is 2+2? x")
    assert len(runtime_text(prompt)) == 4000
