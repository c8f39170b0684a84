"""The multiplexed connection of the budgets path, against a real Valkey server: every caller gets
its own reply however many share the connection, a caller that gives up does not shift the
replies of the others, lost scripts are sent again, and a dead or silent server is left behind."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError, ResponseError

from policies.shared_state.redis_mux import MuxClient
from tests.support.valkey import ValkeyServer

HANG_S = 30.0  # a bound for "at once" that only a hang reaches: what it takes here is milliseconds


async def test_concurrent_callers_get_their_own_replies_over_one_connection(valkey: ValkeyServer) -> None:
    mux = MuxClient(valkey.url)
    try:
        payloads = [f"caller-{i}-" + "x" * (i % 50) for i in range(300)]
        replies = await asyncio.gather(*(mux.call("ECHO", p) for p in payloads))
        assert [r.decode() for r in replies] == payloads
        counts = await asyncio.gather(*(mux.call("INCR", "n") for _ in range(200)))
        assert sorted(counts) == list(range(1, 201))
        assert mux.connects == 1
    finally:
        await mux.close()


async def test_a_caller_that_gives_up_does_not_shift_the_replies_that_follow(valkey: ValkeyServer) -> None:
    mux = MuxClient(valkey.url)
    try:
        assert await mux.call("PING") == b"PONG"  # connected: the caller below gives up on a reply, not a connect
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await mux.call("BLPOP", "nothing-here", "1")  # the server answers (nil) after 1 s
        assert await mux.call("ECHO", "mine") == b"mine"
        assert await mux.call("INCR", "k") == 1
    finally:
        await mux.close()


async def test_error_replies_raise_and_leave_the_connection_usable(valkey: ValkeyServer) -> None:
    mux = MuxClient(valkey.url)
    try:
        await mux.call("HSET", "h", "f", "1")
        results = await asyncio.gather(mux.call("INCR", "h"), mux.call("ECHO", "after"), return_exceptions=True)
        assert isinstance(results[0], ResponseError) and "WRONGTYPE" in str(results[0])
        assert results[1] == b"after"
    finally:
        await mux.close()


async def test_a_script_the_server_lost_is_sent_again(valkey: ValkeyServer) -> None:
    mux = MuxClient(valkey.url)
    try:
        script = mux.script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
        assert await script(keys=["s"], args=[2]) == 2  # first call: NOSCRIPT, then EVAL
        assert await script(keys=["s"], args=[3]) == 5  # EVALSHA
        await mux.call("SCRIPT", "FLUSH")
        assert await script(keys=["s"], args=[1]) == 6
    finally:
        await mux.close()


async def test_a_dead_server_fails_calls_at_once_and_a_restarted_one_is_used_again(valkey: ValkeyServer) -> None:
    # NOTE: what "at once" is told from is made long (a BLPOP that never returns, a 60 s connect
    # timeout), so a generous bound (HANG_S) separates them on any machine
    mux = MuxClient(valkey.url, connect_timeout_s=60.0)
    try:
        assert await mux.call("PING") == b"PONG"
        blocked = asyncio.ensure_future(mux.call("BLPOP", "never", "0"))  # 0: blocks for ever
        await asyncio.sleep(0.05)
        valkey.kill()
        started = time.monotonic()
        with pytest.raises(ConnectionError):
            await blocked  # in flight when the server died
        with pytest.raises(ConnectionError):
            await mux.call("PING")  # refused
        assert time.monotonic() - started < HANG_S
        valkey.start()
        assert await mux.call("PING") == b"PONG"
        assert mux.connects == 2
    finally:
        await mux.close()


async def test_a_connection_whose_oldest_command_waited_too_long_is_reopened(valkey: ValkeyServer) -> None:
    mux = MuxClient(valkey.url, stale_after_s=0.2)
    try:
        assert await mux.call("PING") == b"PONG"  # connected: the BLPOP below is sent at once
        stuck = asyncio.ensure_future(mux.call("BLPOP", "never", "0"))  # 0: blocks for ever
        await asyncio.sleep(0.3)  # a lower bound: the BLPOP has waited longer than stale_after_s
        async with asyncio.timeout(HANG_S):  # queued behind the BLPOP, it would never be answered
            assert await mux.call("ECHO", "fresh") == b"fresh"
        assert mux.connects == 2
        with pytest.raises(ConnectionError):
            await stuck
    finally:
        await mux.close()


async def test_the_url_selects_the_database(valkey: ValkeyServer) -> None:
    mux = MuxClient(valkey.url.rsplit("/", 1)[0] + "/3")
    plain = aioredis.Redis.from_url(valkey.url.rsplit("/", 1)[0] + "/3")
    try:
        await mux.call("SET", "where", "db3")
        assert await plain.get("where") == b"db3"
    finally:
        await mux.close()
        await plain.aclose()


async def test_a_password_is_sent_before_any_command(valkey: ValkeyServer) -> None:
    plain = aioredis.Redis.from_url(valkey.url)
    await plain.config_set("requirepass", "s3cret")
    try:
        denied = MuxClient(valkey.url)
        with pytest.raises(ResponseError):
            await denied.call("PING")  # NOAUTH
        await denied.close()
        mux = MuxClient(valkey.url.replace("redis://", "redis://:s3cret@"))
        assert await mux.call("PING") == b"PONG"
        await mux.close()
    finally:
        admin = aioredis.Redis.from_url(valkey.url, password="s3cret")
        await admin.config_set("requirepass", "")
        await admin.aclose()
        await plain.aclose()


def test_the_gateways_event_loop_uvloop_is_served_too(valkey: ValkeyServer) -> None:
    uvloop = pytest.importorskip("uvloop")  # the gateway's loop where installed; its transports are not asyncio's classes

    async def calls() -> list[bytes]:
        mux = MuxClient(valkey.url)
        try:
            return list(await asyncio.gather(*(mux.call("ECHO", str(i)) for i in range(50))))
        finally:
            await mux.close()

    loop = uvloop.new_event_loop()
    try:
        assert loop.run_until_complete(calls()) == [str(i).encode() for i in range(50)]
    finally:
        loop.close()


async def test_an_argument_that_cannot_be_sent_fails_alone(valkey: ValkeyServer) -> None:
    mux = MuxClient(valkey.url)
    try:
        assert await mux.call("SET", "k", "v")
        with pytest.raises(TypeError):
            await mux.call("SET", "k", None)  # not a Redis argument: refused before it takes a reply's slot
        replies = await asyncio.gather(*(mux.call("ECHO", str(i)) for i in range(20)))
        assert replies == [str(i).encode() for i in range(20)]
    finally:
        await mux.close()


def test_tls_options_of_the_url_are_honoured() -> None:
    import ssl

    relaxed = MuxClient("rediss://store:6380/0?ssl_cert_reqs=none")._tls
    assert relaxed is not None and relaxed.verify_mode == ssl.CERT_NONE and not relaxed.check_hostname
    strict = MuxClient("rediss://store:6380/0")._tls
    assert strict is not None and strict.verify_mode == ssl.CERT_REQUIRED and strict.check_hostname
    assert MuxClient("redis://store:6379/0")._tls is None
