"""The embedded vector index: one faiss inner-product index per scope, persisted as one file."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import faiss
import numpy as np

from policies.cache.index import Neighbour

logger = logging.getLogger(__name__)

# NOTE: OpenMP's thread count is per calling thread: new threads (the cache's worker) start
# from the default, so it is set here and again in search(). A per-scope flat index searched
# with one query gains nothing from an OpenMP team, and the team cost the miss path dearly on
# 2 cores: a search took 3.0 ms p50 right after an embedding and 0.17 ms without one
# (2,000 entries), and its spinning threads slowed the embedder from 5.0 to 8.2 ms.
faiss.omp_set_num_threads(1)


def _flat(dimension: int) -> faiss.IndexIDMap2:
    return faiss.IndexIDMap2(faiss.IndexFlatIP(dimension))


class FaissIndex:
    """Exact cosine search (IndexFlatIP with entry ids), one index per scope.

    A search only touches its own scope's index, so its cost follows the scope's size and an
    entry of another tenant or model can never be returned, however close its vector is.
    """

    def __init__(self, dimension: int, path: Path | None = None) -> None:
        self.dimension = dimension
        self.path = path
        self._indexes: dict[str, faiss.IndexIDMap2] = {}
        self._scope_of: dict[int, str] = {}

    @classmethod
    def open(cls, dimension: int, path: Path, scopes: Mapping[int, str]) -> FaissIndex | None:
        """Load a saved index whose ids are exactly `scopes`' keys; None when it is missing or stale."""
        if not path.exists():
            return None
        try:
            loaded = faiss.read_index(str(path))
        except RuntimeError:
            logger.warning("cache index %s unreadable; rebuilding from the entry store", path)
            return None
        if loaded.d != dimension or not isinstance(loaded, faiss.IndexIDMap2):
            return None
        ids = faiss.vector_to_array(loaded.id_map)
        if len(ids) != len(scopes) or set(ids.tolist()) != set(scopes):
            return None
        vectors = loaded.index.reconstruct_n(0, loaded.ntotal) if loaded.ntotal else np.zeros((0, dimension), np.float32)
        index = cls(dimension, path)
        index.add_many(ids.tolist(), [scopes[int(i)] for i in ids], vectors)
        return index

    def add(self, entry_id: int, scope: str, vector: np.ndarray) -> None:
        self.add_many([entry_id], [scope], vector)

    def add_many(self, entry_ids: list[int], scopes: list[str], vectors: np.ndarray) -> None:
        if not entry_ids:
            return
        self.remove(i for i in entry_ids if i in self._scope_of)
        rows = np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(entry_ids), self.dimension)
        by_scope: dict[str, list[int]] = {}
        for position, scope in enumerate(scopes):
            by_scope.setdefault(scope, []).append(position)
        for scope, positions in by_scope.items():
            index = self._indexes.get(scope)
            if index is None:
                index = self._indexes[scope] = _flat(self.dimension)
            ids = np.asarray([entry_ids[p] for p in positions], dtype=np.int64)
            index.add_with_ids(rows[positions], ids)
            for entry_id in ids.tolist():
                self._scope_of[entry_id] = scope

    def remove(self, entry_ids: Iterable[int]) -> None:
        by_scope: dict[str, list[int]] = {}
        for entry_id in entry_ids:
            scope = self._scope_of.pop(entry_id, None)
            if scope is not None:
                by_scope.setdefault(scope, []).append(entry_id)
        for scope, ids in by_scope.items():
            index = self._indexes[scope]
            # faiss's stub lists only remove_ids(IDSelector); its Python wrapper also takes an id array.
            index.remove_ids(np.asarray(ids, dtype=np.int64))  # type: ignore[arg-type]
            if index.ntotal == 0:
                del self._indexes[scope]

    def search(self, scope: str, vector: np.ndarray, k: int) -> list[Neighbour]:
        index = self._indexes.get(scope)
        if index is None:
            return []
        query = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, self.dimension)
        faiss.omp_set_num_threads(1)  # this thread's setting (see the note at the top)
        scores, ids = index.search(query, min(k, index.ntotal))
        # IndexIDMap2 keeps the id -> row map, so each candidate's vector comes back without a store read.
        return [Neighbour(int(i), float(s), np.asarray(index.reconstruct(int(i)))) for s, i in zip(scores[0], ids[0]) if i >= 0]

    def ids(self) -> set[int]:
        return set(self._scope_of)

    def __len__(self) -> int:
        return len(self._scope_of)

    def save(self) -> None:
        """Write every scope into one IndexIDMap2 file (the scopes themselves live in the entry store)."""
        if self.path is None:
            return
        merged = _flat(self.dimension)
        for index in self._indexes.values():
            if index.ntotal:
                merged.add_with_ids(index.index.reconstruct_n(0, index.ntotal), faiss.vector_to_array(index.id_map))
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        faiss.write_index(merged, str(tmp))
        os.replace(tmp, self.path)
