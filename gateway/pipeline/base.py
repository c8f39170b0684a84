"""The contract every pipeline stage follows.

A stage runs before the lane executes and may answer early (a cache hit, a 429);
a completion hook runs after the answer has been delivered (cache admission, metering).
The order of both is declared once, in `gateway.pipeline.order`. Both are closed once, by
`Pipeline.close`, before the components and the upstream pool they use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gateway.context import Answer, Outcome, RequestContext

if TYPE_CHECKING:
    pass


TEXT_OPERATIONS = frozenset({"chat", "completions"})
ALL_OPERATIONS = frozenset({"chat", "completions", "embeddings"})


@runtime_checkable
class Stage(Protocol):
    """Reads and rewrites the context; returns an Answer to stop the pipeline early."""

    name: str
    operations: frozenset[str]  # the operations (chat, completions, embeddings) it runs for

    async def run(self, ctx: RequestContext) -> Answer | None: ...

    async def close(self) -> None:
        """Release what the stage owns (threads, connections); a no-op for most."""
        ...


@runtime_checkable
class CompletionHook(Protocol):
    """Runs once the client has its answer (or the stream was cut); must not raise."""

    name: str

    async def on_complete(self, ctx: RequestContext, outcome: Outcome) -> None: ...

    async def close(self) -> None:
        """Finish or cancel the background work it started, then release what it owns."""
        ...
