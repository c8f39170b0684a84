"""Pipeline stage: one sentence embedding of the last user turn, shared by the cache and the router."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.context import Answer, RequestContext
from policies.cache.scope import last_user_text, normalise
from policies.embedder import Embedder

if TYPE_CHECKING:
    from gateway.services import Services

# The model reads 256 word pieces at most; longer text only costs tokenizer time.
_MAX_CHARS = 4000


@dataclass(slots=True)
class EmbedStage:
    """Sets ctx.embedding (384-d, L2-normalised) of the normalised last user turn."""

    embedder: Embedder
    name: str = "embed"

    async def run(self, ctx: RequestContext) -> Answer | None:
        if ctx.embedding is not None or ctx.operation == "embeddings":
            return None
        text = last_user_text(ctx.body)
        if not text:
            return None
        ctx.embedding = await self.embedder.embed(normalise(text)[:_MAX_CHARS])
        return None


def build(services: Services) -> EmbedStage | None:
    return EmbedStage(services.embedder) if services.embedder is not None else None
