"""Upstream faults found by review: dead members, breaker probes, Retry-After and answer garbage."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.errors import BadUpstreamResponse, GatewayError, RateLimited, known_error_codes
from gateway.settings import Settings
from gateway.upstream.pool import UpstreamPool, retry_after_seconds
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import BlackHole, Recorder, chunk, fault_app

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
# A backoff no test may ever see: a request that slept it took too long. Longer than a client's 30 s
# timeout, so a bound far below it (HANG_S) tells "no backoff" from "a backoff" on any machine.
SLOW_BACKOFF = {"backoff_base_s": 60.0, "backoff_max_s": 60.0}
HANG_S = 20.0  # what none of these requests takes without a backoff, however slow the machine


def fault(bg, mode: str, **opts: Any) -> tuple[RunningApp, Recorder]:
    rec = Recorder()
    return RunningApp(bg, fault_app(mode, rec, **opts)), rec


@pytest.fixture
def black_hole():
    hole = BlackHole()
    yield hole
    hole.close()


def post(gw: RunningApp, body: dict[str, Any] = CHAT, timeout: float = 30) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=timeout)


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


# -- B: a dead member costs nothing but its connect timeout ---------------------------------


def test_connect_timeout_moves_to_the_healthy_member_at_once(bg, make_gateway, black_hole):
    ok, ok_rec = fault(bg, "ok")
    common = {"connect_timeout_s": 0.3, "breaker_failures": 100, **SLOW_BACKOFF}
    gw = make_gateway(
        upstreams=[upstream_cfg("dead", black_hole.url + "/v1", **common), upstream_cfg("live", ok.url + "/v1", **common)]
    )
    took = []
    for _ in range(12):
        started = time.monotonic()
        r = post(gw)
        took.append(time.monotonic() - started)
        assert r.status_code == 200, r.text
    assert ok_rec.hits == 12
    assert max(took) >= 0.25  # some went to the dead member first (all 12 missing it: 1 in 4096)...
    assert max(took) < HANG_S  # ...and moved on after its connect timeout, without the 60 s backoff


def test_refused_connection_moves_to_the_next_member_without_the_backoff(bg, make_gateway):
    ok, ok_rec = fault(bg, "ok")
    gw = make_gateway(
        upstreams=[
            upstream_cfg("refusing", "http://127.0.0.1:9/v1", breaker_failures=100, **SLOW_BACKOFF),
            upstream_cfg("live", ok.url + "/v1", breaker_failures=100, **SLOW_BACKOFF),
        ]
    )
    started = time.monotonic()
    assert [post(gw).status_code for _ in range(8)] == [200] * 8  # one backoff of 60 s: a client timeout
    assert time.monotonic() - started < HANG_S
    assert ok_rec.hits == 8


def test_backoff_still_applies_before_retrying_the_same_member(bg, make_gateway):
    up, rec = fault(bg, "status", status=503, fail_first=1)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", backoff_base_s=0.4, backoff_max_s=0.4)])
    started = time.monotonic()
    assert post(gw).status_code == 200
    assert rec.hits == 2
    assert time.monotonic() - started >= 0.35


def test_connect_timeout_of_the_only_member_is_one_timeout_not_three(bg, make_gateway, black_hole, monkeypatch):
    """Counted, not timed: the pool's tries of the member (three would be 0.9 s, one 0.3 s plus the
    machine's own time, which a loaded machine stretches past any bound between them)."""
    tries = []
    attempt = UpstreamPool._attempt

    async def counted(self: UpstreamPool, upstream: Any, *args: Any) -> Any:
        tries.append(upstream.name)
        return await attempt(self, upstream, *args)

    monkeypatch.setattr(UpstreamPool, "_attempt", counted)
    gw = make_gateway(upstreams=[upstream_cfg("dead", black_hole.url + "/v1", connect_timeout_s=0.3)])
    r = post(gw)
    assert_openai_error(r, 504, "upstream_timeout")
    assert tries == ["dead"]


def test_read_timeout_is_not_sent_to_another_member(bg, make_gateway):
    slow, slow_rec = fault(bg, "slow", delay=5)
    ok, ok_rec = fault(bg, "ok")
    gw = make_gateway(
        upstreams=[upstream_cfg("slow", slow.url + "/v1", read_timeout_s=0.3), upstream_cfg("ok", ok.url + "/v1")]
    )
    codes = [post(gw).status_code for _ in range(12)]
    assert set(codes) <= {200, 504} and 504 in codes  # all 12 missing "slow": 1 in 4096
    assert slow_rec.hits == codes.count(504)  # a generation that may be running is not sent again
    assert ok_rec.hits == codes.count(200)


# -- B: half-open probes are the gateway's own ---------------------------------------------


def test_an_open_breaker_is_probed_in_the_background_never_with_a_client_request(bg, make_gateway):
    up, rec = fault(bg, "status", status=502, fail_first=2, models_route=True)
    gw = make_gateway(
        upstreams=[upstream_cfg("a", up.url + "/v1", retries=0, breaker_failures=2, breaker_cooldown_s=0.5)]
    )
    gets = len(rec.models_gets)  # the wildcard upstream's model discovery at start
    rec.models_status = 503
    assert post(gw).status_code == 502
    opened = time.monotonic()  # before the failure that opens it: the breaker's clock reads later
    assert post(gw).status_code == 502
    assert_openai_error(post(gw), 503, "upstream_unavailable")  # open: nobody is sent there

    wait_until(lambda: len(rec.models_gets) > gets)  # the first probe, after the cooldown
    assert rec.models_gets[gets] - opened >= 0.4
    assert [post(gw).status_code for _ in range(3)] == [503] * 3  # it failed: open again
    assert rec.hits == 2

    rec.models_status, rec.models_held = 200, True
    wait_until(lambda: len(rec.models_gets) > gets + 1)  # the second probe is in flight (held): half-open
    assert [post(gw).status_code for _ in range(3)] == [503] * 3
    assert rec.hits == 2  # no client request was the probe
    rec.models_held = False  # the probe answers 200
    wait_until(lambda: httpx.get(gw.url + "/readyz").status_code == 200)
    assert rec.hits == 2
    assert post(gw).status_code == 200
    assert rec.hits == 3


def test_the_probe_tasks_stop_with_the_pool(bg, black_hole):
    settings = Settings.load(
        env={},
        overrides={
            "upstreams": [
                upstream_cfg(
                    "dead", black_hole.url + "/v1", models=["fake-model"], retries=0,
                    connect_timeout_s=0.2, breaker_failures=1, breaker_cooldown_s=0.05,
                )
            ]
        },
    )

    def ours() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_name().startswith("tierlane-")]

    async def scenario() -> tuple[bool, list[asyncio.Task[Any]]]:
        pool = UpstreamPool(settings)
        await pool.start()
        with pytest.raises(GatewayError):
            await pool.send("default", "/chat/completions", CHAT, headers={}, model="fake-model", stream=False)
        probed = False
        deadline = asyncio.get_running_loop().time() + 60
        while asyncio.get_running_loop().time() < deadline:  # the breaker opened; after its cooldown a probe starts
            probed = any(t.get_name().startswith("tierlane-probe") for t in ours())
            if probed:
                break
            await asyncio.sleep(0.01)
        await pool.close()
        await asyncio.sleep(0)
        return probed, ours()

    probed, left = bg.call(scenario())
    assert probed
    assert left == []


# -- A: Retry-After that is no number of seconds ---------------------------------------------


@pytest.mark.parametrize("status", [429, 503])
@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "-inf", "Infinity"])
def test_a_non_finite_retry_after_is_ignored(bg, make_gateway, status, value):
    up, rec = fault(bg, "status", status=status, retry_after=value)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    r = post(gw)
    code = "rate_limit_exceeded" if status == 429 else "upstream_unavailable"
    err = assert_openai_error(r, status, code)
    assert f"injected {status}" in err["message"]
    assert "Retry-After" not in r.headers
    assert rec.hits == 3  # retried like any 429/503 without Retry-After


@pytest.mark.parametrize("value", ["1e300", "99999999999999999999"])
def test_a_huge_retry_after_is_clamped_to_a_day(bg, make_gateway, value):
    up, rec = fault(bg, "status", status=429, retry_after=value)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    r = post(gw)
    assert_openai_error(r, 429, "rate_limit_exceeded")
    assert r.headers["Retry-After"] == "86400"
    assert rec.hits == 1


def test_retry_after_seconds_parses_defensively():
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("") is None
    assert retry_after_seconds("soon") is None
    for value in ("inf", "-inf", "nan", "NaN", "1e400", "infinity"):
        assert retry_after_seconds(value) is None, value
    assert retry_after_seconds("-1") == 0.0
    assert retry_after_seconds("2.5") == 2.5
    assert retry_after_seconds("1e300") == 86400.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert retry_after_seconds("Fri, 31 Dec 9999 23:59:59 GMT") == 86400.0
    assert retry_after_seconds("Mon, 99 Foo 2015 07:28:00 GMT") is None


@pytest.mark.parametrize(
    "value, header",
    [
        (None, None), (math.inf, None), (-math.inf, None), (math.nan, None), ("junk", None), (10**400, None),
        (1e300, "86400"), (-5, "1"), (0, "1"), (2.4, "2"), (120, "120"), ("30", "30"),
    ],
)
def test_error_headers_never_raise(value, header):
    err = RateLimited("slow down", retry_after=value)
    assert err.headers() == ({} if header is None else {"Retry-After": header})


# -- A: garbage in a 2xx answer ----------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"choices": "abc"},
        {"choices": [1, "x"]},
        {"choices": None},
        {"id": "x", "choices": [{"index": 0, "message": "hello", "finish_reason": "stop"}]},
        {"id": "x", "choices": [{"index": [0], "message": {"content": "hi"}}]},
        [1, 2],
        "text",
        b"not json at all",
    ],
)
def test_a_garbage_answer_is_502_bad_upstream_response(bg, make_gateway, body):
    up, _ = fault(bg, "body", body=body)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    err = assert_openai_error(post(gw), 502, "bad_upstream_response")
    assert err["type"] == "upstream_error"


@pytest.mark.parametrize("usage", ["abc", [1, 2], 7, {"prompt_tokens": "x"}])
def test_garbage_usage_does_not_break_an_answer(bg, make_gateway, usage):
    body = {
        "id": "x", "object": "chat.completion", "model": "fake-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": usage,
    }
    up, _ = fault(bg, "body", body=body)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    r = post(gw)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ok"


def test_an_answer_without_choices_is_relayed(bg, make_gateway):
    up, _ = fault(bg, "body", body={"id": "x", "object": "chat.completion"})
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    assert post(gw).status_code == 200


# -- A: garbage mid-stream -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        b"not json",
        b"[1, 2]",
        b'"text"',
        {**chunk(), "choices": "abc"},
        {**chunk(), "choices": [1]},
        {**chunk(), "choices": [{"index": 0, "delta": "x"}]},
        {**chunk(), "choices": [{"index": 0, "delta": {"content": 5}}]},
        {**chunk(), "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": 1}}]}}]},
    ],
)
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_garbage_chunk_mid_stream_ends_with_a_bad_upstream_response_event(bg, make_gateway, bad, include_usage):
    up, _ = fault(bg, "bad_stream", bad=bad)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": include_usage}}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert '"fine "' in events[1]
    assert events[-1] != "[DONE]"
    errors = [orjson.loads(e)["error"] for e in events if '"error"' in e]
    assert len(errors) == 1 and orjson.loads(events[-1])["error"] == errors[0]
    assert errors[0]["code"] == "bad_upstream_response"
    assert errors[0]["type"] == "upstream_error"


def test_bad_upstream_response_is_a_known_error_code():
    assert BadUpstreamResponse.status == 502
    assert "bad_upstream_response" in known_error_codes()
