"""One sentence embedding of the last user turn per request, computed on first use and kept on ctx.

Not a stage of its own: the cache lookup asks for it only after an exact match has failed,
and the router only for `auto` requests, so requests that need no embedding pay nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gateway.context import RequestContext
from policies.cache.scope import embedding_text


async def ensure_embedding(ctx: RequestContext, embedder: Any) -> np.ndarray | None:
    """ctx.embedding (384-d, L2-normalised), computed once with the shared micro-batching embedder."""
    if ctx.embedding is None and embedder is not None and ctx.operation != "embeddings":
        text = embedding_text(ctx.body)
        if text:
            ctx.embedding = await embedder.embed(text)
    embedding: np.ndarray | None = ctx.embedding
    return embedding
