"""A stored answer served again: as one JSON body, or replayed as `chat.completion.chunk`s."""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

_CHUNK_CHARS = 48


def fresh_body(stored: dict[str, Any], usage: dict[str, Any] | None) -> dict[str, Any]:
    """The stored completion with a new id and timestamp (ids must not repeat across responses)."""
    body = copy.deepcopy(stored)
    body["id"] = f"chatcmpl-cache-{uuid.uuid4().hex}"
    body["created"] = int(time.time())
    body["object"] = "chat.completion"
    if usage is not None:
        body["usage"] = dict(usage)
    return body


def _pieces(text: str) -> list[str]:
    return [text[i : i + _CHUNK_CHARS] for i in range(0, len(text), _CHUNK_CHARS)] or [""]


async def replay_chunks(body: dict[str, Any], *, include_usage: bool) -> AsyncGenerator[dict[str, Any], None]:
    """Role, content and finish chunks per choice, then a usage chunk when the client asked for one."""
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body.get("model", "")}
    if body.get("system_fingerprint"):
        base["system_fingerprint"] = body["system_fingerprint"]
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {**base, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}

    for position, choice in enumerate(body.get("choices") or []):
        index = int(choice.get("index", position))
        message = choice.get("message") or {}
        yield chunk(index, {"role": message.get("role", "assistant"), "content": ""}, None)
        for piece in _pieces(message.get("content") or ""):
            yield chunk(index, {"content": piece}, None)
        yield chunk(index, {}, choice.get("finish_reason") or "stop")
    if include_usage:
        yield {**base, "choices": [], "usage": body.get("usage")}
