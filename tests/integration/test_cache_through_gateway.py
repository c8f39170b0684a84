"""The semantic cache end to end: real embedder, faiss and SQLite behind the HTTP API and the SDK,
in front of the real llama.cpp upstream (greedy, a few tokens): a hit serves the upstream's own
answer and usage, as JSON and as an SSE stream the SDK reads."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.llama_server import UPSTREAM_MODEL

pytestmark = pytest.mark.slow  # the embedder and the upstream load real models

# The shipped min_probability (0.96, chosen for precision >= 0.97 on held-out QQP) serves only
# near-rewrites; these tests exercise the paraphrase path with a lenient policy an operator may set.
LENIENT = 0.5
QUESTION = "How long should I boil water to make it safe to drink?"
# Only answers that ended on their own are cached: a stop sequence ends these within a few tokens
# ("The ideal amount of boiling to make| water", "The temperature at which| water boils ...").
DECODING = {"max_tokens": 8, "temperature": 0, "stop": [" water", " eggs"]}


def _gateway(make_gateway, llama_upstream, cache: dict, **embedder):
    base = {**PASS_THROUGH, "embedder": {"enabled": True, **embedder}, "policy": {**PASS_THROUGH["policy"], "cache": cache}}
    return make_gateway(base=base, upstreams=[upstream_cfg("llama", llama_upstream.base_url, models=[UPSTREAM_MODEL])])


@pytest.fixture
def gw(make_gateway, llama_upstream):
    return _gateway(make_gateway, llama_upstream, {"enabled": True, "verify": {"min_probability": LENIENT}})


def chat(gw, text: str, headers: dict[str, str] | None = None, **extra) -> httpx.Response:
    body = {"model": UPSTREAM_MODEL, "messages": [{"role": "user", "content": text}], **DECODING, **extra}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=60)


def settle(gw) -> None:
    """Admission runs after the answer is sent; wait until the stored entry is visible (a generous bound)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = chat(gw, QUESTION, {"Cache-Control": "no-store"})
        if r.headers.get("x-tierlane-cache") == "hit":
            return
        time.sleep(0.1)
    raise AssertionError("the answer was never admitted to the cache")


def test_miss_then_exact_and_paraphrase_hits(gw):
    first = chat(gw, QUESTION)
    assert first.headers["x-tierlane-cache"] == "miss" and first.headers["x-tierlane-lane"].startswith("upstream")
    answer = first.json()
    assert answer["choices"][0]["message"]["content"]
    settle(gw)
    repeat = chat(gw, QUESTION)
    assert repeat.headers["x-tierlane-cache"] == "hit"
    assert repeat.headers["x-tierlane-lane"] == "cache"
    assert float(repeat.headers["x-tierlane-cache-similarity"]) == pytest.approx(1.0)
    # the upstream's own answer and usage, served again
    assert repeat.json()["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]
    assert repeat.json()["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]
    para = chat(gw, "how long do i need to boil water so that it is safe to drink")
    assert para.headers["x-tierlane-cache"] == "hit", para.headers
    assert para.headers["x-tierlane-lane"] == "cache"
    assert 0.8 < float(para.headers["x-tierlane-cache-similarity"]) < 1.0
    other = chat(gw, "How long should I boil eggs to make them hard?")
    assert other.headers["x-tierlane-cache"] == "miss"
    assert other.headers["x-tierlane-lane"].startswith("upstream")  # only the different question reached the upstream


def test_cache_control_and_tenant_scope(gw):
    chat(gw, QUESTION)
    settle(gw)
    assert chat(gw, QUESTION, {"Cache-Control": "no-cache"}).headers["x-tierlane-cache"] == "bypass"
    hot = chat(gw, QUESTION, temperature=1.5)
    assert hot.headers["x-tierlane-cache"] == "bypass"


def test_streamed_hit_is_a_valid_sse_stream_for_the_sdk(gw):
    stored = chat(gw, QUESTION).json()
    settle(gw)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.with_raw_response.create(
        model=UPSTREAM_MODEL, messages=[{"role": "user", "content": QUESTION}], **DECODING,
        stream=True, stream_options={"include_usage": True},
    )
    assert stream.headers["x-tierlane-cache"] == "hit"
    chunks = list(stream.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == stored["choices"][0]["message"]["content"]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == stored["usage"]["completion_tokens"]
    assert chunks[-1].usage.prompt_tokens == stored["usage"]["prompt_tokens"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [stored["choices"][0]["finish_reason"]]


def test_streamed_miss_is_assembled_and_stored(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    q = [{"role": "user", "content": "What temperature does water boil at on Everest?"}]
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=UPSTREAM_MODEL, messages=q, stream=True, **DECODING) if c.choices]
    streamed = "".join(parts)
    assert streamed.strip()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": UPSTREAM_MODEL, "messages": q, **DECODING}, timeout=60)
        if r.headers["x-tierlane-cache"] == "hit":
            break
        time.sleep(0.1)
    assert r.headers["x-tierlane-cache"] == "hit"
    assert r.json()["choices"][0]["message"]["content"] == streamed  # the stream, assembled as it was sent


def test_readiness_names_the_embedding_backend(gw):
    ready = httpx.get(gw.url + "/readyz", timeout=10)
    assert ready.status_code == 200
    assert ready.json()["checks"]["embedder"] == "onnx"
    assert ready.json()["checks"]["embedder_precision"] == "int8"  # the default


def test_fp32_embedder_serves_exact_and_paraphrase_hits(make_gateway, llama_upstream):
    gw = _gateway(make_gateway, llama_upstream, {"enabled": True, "verify": {"min_probability": LENIENT}}, precision="fp32")
    assert httpx.get(gw.url + "/readyz", timeout=10).json()["checks"]["embedder_precision"] == "fp32"
    first = chat(gw, QUESTION)
    assert first.headers["x-tierlane-cache"] == "miss"
    settle(gw)
    para = chat(gw, "how long do i need to boil water so that it is safe to drink")
    assert para.headers["x-tierlane-cache"] == "hit", para.headers
    assert para.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert chat(gw, "How long should I boil eggs to make them hard?").headers["x-tierlane-cache"] == "miss"


def test_the_shipped_verifier_serves_only_what_it_is_sure_of(make_gateway, llama_upstream):
    gw = _gateway(make_gateway, llama_upstream, {"enabled": True})
    chat(gw, QUESTION)
    settle(gw)
    assert chat(gw, QUESTION).headers["x-tierlane-cache"] == "hit"
    # a paraphrase the verifier is not 0.96 sure of goes to the upstream
    assert chat(gw, "how long do i need to boil water so that it is safe to drink").headers["x-tierlane-cache"] == "miss"
