"""The embedded vector index: exact cosine search per scope, small scopes as rows of a shared store, persisted as one file."""

from __future__ import annotations

import logging
import mmap
import os
import sys
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

# A scope with more vectors than this gets a faiss index of its own; one that shrinks to half
# of it goes back to the shared rows. Gathering and scoring 16 rows (~10 us) takes about as long
# as faiss's search of them, and an index's own cost (~1 KB) is then ~60 bytes a vector.
SMALL_SCOPE_ROWS = 16
_BLOCK_ROWS = 1024  # the shared rows are allocated this many at a time (1.5 MiB at 384 dimensions)

# What the index holds beyond each vector's own 4 bytes a dimension: resident memory per entry,
# measured over 100,000 entries (bench/cache_memory.py; CPython 3.11, faiss 1.15, glibc).
# A small scope's entry: its id -> row map, its id in its scope's tuple, its row's scope
# (1,791 B an entry in one-entry scopes, 1,739 B in two-entry ones, so 150 B + 110 B a scope).
_SMALL_ENTRY_BYTES = 150
_SMALL_SCOPE_BYTES = 110
# A big scope's entry: faiss's id maps and the id -> scope map, and the space faiss's reallocated
# vector arrays leave on the heap when scopes grow side by side: 2,270 B a vector over 100 scopes
# of 665 growing together (1,690 B for scopes filled one after another).
_BIG_ENTRY_BYTES = 730
_BIG_SCOPE_BYTES = 960  # an IndexIDMap2(IndexFlatIP) and its Python wrappers (2,496 B for a one-vector index)


def _flat(dimension: int) -> faiss.IndexIDMap2:
    return faiss.IndexIDMap2(faiss.IndexFlatIP(dimension))


class FaissIndex:
    """Exact cosine search (inner products of L2-normalised vectors), per scope.

    A scope of up to `small_rows` vectors keeps them as rows of one shared block store and is
    searched by scoring each of its own rows; a bigger one has its own IndexIDMap2(IndexFlatIP).
    Either way a search reads only its own scope's vectors and scores every one of them, so its
    cost follows the scope's size, it is exact, and an entry of another tenant or model can never
    be returned, however close its vector is. Most scopes hold one entry (a soak's 33,592 scopes
    held 100,000 entries, 33,492 of them alone), and a faiss index of their own cost more than
    their vector.
    """

    def __init__(self, dimension: int, path: Path | None = None, *, small_rows: int = SMALL_SCOPE_ROWS) -> None:
        self.dimension = dimension
        self.path = path
        self.small_rows = small_rows
        self._blocks: list[np.ndarray] = []  # the shared rows, _BLOCK_ROWS each
        self._maps: list[mmap.mmap] = []  # the blocks' memory
        self._scope_at: list[str | None] = []  # row -> the scope whose vector it holds
        self._free: list[int] = []  # rows given back, reused first
        self._fresh = 0  # rows handed out so far
        self._small: dict[str, tuple[int, ...]] = {}  # scope -> its entry ids (tuples of ints: untracked by the GC)
        self._row_of: dict[int, int] = {}  # entry id -> its row (small scopes)
        self._big: dict[str, faiss.IndexIDMap2] = {}
        self._big_scope_of: dict[int, str] = {}  # entry id -> its scope (big scopes)

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
        self.remove(i for i in entry_ids if i in self._row_of or i in self._big_scope_of)
        rows = np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(entry_ids), self.dimension)
        by_scope: dict[str, list[int]] = {}
        for position, scope in enumerate(scopes):
            by_scope.setdefault(scope, []).append(position)
        for scope, positions in by_scope.items():
            scope = sys.intern(scope)  # one string per scope, however many entries name it
            ids = [int(entry_ids[p]) for p in positions]
            index = self._big.get(scope)
            if index is None and len(self._small.get(scope, ())) + len(ids) > self.small_rows:
                index = self._promote(scope)
            if index is None:
                self._add_small(scope, ids, rows[positions])
            else:
                index.add_with_ids(rows[positions], np.asarray(ids, dtype=np.int64))
                for entry_id in ids:
                    self._big_scope_of[entry_id] = scope
        self._compact_if_sparse()

    def remove(self, entry_ids: Iterable[int]) -> None:
        small: dict[str, set[int]] = {}
        big: dict[str, list[int]] = {}
        for entry_id in entry_ids:
            row = self._row_of.pop(entry_id, None)
            if row is not None:
                scope = self._scope_at[row]
                assert scope is not None
                self._scope_at[row] = None
                self._free.append(row)
                small.setdefault(scope, set()).add(entry_id)
            elif (scope := self._big_scope_of.pop(entry_id, None)) is not None:
                big.setdefault(scope, []).append(entry_id)
        for scope, gone in small.items():
            left = tuple(i for i in self._small[scope] if i not in gone)
            if left:
                self._small[scope] = left
            else:
                del self._small[scope]
        for scope, ids in big.items():
            index = self._big[scope]
            # faiss's stub lists only remove_ids(IDSelector); its Python wrapper also takes an id array.
            index.remove_ids(np.asarray(ids, dtype=np.int64))  # type: ignore[arg-type]
            if index.ntotal <= self.small_rows // 2:
                self._demote(scope)
        self._compact_if_sparse()

    def search(self, scope: str, vector: np.ndarray, k: int) -> list[Neighbour]:
        ids = self._small.get(scope)
        if ids is not None:
            block = self._gather([self._row_of[i] for i in ids])
            # NOTE: einsum, not `block @ query`: numpy's BLAS would start a thread team for a
            # matrix of this size (see the OpenMP note above).
            scores = np.einsum("ij,j->i", block, np.asarray(vector, dtype=np.float32).reshape(self.dimension))
            order = np.argsort(-scores, kind="stable")[:k]
            return [Neighbour(ids[p], float(scores[p]), block[p]) for p in order.tolist()]
        index = self._big.get(scope)
        if index is None:
            return []
        query = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, self.dimension)
        faiss.omp_set_num_threads(1)  # this thread's setting (see the note at the top)
        scores, found = index.search(query, min(k, index.ntotal))
        # IndexIDMap2 keeps the id -> row map, so each candidate's vector comes back without a store read.
        return [Neighbour(int(i), float(s), np.asarray(index.reconstruct(int(i)))) for s, i in zip(scores[0], found[0]) if i >= 0]

    def ids(self) -> set[int]:
        return {*self._row_of, *self._big_scope_of}

    def __len__(self) -> int:
        return len(self._row_of) + len(self._big_scope_of)

    @property
    def nbytes(self) -> int:
        """The memory the index holds for its entries: their vectors and bookkeeping (the constants above).

        Beyond this it holds the free rows of the shared store: reused before the store grows,
        and compacted away once they are more than a block and an eighth of its rows."""
        vector = 4 * self.dimension
        return (
            len(self._row_of) * (vector + _SMALL_ENTRY_BYTES) + len(self._small) * _SMALL_SCOPE_BYTES
            + len(self._big_scope_of) * (vector + _BIG_ENTRY_BYTES) + len(self._big) * _BIG_SCOPE_BYTES
        )  # fmt: skip

    def save(self) -> None:
        """Write every scope into one IndexIDMap2 file (the scopes themselves live in the entry store)."""
        if self.path is None:
            return
        merged = _flat(self.dimension)
        if self._row_of:
            ids = np.fromiter(self._row_of, dtype=np.int64, count=len(self._row_of))
            merged.add_with_ids(self._gather(list(self._row_of.values())), ids)
        for index in self._big.values():
            if index.ntotal:
                merged.add_with_ids(index.index.reconstruct_n(0, index.ntotal), faiss.vector_to_array(index.id_map))
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        faiss.write_index(merged, str(tmp))
        os.replace(tmp, self.path)

    # The shared rows.

    def _add_small(self, scope: str, ids: list[int], vectors: np.ndarray) -> None:
        for entry_id, vector in zip(ids, vectors):
            row = self._take_row()
            self._blocks[row // _BLOCK_ROWS][row % _BLOCK_ROWS] = vector
            self._scope_at[row] = scope
            self._row_of[entry_id] = row
        self._small[scope] = self._small.get(scope, ()) + tuple(ids)

    def _take_row(self) -> int:
        if self._free:
            return self._free.pop()
        row = self._fresh
        if row == len(self._blocks) * _BLOCK_ROWS:
            # NOTE: a mapping of its own, not the allocator's heap: a block released by _compact goes
            # back to the system (glibc keeps freed heap memory resident), and rows never used take no memory.
            self._maps.append(memory := mmap.mmap(-1, _BLOCK_ROWS * self.dimension * 4))
            self._blocks.append(np.frombuffer(memory, dtype=np.float32).reshape(_BLOCK_ROWS, self.dimension))
            self._scope_at.extend([None] * _BLOCK_ROWS)
        self._fresh += 1
        return row

    def _gather(self, rows: list[int]) -> np.ndarray:
        """The rows' vectors, copied into one matrix."""
        out = np.empty((len(rows), self.dimension), dtype=np.float32)
        for position, row in enumerate(rows):
            out[position] = self._blocks[row // _BLOCK_ROWS][row % _BLOCK_ROWS]
        return out

    def _compact_if_sparse(self) -> None:
        if len(self._free) > max(_BLOCK_ROWS, self._fresh // 8):
            self._compact()

    def _compact(self) -> None:
        """Move the rows in use past the first `in use` rows into the free ones below, and release the blocks left empty.

        Rows are freed by evictions, purges and scopes moving to their own index; a new row reuses
        one, but a purge or a bound lowered at a restart can leave many free for good."""
        end = self._fresh - len(self._free)
        holes = sorted(row for row in self._free if row < end)
        movers = [row for row in range(end, self._fresh) if self._scope_at[row] is not None]
        for source, target in zip(movers, holes):
            scope = self._scope_at[source]
            assert scope is not None
            entry_id = next(i for i in self._small[scope] if self._row_of[i] == source)
            self._blocks[target // _BLOCK_ROWS][target % _BLOCK_ROWS] = self._blocks[source // _BLOCK_ROWS][source % _BLOCK_ROWS]
            self._scope_at[target], self._row_of[entry_id] = scope, target
        self._fresh, self._free = end, []
        blocks = -(-end // _BLOCK_ROWS)
        del self._blocks[blocks:], self._maps[blocks:], self._scope_at[blocks * _BLOCK_ROWS :]
        if end % _BLOCK_ROWS:  # the last block's pages past its last row in use go back too
            start = -(-(end % _BLOCK_ROWS) * self.dimension * 4 // mmap.PAGESIZE) * mmap.PAGESIZE
            if start < len(self._maps[-1]):
                self._maps[-1].madvise(mmap.MADV_DONTNEED, start, len(self._maps[-1]) - start)

    def _promote(self, scope: str) -> faiss.IndexIDMap2:
        """Move a scope's rows into a faiss index of its own."""
        ids = self._small.pop(scope, ())
        index = self._big[scope] = _flat(self.dimension)
        if ids:
            index.add_with_ids(self._gather([self._row_of[i] for i in ids]), np.asarray(ids, dtype=np.int64))
            for entry_id in ids:
                row = self._row_of.pop(entry_id)
                self._scope_at[row] = None
                self._free.append(row)
                self._big_scope_of[entry_id] = scope
        return index

    def _demote(self, scope: str) -> None:
        """Move a big scope that shrank back into the shared rows."""
        index = self._big.pop(scope)
        if not index.ntotal:
            return
        ids = faiss.vector_to_array(index.id_map).tolist()
        for entry_id in ids:
            del self._big_scope_of[entry_id]
        self._add_small(scope, ids, index.index.reconstruct_n(0, index.ntotal))
