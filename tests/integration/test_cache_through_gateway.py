"""The semantic cache end to end: real embedder, faiss and SQLite behind the HTTP API and the SDK."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app

# The shipped min_probability (0.96, chosen for precision >= 0.97 on held-out QQP) serves only
# near-rewrites; these tests exercise the paraphrase path with a lenient policy an operator may set.
LENIENT = 0.5


@pytest.fixture
def gw(bg, make_gateway):
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text="Boil the water for ten minutes"))
    base = {**PASS_THROUGH, "embedder": {"enabled": True}, "policy": {**PASS_THROUGH["policy"], "cache": {"enabled": True, "verify": {"min_probability": LENIENT}}}}
    gateway = make_gateway(base=base, upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"])])
    gateway.rec = rec  # type: ignore[attr-defined]
    return gateway


def chat(gw, text: str, headers: dict[str, str] | None = None, **extra) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], **extra}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=60)


def settle(gw) -> None:
    """Admission runs after the answer is sent; wait until the stored entry is visible."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = chat(gw, "How long should I boil water to make it safe to drink?", {"Cache-Control": "no-store"})
        if r.headers.get("x-tierlane-cache") == "hit":
            return
        time.sleep(0.1)
    raise AssertionError("the answer was never admitted to the cache")


def test_miss_then_exact_and_paraphrase_hits(gw):
    first = chat(gw, "How long should I boil water to make it safe to drink?")
    assert first.headers["x-tierlane-cache"] == "miss"
    settle(gw)
    upstream_hits = gw.rec.hits
    repeat = chat(gw, "How long should I boil water to make it safe to drink?")
    assert repeat.headers["x-tierlane-cache"] == "hit"
    assert repeat.headers["x-tierlane-lane"] == "cache"
    assert float(repeat.headers["x-tierlane-cache-similarity"]) == pytest.approx(1.0)
    assert repeat.json()["choices"][0]["message"]["content"] == "Boil the water for ten minutes"
    para = chat(gw, "how long do i need to boil water so that it is safe to drink")
    assert para.headers["x-tierlane-cache"] == "hit", para.headers
    assert 0.8 < float(para.headers["x-tierlane-cache-similarity"]) < 1.0
    other = chat(gw, "How long should I boil eggs to make them hard?")
    assert other.headers["x-tierlane-cache"] == "miss"
    assert gw.rec.hits == upstream_hits + 1  # only the different question reached the upstream


def test_cache_control_and_tenant_scope(gw):
    chat(gw, "How long should I boil water to make it safe to drink?")
    settle(gw)
    assert chat(gw, "How long should I boil water to make it safe to drink?", {"Cache-Control": "no-cache"}).headers["x-tierlane-cache"] == "bypass"
    hot = chat(gw, "How long should I boil water to make it safe to drink?", temperature=1.5)
    assert hot.headers["x-tierlane-cache"] == "bypass"


def test_streamed_hit_is_a_valid_sse_stream_for_the_sdk(gw):
    chat(gw, "How long should I boil water to make it safe to drink?")
    settle(gw)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "How long should I boil water to make it safe to drink?"}],
        stream=True, stream_options={"include_usage": True},
    )
    assert stream.headers["x-tierlane-cache"] == "hit"
    chunks = list(stream.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Boil the water for ten minutes"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_streamed_miss_is_assembled_and_stored(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    q = [{"role": "user", "content": "What temperature does water boil at on Everest?"}]
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(model="m", messages=q, stream=True) if c.choices]
    assert "".join(parts).strip() == "Boil the water for ten minutes"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": q}, timeout=60)
        if r.headers["x-tierlane-cache"] == "hit":
            break
        time.sleep(0.1)
    assert r.headers["x-tierlane-cache"] == "hit"
    assert r.json()["choices"][0]["message"]["content"].strip() == "Boil the water for ten minutes"


def test_readiness_names_the_embedding_backend(gw):
    ready = httpx.get(gw.url + "/readyz", timeout=10)
    assert ready.status_code == 200
    assert ready.json()["checks"]["embedder"] == "onnx"


def test_the_shipped_verifier_serves_only_what_it_is_sure_of(bg, make_gateway):
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text="Boil the water for ten minutes"))
    base = {**PASS_THROUGH, "embedder": {"enabled": True}, "policy": {**PASS_THROUGH["policy"], "cache": {"enabled": True}}}
    gw = make_gateway(base=base, upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"])])
    chat(gw, "How long should I boil water to make it safe to drink?")
    settle(gw)
    assert chat(gw, "How long should I boil water to make it safe to drink?").headers["x-tierlane-cache"] == "hit"
    # a paraphrase the verifier is not 0.96 sure of goes to the upstream
    assert chat(gw, "how long do i need to boil water so that it is safe to drink").headers["x-tierlane-cache"] == "miss"
