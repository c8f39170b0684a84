"""A local stand-in for the Hugging Face hub's file layout: `GET /{org}/{repo}/resolve/{revision}/{file}`.

Like the hub, `resolve` answers with a redirect to where the bytes are (`/cdn/...`), which honours
`Range: bytes=N-` with a 206. It can also misbehave the ways a download must survive: drop the
connection partway through a body, ignore Range and send the whole file with a 200, answer Range
from another offset, send a body without Content-Length (chunked) that is longer than the file, or
drip it a byte at a time. Every request is recorded (path, Range header, status) so tests can check
what the client asked for.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import dataclass, field

from aiohttp import web

from tests.support.background import BackgroundLoop, RunningApp

_RANGE = re.compile(r"bytes=(\d+)-$")


def gguf_bytes(size: int, seed: int = 7) -> bytes:
    """A GGUF-shaped file for downloads: the magic and version, then deterministic filler."""
    head = b"GGUF" + (3).to_bytes(4, "little")
    block = hashlib.sha256(f"filler {seed}".encode()).digest()
    body = (block * (size // len(block) + 1))[: max(0, size - len(head))]
    return head + body


@dataclass
class Seen:
    path: str
    range: str | None
    status: int


@dataclass
class HubServer:
    """Files by `org/repo/revision/file`; the knobs below change how the next answers go."""

    files: dict[str, bytes]
    drop_after: int | None = None  # cut the body after this many bytes ...
    drops_left: int = 0  # ... for this many answers
    ignore_range: bool = False
    redirect: bool = True
    linked: bool = False  # the redirect says the file's size and sha256 (X-Linked-Size, X-Linked-Etag), as the hub's does
    range_from: int | None = None  # a Range request is answered from this offset instead of the one asked for
    chunked: bool = False  # no Content-Length: the body ends when the connection does
    extra: int = 0  # junk bytes sent after the file
    drip_s: float | None = None  # one byte every drip_s seconds ...
    drip_bytes: int = 0  # ... for this many bytes, then the rest at once
    seen: list[Seen] = field(default_factory=list)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/{org}/{repo}/resolve/{revision}/{file:.+}", self._resolve)
        app.router.add_get("/cdn/{key:.+}", self._bytes)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        m = request.match_info
        key = f"{m['org']}/{m['repo']}/{m['revision']}/{m['file']}"
        if key not in self.files:
            self.seen.append(Seen(request.path, request.headers.get("Range"), 404))
            raise web.HTTPNotFound(text="Entry not found")
        if self.redirect:
            self.seen.append(Seen(request.path, request.headers.get("Range"), 302))
            data = self.files[key]
            linked = {"X-Linked-Size": str(len(data)), "X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"'}
            raise web.HTTPFound(f"/cdn/{key}", headers=linked if self.linked else None)
        return await self._send(request, key)

    async def _bytes(self, request: web.Request) -> web.StreamResponse:
        return await self._send(request, request.match_info["key"])

    async def _send(self, request: web.Request, key: str) -> web.StreamResponse:
        data = self.files[key]
        asked = request.headers.get("Range")
        start = 0
        status = 200
        found = _RANGE.match(asked or "")
        if found and not self.ignore_range:
            start = int(found.group(1)) if self.range_from is None else self.range_from
            if start >= len(data):
                self.seen.append(Seen(request.path, asked, 416))
                raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{len(data)}"})
            status = 206
        self.seen.append(Seen(request.path, asked, status))
        body = data[start:] + b"\0" * self.extra
        response = web.StreamResponse(status=status)
        if self.chunked:
            response.enable_chunked_encoding()
        else:
            response.content_length = len(body)
        if status == 206:
            response.headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        response.headers["Accept-Ranges"] = "bytes"
        await response.prepare(request)
        if self.drops_left > 0 and self.drop_after is not None:
            self.drops_left -= 1
            await response.write(body[: self.drop_after])
            await response.drain()
            assert request.transport is not None
            request.transport.close()  # the connection lost partway, Content-Length unmet
            return response
        if self.drip_s is not None:
            for i in range(min(self.drip_bytes, len(body))):
                await response.write(body[i : i + 1])
                await asyncio.sleep(self.drip_s)
            body = body[self.drip_bytes :]
        for i in range(0, len(body), 1 << 20):
            await response.write(body[i : i + (1 << 20)])
        await response.write_eof()
        return response


class RunningHub:
    """A HubServer on its own loop thread (the pull is synchronous)."""

    def __init__(self, server: HubServer) -> None:
        self.server = server
        self._loop = BackgroundLoop()
        app = web.Application()
        server.routes(app)
        self._app = RunningApp(self._loop, app)
        self.url = self._app.url

    def close(self) -> None:
        self._app.stop()
        self._loop.close()
