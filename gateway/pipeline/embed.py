"""One sentence embedding of the last user turn per request, computed on first use and kept on ctx.

Not a stage of its own: the cache lookup asks for it only where a semantic match can run (after
an exact match has failed, for a request without tools whose last turn is within
`cache.max_text_chars`), and the router only where its score picks a lane or a tier, so requests
that need no embedding pay nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gateway.context import RequestContext
from policies.cache.scope import embedding_text


async def ensure_embedding(ctx: RequestContext, embedder: Any, *, optional: bool = False) -> np.ndarray | None:
    """ctx.embedding (384-d, L2-normalised), computed once with the shared micro-batching embedder.

    `optional`: the caller does without when the embedder's queue is full (None, ctx.embedding left
    unset for a later caller that needs it)."""
    if ctx.embedding is None and embedder is not None and ctx.operation != "embeddings":
        text = embedding_text(ctx.body)
        if text:
            if_room = getattr(embedder, "embed_if_room", None) if optional else None
            ctx.embedding = await (if_room(text) if if_room is not None else embedder.embed(text))
    embedding: np.ndarray | None = ctx.embedding
    return embedding
