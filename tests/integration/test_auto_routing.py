"""`auto` requests through the real router, embedder, edge engine and an upstream.

Where a request goes is the gateway's own decision: those tests count it at a fixed-answer stub
(tests/support/faults.py, mode "ok"), whose hit count and answer show which requests reached it.
What an upstream answers through `auto` is checked against the real llama.cpp upstream.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app
from tests.support.llama_server import UPSTREAM_MODEL

pytestmark = pytest.mark.slow  # the edge engine or the embedder loads a real model

PROMPTS = [
    "hi there!",
    "Prove that the square root of 2 is irrational, step by step, then generalise to any prime p.",
    "What is the capital of Italy?",
    "Let f(x) = x^3 - 6x^2 + 11x - 6. Find all real roots and the intervals where f is decreasing.",
]


BASE = {
    **PASS_THROUGH,
    "edge": {"enabled": True, "n_ctx": 1024, "slots": 4, "n_threads": 1},
    "embedder": {"enabled": True},
    "policy": {**PASS_THROUGH["policy"], "router": {"enabled": True}},
}


@pytest.fixture
def gw(bg, make_gateway):
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text="from upstream"))
    gateway = make_gateway(base=BASE, upstreams=[upstream_cfg("up", up.url + "/v1", models=["big-model"])])
    gateway.rec = rec  # type: ignore[attr-defined]
    return gateway


def ask(gw, prompt: str, **headers: str) -> httpx.Response:
    body = {"model": "auto", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_auto_requests_are_scored_and_sent_where_the_decision_says(gw):
    lanes = []
    for prompt in PROMPTS:
        r = ask(gw, prompt)
        assert r.status_code == 200, r.text
        header = r.headers["x-tierlane-lane"]
        m = re.match(r"^(edge|upstream(?::\w+)?); score=([0-9.]+); reason=(router_strong|router_weak)$", header)
        assert m, header
        lane, score, reason = m.group(1), float(m.group(2)), m.group(3)
        assert 0.0 <= score <= 1.0
        assert (reason == "router_strong") == lane.startswith("upstream")
        served_by_upstream = r.json()["choices"][0]["message"]["content"] == "from upstream"
        assert served_by_upstream == lane.startswith("upstream")
        lanes.append(lane)
    assert gw.rec.hits == sum(lane.startswith("upstream") for lane in lanes)


def test_route_header_forces_a_lane(gw):
    r = ask(gw, PROMPTS[1], **{"x-tierlane-route": "edge"})
    assert r.status_code == 200
    assert r.headers["x-tierlane-lane"].startswith("edge") and "reason=forced" in r.headers["x-tierlane-lane"]
    r = ask(gw, PROMPTS[0], **{"x-tierlane-route": "upstream"})
    assert r.status_code == 200, r.text
    assert r.headers["x-tierlane-lane"].startswith("upstream") and r.json()["choices"][0]["message"]["content"] == "from upstream"


def test_auto_requests_sent_upstream_get_the_upstreams_answer_and_usage(make_gateway, llama_upstream):
    gateway = make_gateway(base=BASE, upstreams=[upstream_cfg("llama", llama_upstream.base_url, models=[UPSTREAM_MODEL])])
    messages = [{"role": "user", "content": PROMPTS[1]}]
    via = httpx.post(gateway.url + "/v1/chat/completions", json={"model": "auto", "messages": messages, "max_tokens": 4, "temperature": 0},
                     headers={"x-tierlane-route": "upstream"}, timeout=120)  # fmt: skip
    assert via.status_code == 200, via.text
    assert via.headers["x-tierlane-lane"].startswith("upstream")
    direct = httpx.post(llama_upstream.base_url + "/chat/completions", timeout=120,
                        json={"model": UPSTREAM_MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}).json()  # fmt: skip
    answer = via.json()
    assert answer["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    for field in ("prompt_tokens", "completion_tokens"):
        assert answer["usage"][field] == direct["usage"][field] > 0


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
IMAGE = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]


@pytest.mark.parametrize(("extra", "capability"), [
    ({"tools": TOOLS}, "tools"),
    ({"messages": IMAGE}, "image"),
    ({"n": 2}, "n"),
    ({"logit_bias": {"1": 2}}, "logit_bias"),
])
def test_auto_requests_the_edge_cannot_serve_go_upstream_with_the_reason(gw, extra, capability):
    body = {"model": "auto", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4, **extra}
    hits = gw.rec.hits
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-tierlane-lane"].startswith("upstream")
    assert r.headers["x-tierlane-lane"].endswith(f"reason=capability:{capability}")
    assert gw.rec.hits == hits + 1


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": TOOLS}, "tools"),
    ({"messages": IMAGE}, "messages[0].content[1]"),
    ({"n": 2}, "n"),
    ({"modalities": ["text", "audio"]}, "modalities"),
])
def test_requests_pinned_to_the_edge_get_a_400_naming_the_parameter(gw, extra, param):
    hits = gw.rec.hits
    for how in ({"model": "smollm2"}, {"model": "auto", "headers": {"x-tierlane-route": "edge"}}):
        headers = how.pop("headers", {})
        body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4, **how, **extra}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "unsupported_on_edge", param)
    assert gw.rec.hits == hits  # nothing was answered differently elsewhere
