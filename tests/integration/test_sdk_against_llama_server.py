"""The official openai SDK, sync and async, streaming and not, through the gateway to a real llama.cpp server."""

from __future__ import annotations

import asyncio
import math
import time

import openai
import pytest

from tests.support.config import upstream_cfg
from tests.support.llama_server import UPSTREAM_MODEL

MESSAGES = [{"role": "user", "content": "Name one colour of the rainbow."}]


@pytest.fixture
def gateway(llama_upstream, make_gateway):
    return make_gateway(upstreams=[upstream_cfg("llama", llama_upstream.base_url, models=[UPSTREAM_MODEL])])


def test_sync_non_stream_matches_the_upstream(gateway, llama_upstream):
    via = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    direct = openai.OpenAI(base_url=llama_upstream.base_url, api_key="x", max_retries=0)
    kw = dict(model=UPSTREAM_MODEL, messages=MESSAGES, max_tokens=16, temperature=0, seed=1)
    started = time.perf_counter()
    a = via.chat.completions.with_raw_response.create(**kw)
    wall_ms = (time.perf_counter() - started) * 1000
    b = direct.chat.completions.create(**kw)
    out = a.parse()
    assert out.choices[0].message.content == b.choices[0].message.content
    assert out.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.headers["x-tierlane-lane"] == "upstream:default"
    # the gateway's own time: a finite number, well below the request's, which the upstream's decoding fills
    overhead_ms = float(a.headers["x-tierlane-overhead-ms"])
    assert math.isfinite(overhead_ms) and 0.0 <= overhead_ms < wall_ms / 2, (overhead_ms, wall_ms)


def test_sync_stream_assembles_to_the_same_text(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=UPSTREAM_MODEL, messages=MESSAGES, max_tokens=16, temperature=0, seed=1)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def test_async_client_stream_and_not(gateway):
    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=UPSTREAM_MODEL, messages=MESSAGES, max_tokens=12, temperature=0, seed=3)
        whole = (await client.chat.completions.create(**kw)).choices[0].message.content
        stream = await client.chat.completions.create(**kw, stream=True)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await client.close()
        return whole, "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole and whole == streamed


def test_text_completions_and_models(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model=UPSTREAM_MODEL, prompt="The sky is", max_tokens=5, temperature=0)
    assert out.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=UPSTREAM_MODEL, prompt="The sky is", max_tokens=5, temperature=0, stream=True))
    assert streamed == out.choices[0].text
    assert UPSTREAM_MODEL in [m.id for m in client.models.list()]


def test_upstream_4xx_comes_back_as_an_openai_error(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=UPSTREAM_MODEL, messages=[{"role": "user", "content": "x " * 5000}], max_tokens=4)
    assert 400 <= err.value.status_code < 500
