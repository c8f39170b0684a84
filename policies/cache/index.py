"""The vector index behind the semantic cache: a small protocol any backend can implement."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(slots=True, frozen=True)
class Neighbour:
    """One search result: the entry id, its cosine similarity to the query and (when kept) its vector."""

    id: int
    similarity: float
    vector: np.ndarray | None = field(default=None, compare=False)  # the learned verifier reads it


@runtime_checkable
class VectorIndex(Protocol):
    """Scoped nearest-neighbour search over L2-normalised vectors (inner product = cosine).

    Every vector belongs to one scope; a search only ever sees vectors of its own scope.
    Implementations are called from one worker thread at a time and need no locking of their own.
    """

    def add(self, entry_id: int, scope: str, vector: np.ndarray) -> None: ...

    def remove(self, entry_ids: Iterable[int]) -> None: ...

    def search(self, scope: str, vector: np.ndarray, k: int) -> list[Neighbour]: ...

    def ids(self) -> set[int]: ...

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int:
        """The memory its entries hold (vectors and bookkeeping): what `cache.max_memory_bytes` bounds."""
        ...

    def save(self) -> None: ...
