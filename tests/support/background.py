"""Servers for tests, each on its own event loop thread, so sync SDK clients can call them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")


class BackgroundLoop:
    """An asyncio loop on a daemon thread; `call(coro)` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coro: Awaitable[T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class RunningApp:
    """An aiohttp application served on 127.0.0.1 with an OS-chosen port."""

    def __init__(self, loop: BackgroundLoop, app: web.Application, **runner_kwargs: Any) -> None:
        self._loop = loop
        self.app = app
        self._runner = web.AppRunner(app, **{"handler_cancellation": True, "access_log": None, **runner_kwargs})
        self.port = loop.call(self._start())

    async def _start(self) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._loop.call(self._runner.cleanup())


def serve(loop: BackgroundLoop, routes: Callable[[web.Application], None]) -> RunningApp:
    app = web.Application()
    routes(app)
    return RunningApp(loop, app)
