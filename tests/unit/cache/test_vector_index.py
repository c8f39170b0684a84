"""The vector index: exact per-scope search whether a scope is kept as shared rows or in its own faiss index,
what an entry costs, and the file it is saved to."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from policies.cache.faiss_index import FaissIndex

D = 384


def _units(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)
    unit: np.ndarray = v / np.linalg.norm(v, axis=1, keepdims=True)
    return unit


class BruteForce:
    """Every live vector with its scope: the search the index must agree with."""

    def __init__(self) -> None:
        self.vectors: dict[int, tuple[str, np.ndarray]] = {}

    def search(self, scope: str, query: np.ndarray, k: int) -> list[tuple[int, float]]:
        mine = [(i, float(np.dot(v.astype(np.float64), query.astype(np.float64)))) for i, (s, v) in self.vectors.items() if s == scope]
        return sorted(mine, key=lambda found: -found[1])[:k]


def _agree(index: FaissIndex, truth: BruteForce, scope: str, query: np.ndarray, k: int = 4) -> None:
    got = index.search(scope, query, k)
    want = truth.search(scope, query, k)
    assert [n.id for n in got] == [i for i, _ in want], scope
    assert np.allclose([n.similarity for n in got], [s for _, s in want], atol=1e-5)
    for n in got:
        assert n.vector is not None and np.allclose(n.vector, truth.vectors[n.id][1])


def test_searches_see_only_their_scope_and_match_brute_force_as_scopes_grow_and_shrink() -> None:
    index, truth = FaissIndex(D), BruteForce()
    vectors = _units(600, 1)
    sizes = {"one": 1, "few": 5, "edge": index.small_rows, "over": index.small_rows + 1, "big": 300}
    next_id = 1
    for scope, size in sizes.items():
        for _ in range(size):
            index.add(next_id, scope, vectors[next_id])
            truth.vectors[next_id] = (scope, vectors[next_id])
            next_id += 1
    queries = _units(20, 2)
    # A query equal to a vector of another scope must not find it.
    queries[0] = truth.vectors[1][1]
    for scope in [*sizes, "absent"]:
        for query in queries:
            _agree(index, truth, scope, query)
    assert [n.id for n in index.search("few", truth.vectors[1][1], 10)] != [1]
    # The big scope shrinks to a handful (back to shared rows), the small ones empty out.
    big = [i for i, (s, _) in truth.vectors.items() if s == "big"]
    gone = big[3:] + [i for i, (s, _) in truth.vectors.items() if s in ("one", "edge")]
    index.remove(gone)
    for i in gone:
        del truth.vectors[i]
    assert len(index) == len(truth.vectors) and index.ids() == set(truth.vectors)
    for scope in sizes:
        for query in queries:
            _agree(index, truth, scope, query)
    # Ids come back (a replaced entry), into another scope.
    index.add(big[0], "few", vectors[599])
    truth.vectors[big[0]] = ("few", vectors[599])
    _agree(index, truth, "few", vectors[599])
    _agree(index, truth, "big", vectors[599])


def test_a_one_entry_scope_costs_its_vector_and_no_objects_for_the_collector() -> None:
    index = FaissIndex(D)
    vectors = _units(3000, 3)
    gc.collect()
    tracked = len(gc.get_objects())
    for i, vector in enumerate(vectors):
        index.add(i + 1, f"{i:064x}", vector)
    gc.collect()
    # A faiss index per scope came with three objects the collector walks on every full collection.
    assert len(gc.get_objects()) - tracked < 100
    assert index.nbytes / len(index) < 4 * D + 300


def test_removed_rows_are_reused_and_freed_rows_released() -> None:
    index = FaissIndex(D)
    vectors = _units(5000, 4)
    for i, vector in enumerate(vectors):
        index.add(i + 1, f"s{i}", vector)
    blocks = len(index._blocks)
    index.remove(range(1, 4901))  # a purge
    assert len(index._blocks) < blocks
    for i in range(100):
        index.add(10_000 + i, f"t{i}", vectors[i])
    assert len(index) == 200
    for i in (4950, 4999):
        assert [n.id for n in index.search(f"s{i}", vectors[i], 4)] == [i + 1]
    assert [n.id for n in index.search("t7", vectors[7], 4)] == [10_007]


def test_the_saved_file_reopens_with_every_scope(tmp_path: Path) -> None:
    path = tmp_path / "vectors.faiss"
    index, truth = FaissIndex(D, path), BruteForce()
    vectors = _units(80, 5)
    for i, vector in enumerate(vectors):
        scope = "big" if i < 40 else f"s{i % 7}"
        index.add(i + 1, scope, vector)
        truth.vectors[i + 1] = (scope, vector)
    index.save()
    reopened = FaissIndex.open(D, path, {i: s for i, (s, _) in truth.vectors.items()})
    assert reopened is not None and reopened.ids() == set(truth.vectors)
    for scope in ["big", *(f"s{j}" for j in range(7))]:
        _agree(reopened, truth, scope, vectors[45])
    assert FaissIndex.open(D, path, {1: "big"}) is None  # stale: other ids than the store's


@pytest.mark.parametrize("small_rows", [0, 16])
def test_either_layout_gives_faiss_s_answer(small_rows: int) -> None:
    """small_rows=0 is one faiss index per scope (as every scope was kept before)."""
    vectors = _units(40, 6)
    reference, index = FaissIndex(D, small_rows=0), FaissIndex(D, small_rows=small_rows)
    for i, vector in enumerate(vectors):
        reference.add(i + 1, f"s{i % 4}", vector)
        index.add(i + 1, f"s{i % 4}", vector)
    for query in _units(10, 7):
        want = reference.search("s1", query, 4)
        got = index.search("s1", query, 4)
        assert [n.id for n in got] == [n.id for n in want]
        assert np.allclose([n.similarity for n in got], [n.similarity for n in want], atol=1e-6)
