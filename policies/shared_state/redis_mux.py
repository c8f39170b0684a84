"""One multiplexed Redis/Valkey connection for the request path (the budget scripts).

redis-py checks a connection out of its pool for every command and reads each reply on its
own; at 16 requests in flight that cost about 0.2 ms of CPU per request on the budgets path
alone (admission and settlement: two scripts), enough to double a loaded replica's added
latency. `MuxClient` instead writes every caller's command to one connection as it comes
(writes in the same loop iteration go out in one `write`), and hands the replies back in order
as they arrive (Redis answers a connection's commands in the order it received them), parsed by
hiredis, the C parser of the Redis project. Concurrent requests so share round trips without
waiting for each other: the pipelining that ioredis and Lettuce do by default.

Failure: a command that times out on the caller's side (the caller bounds every call) leaves
its slot in the queue, so the replies that follow still go to their own callers. A lost
connection fails every command in flight with ConnectionError; the next call reconnects (one
connect at a time, bounded by `connect_timeout_s`). A connection whose oldest command has waited
longer than `stale_after_s` is dropped and reopened, so a server that stopped answering cannot
hold the queue. Nothing is retried: a script may have run before its connection broke, and the
caller's policy (fail open or closed) decides.

Supported URLs are those of `state.url`: redis://, rediss:// (TLS, verified by default) and
unix://, with user, password and db, and the TLS query options redis-py reads (ssl_ca_certs,
ssl_certfile, ssl_keyfile, ssl_cert_reqs, ssl_check_hostname).
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
from collections import deque
from typing import Any, cast

import hiredis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError, NoScriptError, ResponseError


class _Protocol(asyncio.Protocol):
    """One connection: commands out in order, each reply to the oldest command still waiting for one."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._buffer: list[bytes] = []

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        """Queue one command; commands queued in the same loop iteration go out in one write."""
        packed = hiredis.pack_command(args)  # first: an argument it cannot pack must not leave an empty slot
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.waiting.append((future, time.monotonic()))
        if not self._buffer:
            loop.call_soon(self._flush)
        self._buffer.append(packed)
        return future

    def _flush(self) -> None:
        data, self._buffer = b"".join(self._buffer), []
        if self.usable:
            assert self.transport is not None
            self.transport.write(data)
        else:  # closed after these were queued
            self._fail(ConnectionError("connection to the store closed"))

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            reply = self.reader.gets()
            if reply is False:
                return
            if not self.waiting:  # a reply nobody asked for: out of step, so this connection is dropped
                if self.transport is not None:
                    self.transport.abort()
                return
            future, _ = self.waiting.popleft()
            if not future.done():  # a caller that timed out has gone; its reply is dropped
                future.set_result(reply)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"connection to the store lost: {exc!r}" if exc else "connection closed by the store"))
        if not self.closed.done():
            self.closed.set_result(None)

    def _fail(self, error: Exception) -> None:
        while self.waiting:
            future, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)


class MuxClient:
    """Commands of many coroutines over one connection, replies in order; see the module docstring."""

    def __init__(self, url: str, *, connect_timeout_s: float = 1.0, stale_after_s: float = 5.0) -> None:
        options = parse_url(url)
        self._host = str(options.get("host") or "127.0.0.1")
        self._port = int(options.get("port") or 6379)
        self._path = options.get("path")
        self._tls = _tls_context(dict(options)) if options.get("connection_class") is SSLConnection else None
        self._hello: list[tuple[Any, ...]] = []
        if options.get("password"):
            user = options.get("username")
            self._hello.append(("AUTH", user, options["password"]) if user else ("AUTH", options["password"]))
        if int(options.get("db") or 0):
            self._hello.append(("SELECT", int(options["db"])))
        self._connect_timeout = connect_timeout_s
        self._stale_after = stale_after_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None
        self.connects = 0  # connections opened (the first, then each reconnect)

    async def call(self, *args: Any) -> Any:
        """Send one command and wait for its reply; a Redis error reply raises ResponseError."""
        protocol = self._protocol
        if protocol is not None and protocol.usable and protocol.waiting:
            if time.monotonic() - protocol.waiting[0][1] > self._stale_after:
                assert protocol.transport is not None
                protocol.transport.abort()  # the server stopped answering this connection
        if protocol is None or not protocol.usable:
            protocol = await self._connect()
        reply = await protocol.send(args)
        if isinstance(reply, ResponseError):
            raise NoScriptError(str(reply)) if str(reply).startswith("NOSCRIPT") else reply
        return reply

    async def _connect(self) -> _Protocol:
        """The connection being opened, or a new one (one connect at a time, shared by every caller)."""
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if nobody waits
        task = self._connecting
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                raise ConnectionError("the connection to the store was closed while it opened") from None
            raise

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        protocol: _Protocol | None = None
        try:
            async with asyncio.timeout(self._connect_timeout):
                if self._path:
                    _, protocol = await loop.create_unix_connection(_Protocol, str(self._path))
                else:
                    _, protocol = await loop.create_connection(_Protocol, self._host, self._port, ssl=self._tls)
                for command in self._hello:
                    reply = await protocol.send(command)
                    if isinstance(reply, ResponseError):
                        raise ConnectionError(f"the store refused {command[0]}: {reply}")
        except BaseException as exc:  # timed out, refused, closed meanwhile: never leave the socket open
            if protocol is not None and protocol.transport is not None:
                protocol.transport.abort()
            if isinstance(exc, (OSError, TimeoutError)):
                raise ConnectionError(f"cannot connect to the store at {self._where}: {exc!r}") from exc
            raise
        self._protocol = protocol
        self.connects += 1
        return protocol

    @property
    def _where(self) -> str:
        return str(self._path) if self._path else f"{self._host}:{self._port}"

    async def close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
            await asyncio.wait({protocol.closed}, timeout=1.0)

    # The scripts of the request path.

    def script(self, source: str) -> MuxScript:
        return MuxScript(self, source)


class MuxScript:
    """A Lua script called by its SHA1 (EVALSHA), sent whole (EVAL, which also loads it) when the server lacks it."""

    def __init__(self, client: MuxClient, source: str) -> None:
        self.client = client
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()

    async def __call__(self, keys: list[Any], args: list[Any]) -> Any:
        try:
            return await self.client.call("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.call("EVAL", self.source, len(keys), *keys, *args)

    async def load(self) -> None:
        await self.client.call("SCRIPT", "LOAD", self.source)


def _tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    """The TLS settings a rediss:// URL may carry (as redis-py reads them): CA file, client cert, verification."""
    context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
    if options.get("ssl_certfile"):
        context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"))
    if str(options.get("ssl_cert_reqs", "required")).lower() in ("none", "cert_none"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif str(options.get("ssl_check_hostname", "true")).lower() in ("false", "0", "no"):
        context.check_hostname = False
    return context
