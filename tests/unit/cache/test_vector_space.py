"""Vectors of one embedding are never searched with another's: float32 and int8 MiniLM differ by a cosine of ~0.01."""

from __future__ import annotations

import numpy as np
import pytest

from policies.cache.shared import DEFAULT_VECTOR_SPACE, vector_blob, vector_from_blob
from policies.cache.store import EntryStore
from policies.embedding.embedder import DIMENSION, vector_space

INT8 = vector_space("int8")


def _unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIMENSION).astype(np.float32)
    return v / np.linalg.norm(v)


def test_float32_blobs_keep_the_format_every_replica_has_always_written() -> None:
    v = _unit(1)
    assert DEFAULT_VECTOR_SPACE == vector_space("fp32")
    blob = vector_blob(v, DEFAULT_VECTOR_SPACE)
    assert blob == v.tobytes() and len(blob) == 4 * DIMENSION
    assert np.array_equal(vector_from_blob(blob, DEFAULT_VECTOR_SPACE), v)


@pytest.mark.parametrize("written, read", [(INT8, vector_space("fp32")), (vector_space("fp32"), INT8)])
def test_a_replica_drops_vectors_of_another_space(written: str, read: str) -> None:
    blob = vector_blob(_unit(2), written)
    assert vector_from_blob(blob, written) is not None
    assert vector_from_blob(blob, read) is None


@pytest.mark.parametrize("blob", [b"", b"\x00" * 7, b"\x00" * (4 * DIMENSION + 1)])
def test_exact_only_and_malformed_blobs_carry_no_vector(blob: bytes) -> None:
    assert vector_from_blob(blob, DEFAULT_VECTOR_SPACE) is None
    assert vector_from_blob(blob, INT8) is None


def test_int8_blobs_round_trip() -> None:
    v = _unit(3)
    got = vector_from_blob(vector_blob(v, INT8), INT8)
    assert got is not None and np.array_equal(got, v)


def test_store_drops_vectors_of_another_space_once_and_keeps_their_entries(tmp_path) -> None:
    store = EntryStore(tmp_path / "entries.sqlite3")
    try:
        for i in range(3):
            store.put(exact=f"k{i}", scope="s", tenant="t", model="m", text=f"q{i}", vector=_unit(i),
                      response={"id": i}, usage=None, now=0.0, ttl_s=60)  # fmt: skip
        assert store.adopt_vector_space(vector_space("fp32")) == 0  # an unmarked store holds float32 vectors
        assert store.adopt_vector_space(INT8) == 3
        assert store.vectors()[0] == [] and store.get_exact("k0", 0.0) is not None
        assert store.adopt_vector_space(INT8) == 0
    finally:
        store.close()
