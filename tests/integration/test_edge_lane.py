"""The edge lane through the gateway: the bundled GGUF answers `edge` requests, JSON and SSE."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.config import PASS_THROUGH

pytestmark = pytest.mark.slow  # the edge engine or the embedder loads a real model

EDGE_ON = {**PASS_THROUGH, "edge": {"enabled": True, "n_ctx": 1024, "slots": 4, "n_threads": 1}}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def gw(make_gateway):
    return make_gateway(base=EDGE_ON)


def test_edge_answers_json_and_stream_alike(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="edge", messages=MESSAGES, max_tokens=12, temperature=0)
    whole = raw.parse()
    assert raw.headers["x-tierlane-lane"] == "edge"
    assert whole.choices[0].message.content
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(
        model="edge", messages=MESSAGES, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_edge_alias_and_models_listing(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    ids = [m.id for m in client.models.list()]
    assert "edge" in ids and "auto" in ids
    out = client.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=4, temperature=0)
    assert out.choices[0].text


def test_auto_without_upstreams_goes_to_edge(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "auto", "messages": MESSAGES, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    assert r.headers["x-tierlane-lane"].startswith("edge")


def test_prompt_over_the_context_is_400(gw):
    long = [{"role": "user", "content": "word " * 3000}]
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "edge", "messages": long, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    ok = httpx.post(gw.url + "/v1/chat/completions", json={"model": "edge", "messages": MESSAGES, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_penalties_and_lax_values_never_take_the_edge_lane_down(gw):
    """A valid request with penalties used to kill the scheduler; the next one aborted the process."""
    base = {"model": "edge", "messages": MESSAGES, "max_tokens": 2}
    for extra in ({"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"repeat_penalty": 1.3}):
        r = httpx.post(gw.url + "/v1/chat/completions", json={**base, **extra}, timeout=10)
        assert r.status_code == 200, (extra, r.text)
    r = httpx.post(gw.url + "/v1/chat/completions", json={**base, "seed": "12"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    r = httpx.post(gw.url + "/v1/chat/completions", json=base, timeout=10)
    assert r.status_code == 200
    assert httpx.get(gw.url + "/readyz").json()["checks"]["edge"] == "loaded"


def test_one_tenant_cannot_read_another_tenants_prompt_from_cached_tokens(make_gateway):
    from gateway.auth import hash_key

    keys = [{"sha256": hash_key(f"key-{t}"), "tenant": t} for t in ("a", "b")]
    gw = make_gateway(base=EDGE_ON, auth={"mode": "keys", "keys": keys})
    secret = [{"role": "user", "content": "Internal memo: the Q3 launch codename is BLUE HERON, budget 4.2M. Summarise."}]

    def cached(tenant: str, messages: list) -> int:
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": "edge", "messages": messages, "max_tokens": 1, "temperature": 0},
            headers={"Authorization": f"Bearer key-{tenant}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached("a", secret)
    assert cached("b", secret) == 0  # an exact guess learns nothing
    assert cached("a", secret) > 20  # the owner's repeat is served from its own cells
