"""The upstream pool under fault injection: retries, Retry-After, fallback, breaker, timeouts, cuts."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, ask_then_leave, fault_app

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def fault(bg, mode: str, **opts) -> tuple[RunningApp, Recorder]:
    rec = Recorder()
    return RunningApp(bg, fault_app(mode, rec, **opts)), rec


def post(gw: RunningApp, body=CHAT, timeout: float = 30, **kw) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=timeout, **kw)


def test_503_is_retried_and_then_succeeds(bg, make_gateway):
    up, rec = fault(bg, "status", status=503, fail_first=2)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    r = post(gw)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "hello there"
    assert rec.hits == 3


def test_retry_after_is_honoured(bg, make_gateway):
    up, rec = fault(bg, "status", status=429, retry_after=1, fail_first=1)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    started = time.monotonic()
    r = post(gw)
    assert r.status_code == 200
    assert rec.hits == 2
    assert time.monotonic() - started >= 0.95  # waited the upstream's Retry-After, not the 10 ms backoff


def test_long_retry_after_goes_back_to_the_client(bg, make_gateway):
    up, rec = fault(bg, "status", status=429, retry_after=120)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    r = post(gw)
    assert r.status_code == 429
    assert r.headers["Retry-After"] == "120"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert rec.hits == 1


def test_fallback_pool_answers_when_the_primary_is_down(bg, make_gateway):
    down, down_rec = fault(bg, "status", status=502)
    ok, ok_rec = fault(bg, "ok", text="from fallback")
    gw = make_gateway(
        upstreams=[upstream_cfg("a", down.url + "/v1", pool="primary"), upstream_cfg("b", ok.url + "/v1", pool="backup")],
        pools={"primary": {"fallback": ["backup"]}},
    )
    r = post(gw)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "from fallback"
    assert down_rec.hits == 3 and ok_rec.hits == 1


def test_connection_reset_is_retried(bg, make_gateway):
    up, rec = fault(bg, "reset", fail_first=1)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    r = post(gw)
    assert r.status_code == 200, r.text
    assert rec.hits == 2


def test_unreachable_upstream_is_503(make_gateway):
    gw = make_gateway(upstreams=[upstream_cfg("a", "http://127.0.0.1:9/v1")])
    r = post(gw)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "upstream_unavailable"


def test_breaker_opens_and_stops_sending(bg, make_gateway):
    up, rec = fault(bg, "status", status=502)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", retries=0, breaker_failures=3, breaker_cooldown_s=60)])
    codes = [post(gw).status_code for _ in range(6)]
    assert codes[:3] == [502, 502, 502]
    assert codes[3:] == [503, 503, 503]  # breaker open: no healthy upstream
    assert rec.hits == 3
    assert httpx.get(gw.url + "/readyz").status_code == 503


def test_breaker_half_open_probe_closes_it(bg, make_gateway):
    up, rec = fault(bg, "status", status=502, fail_first=2, models_route=True)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", retries=0, breaker_failures=2, breaker_cooldown_s=1.0)])
    gets = len(rec.models_gets)
    rec.models_held = True  # a probe that a slow third request lets start stays in flight: the breaker stays open
    assert [post(gw).status_code for _ in range(3)] == [502, 502, 503]
    rec.models_held = False
    deadline = time.monotonic() + 60  # after the cooldown the gateway's own probe (GET /models) closes it
    while httpx.get(gw.url + "/readyz").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(rec.models_gets) == gets + 1 and rec.hits == 2
    assert post(gw).status_code == 200
    assert post(gw).status_code == 200


def test_slow_upstream_times_out_with_504(bg, make_gateway):
    up, _ = fault(bg, "slow", delay=5)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", read_timeout_s=0.3)])
    r = post(gw)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"


def test_malformed_json_is_502(bg, make_gateway):
    up, _ = fault(bg, "malformed")
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    r = post(gw)
    assert r.status_code == 502
    assert "malformed" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "bad_upstream_response"


def test_huge_response_is_refused(bg, make_gateway):
    up, _ = fault(bg, "huge", size=3 * 1024 * 1024)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", max_response_bytes=1024 * 1024)])
    r = post(gw)
    assert r.status_code == 502
    assert "size limit" in r.json()["error"]["message"]


def test_stream_cut_midway_ends_with_one_error_event(bg, make_gateway):
    up, _ = fault(bg, "cut_stream")
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert '"partial"' in events[1]
    assert '"error"' in events[-1] and "stream_cut" in events[-1]
    assert sum('"error"' in e for e in events) == 1
    assert "[DONE]" not in events[-1]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(**CHAT, stream=True):
            pass


def test_client_disconnect_cancels_the_upstream_stream(bg, make_gateway):
    up, rec = fault(bg, "slow_stream", interval=0.05, chunks=400)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 60
    while rec.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rec.cancelled == 1
    assert rec.inflight == 0


def test_client_disconnect_cancels_a_waiting_request(bg, make_gateway):
    up, rec = fault(bg, "slow", delay=600)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    ask_then_leave(bg, gw.url + "/v1/chat/completions", CHAT, rec)  # gone once the upstream is waited on
    deadline = time.monotonic() + 60
    while rec.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rec.cancelled == 1


def test_least_outstanding_spreads_concurrent_requests(bg, make_gateway):
    """Each upstream holds its answers until all 8 requests have reached them (a barrier, not a delay
    that a slow machine outlasts): every pick sees the counts of the picks before it."""

    def all_in_flight() -> bool:
        return rec_a.hits + rec_b.hits >= 8  # arrivals: unlike `inflight`, it stays true once true

    a, rec_a = fault(bg, "ok", hold_until=all_in_flight)
    b, rec_b = fault(bg, "ok", hold_until=all_in_flight)
    gw = make_gateway(upstreams=[upstream_cfg("a", a.url + "/v1"), upstream_cfg("b", b.url + "/v1")])

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            import asyncio

            rs = await asyncio.gather(*(client.post(gw.url + "/v1/chat/completions", json=CHAT) for _ in range(8)))
            return [r.status_code for r in rs]

    assert bg.call(burst()) == [200] * 8
    assert rec_a.hits == 4 and rec_b.hits == 4


def test_headers_forwarded_and_stripped(bg, make_gateway):
    up, rec = fault(bg, "ok")
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", api_key_env="UPSTREAM_KEY")])
    # api_key_env is resolved from the process environment at load; here none is set
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    r = post(gw, headers={"Authorization": "Bearer client-secret", "traceparent": tp, "Connection": "keep-alive, X-Drop",
                          "X-Drop": "1", "Keep-Alive": "timeout=5", "OpenAI-Organization": "org-1", "x-tierlane-route": "upstream"})
    assert r.status_code == 200
    seen = {k.lower(): v for k, v in rec.headers[0].items()}
    assert seen["traceparent"] == tp
    assert seen["openai-organization"] == "org-1"
    assert "authorization" not in seen
    assert "x-drop" not in seen and "keep-alive" not in seen and "x-tierlane-route" not in seen


def test_pass_through_auth_forwards_the_client_key(bg, make_gateway):
    up, rec = fault(bg, "ok")
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", pass_client_auth=True)])
    post(gw, headers={"Authorization": "Bearer client-secret"})
    assert rec.headers[0]["Authorization"] == "Bearer client-secret"


def test_stream_usage_is_requested_upstream_but_not_shown_unasked(bg, make_gateway):
    up, rec = fault(bg, "ok", text="a b c")
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(**CHAT, stream=True))
    assert rec.bodies[0]["stream_options"] == {"include_usage": True}
    assert all(c.usage is None for c in chunks)
    chunks = list(client.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_embeddings_are_forwarded(bg, make_gateway):
    up, rec = fault(bg, "ok")
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    out = client.embeddings.create(model="emb", input="hello")
    assert out.data[0].embedding == [0.1, 0.2, 0.3]


def test_error_answers_to_bad_requests_do_not_open_the_breaker(bg, make_gateway):
    """llama.cpp's server answers 500 to a body it cannot validate: one tenant's bad requests
    must not take the upstream away from everyone."""
    up, rec = fault(bg, "status", status=500)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", retries=0, breaker_failures=2, breaker_cooldown_s=60)])
    codes = [post(gw).status_code for _ in range(6)]
    assert codes == [502] * 6  # relayed as a bad gateway answer, never "no healthy upstream"
    assert rec.hits == 6
    assert httpx.get(gw.url + "/readyz").status_code == 200
