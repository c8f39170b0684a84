"""A pass-through HTTP proxy that keeps every request body a client sent, byte for byte.

Put between a coding agent and the gateway, it shows what the agent itself sent (its tool
results as it produced them), so a test can compare that with what reached the upstream.
Responses, streamed or whole, are relayed as they come.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

# Hop-by-hop and framing headers the two connections set for themselves; the body is relayed
# decoded, so its encoding is not passed on either.
_SKIP = frozenset({"host", "content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive",
                   "accept-encoding"})


@dataclass
class Recorded:
    method: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)  # as the client sent them, less hop-by-hop ones


@dataclass
class RecordingProxy:
    target: str  # e.g. http://127.0.0.1:8080
    requests: list[Recorded] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        self.requests.append(Recorded(request.method, request.path, body, headers))
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        session = self._session
        async with session.request(request.method, self.target + request.path_qs, data=body, headers=headers) as up:
            response = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                     if k.lower() not in _SKIP})
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
