"""A Messages stream read up to its first content before the client hears of it.

Anthropic answers 200 and sends `message_start` before it knows it can generate: an overload then
comes as an `error` event. Until content comes nothing has reached the client, so the pool reads
that far itself: an error event there is a failed try, retried or fallen back from as an HTTP
error status is, instead of a 200 stream that ends in an error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

# Anthropic's error types as the HTTP statuses that mean the same (https://docs.anthropic.com/en/api/errors).
ERROR_STATUSES = {"overloaded_error": 529, "api_error": 500, "rate_limit_error": 429}


def before_content(event: Any) -> bool:
    """Whether a Messages stream event says nothing yet: the message's start, a keep-alive, an empty
    text or thinking block opened."""
    if not isinstance(event, dict):
        return False
    kind = event.get("type")
    if kind in ("message_start", "ping"):
        return True
    block = event.get("content_block")
    return (kind == "content_block_start" and isinstance(block, dict) and block.get("type") in ("text", "thinking")
            and not block.get(block["type"]))


async def hold(events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`events` with those up to the first content already read: what reading them raises is raised here."""
    held: list[Any] = []
    async for event in events:
        held.append(event)
        if not before_content(event):
            break
    return _replay(held, events)


async def _replay(held: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for event in held:
        yield event
    async for event in rest:
        yield event
