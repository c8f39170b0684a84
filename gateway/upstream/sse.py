"""Reading an upstream's Server-Sent Events stream one event at a time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from gateway.errors import BadUpstreamResponse, UpstreamError

DONE = object()


class ErrorEvent(UpstreamError):
    """An error event in an upstream's stream; `kind` is its error's type (Anthropic's `overloaded_error`, ...)."""

    def __init__(self, message: str, kind: str | None, detail: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.detail = detail  # the event's own message


async def iter_events(content: aiohttp.StreamReader, max_bytes: int) -> AsyncIterator[Any]:
    """Yield each `data:` payload decoded from JSON, then DONE on `[DONE]`.

    Raises BadUpstreamResponse on malformed JSON, UpstreamError on an oversized stream or an
    error event.
    """
    total = 0
    data: list[bytes] = []
    async for raw in content:
        total += len(raw)
        if total > max_bytes:
            raise UpstreamError("the upstream stream exceeded the response size limit")
        line = raw.rstrip(b"\r\n")
        if line:
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
            continue
        if not data:
            continue
        payload = b"\n".join(data)
        data = []
        if payload == b"[DONE]":
            yield DONE
            return
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise BadUpstreamResponse("the upstream sent a malformed stream event") from None
        if isinstance(event, dict) and "error" in event and "choices" not in event:
            err = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            kind = err.get("type") if isinstance(err.get("type"), str) else None
            detail = str(err.get("message") or kind or "unknown error")
            raise ErrorEvent(f"the upstream failed mid-stream: {detail}", kind, detail)
        yield event
    if data:
        payload = b"\n".join(data)
        if payload == b"[DONE]":
            yield DONE
            return
    raise UpstreamError("the upstream stream ended before [DONE]", code="stream_cut")
