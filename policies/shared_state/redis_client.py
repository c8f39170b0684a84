"""The one way tierlane opens a Redis/Valkey client for shared state (budgets, cache, usage).

Imported only with `state.backend: redis`, so the embedded default never loads redis-py.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import redis.asyncio as aioredis


def redis_client(url: str, *, connect_timeout_s: float, read_timeout_s: float) -> aioredis.Redis:
    """A client that connects lazily and reconnects on its own after the server comes back.

    NOTE: no retry on timeout: the caller bounds every operation and fails open or closed by
    its policy; a retry would double the wait a request can see.
    """
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=read_timeout_s,
        retry_on_timeout=False,
        health_check_interval=30,
    )


def store_address(url: str) -> str:
    """`url` without credentials or query (a password may be in either), for messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"
