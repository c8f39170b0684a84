"""What the gateway needs of a semantic cache, whichever backend holds it (chosen at build time).

`SemanticCache` (policies/cache/service.py) keeps entries in this process's SQLite and faiss;
`SharedCache` (policies/cache/shared.py) keeps them in Redis/Valkey for every replica
(`state.backend: redis`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from policies.cache.config import CacheConfig
from policies.cache.error_bound import BoundParams, ErrorBounds
from policies.cache.scope import CacheKey
from policies.cache.service import CacheHit


class CacheUnavailable(Exception):
    """A purge could not reach the shared store (lookups and admissions fail open instead)."""


class CacheBackend(Protocol):
    """Lookup, admission and purge of cached answers; scope and key rules are the caller's (scope.py)."""

    base: CacheConfig
    bounds: ErrorBounds  # cache.max_error_rate: the online error bound (policies/cache/error_bound.py)

    def config_for(self, *, tenant: str, app: str, model: str, route: str | None) -> CacheConfig: ...

    async def lookup(
        self,
        key: CacheKey,
        vector: np.ndarray | None,
        config: CacheConfig,
        *,
        max_output_tokens: int | None = None,
        exact: bool = True,
        bound_scope: str | None = None,
        refused: list[CacheHit] | None = None,
    ) -> CacheHit | None: ...

    async def observe(self, scope: str, params: BoundParams, entry_id: int, score: float, *, wrong: bool) -> None: ...

    async def store(
        self,
        key: CacheKey,
        vector: np.ndarray | None,
        response: dict[str, Any],
        usage: dict[str, Any] | None,
        config: CacheConfig,
    ) -> int: ...

    async def purge_tenant(self, tenant: str) -> int: ...

    async def purge_key(self, key: str) -> int: ...

    async def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...
