"""The front doors share the one pipeline: one cache entry, one ledger row each, aliases for all."""

from __future__ import annotations

import sqlite3
import time

import anthropic
import httpx
import openai
import pytest

from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app

ANSWER = "Boil the water for ten minutes"
QUESTION = "How long should I boil water to make it safe to drink?"


@pytest.fixture
def gw(bg, make_gateway):
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text=ANSWER))
    base = {**PASS_THROUGH, "policy": {**PASS_THROUGH["policy"], "cache": {"enabled": True}}}
    gateway = make_gateway(base=base, upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"])],
                           model_aliases={"claude-*": "auto", "gpt-4o*": "m", "exact-name": "m"})
    gateway.rec = rec  # type: ignore[attr-defined]
    return gateway


def _chat(gw, **headers: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16, "temperature": 0}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def _settle(gw) -> None:
    """Admission runs after the answer is sent; wait until the entry is served (a generous bound)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _chat(gw, **{"Cache-Control": "no-store"}).headers.get("x-tierlane-cache") == "hit":
            return
        time.sleep(0.05)
    raise AssertionError("the chat answer was never admitted to the cache")


def test_a_chat_answer_is_a_cache_hit_for_messages_and_responses(gw):
    assert _chat(gw).headers["x-tierlane-cache"] == "miss"
    _settle(gw)
    hits = gw.rec.hits
    claude = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
    kw = dict(model="m", max_tokens=16, messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
              extra_body={"temperature": 0})
    raw = claude.messages.with_raw_response.create(**kw)
    assert raw.headers["x-tierlane-cache"] == "hit" and raw.headers["x-tierlane-lane"] == "cache"
    assert raw.parse().content[0].text == ANSWER and raw.parse().stop_reason == "end_turn"
    with claude.messages.stream(**kw) as stream:
        assert stream.get_final_message().content[0].text == ANSWER
    gpt = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    made = gpt.responses.with_raw_response.create(model="m", input=QUESTION, max_output_tokens=16, temperature=0)
    assert made.headers["x-tierlane-cache"] == "hit" and made.parse().output_text == ANSWER
    with gpt.responses.stream(model="m", input=QUESTION, max_output_tokens=16, temperature=0) as stream:
        assert stream.get_final_response().output_text == ANSWER
    assert gw.rec.hits == hits  # the upstream was never asked again


def test_every_request_is_metered_once_with_its_api(gw, tmp_path):
    claude = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
    gpt = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    question = [{"role": "user", "content": "Hi."}]
    claude.messages.create(model="m", max_tokens=8, messages=question)
    with claude.messages.stream(model="m", max_tokens=8, messages=question) as stream:
        stream.get_final_message()
    gpt.responses.create(model="m", input="Hi.", max_output_tokens=8)
    with gpt.responses.stream(model="m", input="Hi.", max_output_tokens=8) as stream:
        stream.get_final_response()
    gpt.chat.completions.create(model="m", messages=question, max_tokens=8)
    claude.messages.count_tokens(model="m", messages=question)  # no model call, but metered (zero cost)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="unknown", max_tokens=8, messages=question)  # refused by the pipeline: metered
    r = httpx.get(gw.url + "/v1/usage", params={"group_by": "tenant"}, timeout=30)  # flushes the ledger
    assert r.status_code == 200, r.text
    conn = sqlite3.connect(tmp_path / "state" / "ledger.sqlite3")
    try:
        rows = conn.execute("SELECT api, stream, status FROM requests ORDER BY id").fetchall()
    finally:
        conn.close()
    # rows are written by the completion hooks, off the response path: their order is not the requests'
    assert sorted(rows) == sorted([("messages", 0, 200), ("messages", 1, 200), ("responses", 0, 200), ("responses", 1, 200),
                                   ("chat", 0, 200), ("messages", 0, 404), ("messages", 0, 200)])
    assert r.json()["data"][0]["requests"] == 7


def test_model_aliases_route_client_model_names(gw):
    claude = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
    raw = claude.messages.with_raw_response.create(model="claude-sonnet-4-5", max_tokens=8,
                                                   messages=[{"role": "user", "content": "Hi."}])
    assert raw.headers["x-tierlane-lane"].startswith("upstream:default")
    assert gw.rec.bodies[-1]["model"] == "m"  # auto: the pool's model
    gpt = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    assert gpt.responses.create(model="gpt-4o-mini", input="Hi.", store=False).output_text == ANSWER
    assert gpt.chat.completions.create(model="exact-name", messages=[{"role": "user", "content": "Hi."}]).choices
    assert gw.rec.bodies[-1]["model"] == "m"
    with pytest.raises(openai.NotFoundError):
        gpt.responses.create(model="o3", input="Hi.", store=False)


@pytest.mark.slow
def test_edge_answers_stream_in_each_apis_own_events(make_gateway):
    gw = make_gateway(base={**PASS_THROUGH, "edge": {"enabled": True, "n_ctx": 1024, "slots": 2, "n_threads": 1}})
    claude = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
    kw = dict(model="edge", max_tokens=8, messages=[{"role": "user", "content": "What is the capital of France?"}],
              extra_body={"temperature": 0})
    raw = claude.messages.with_raw_response.create(**kw)
    assert raw.headers["x-tierlane-lane"].startswith("edge")
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    whole = raw.parse()
    # usage differs only in the prompt tokens the edge's prefix reuse read from its KV cache
    assert final.model_dump(exclude={"id", "usage"}) == whole.model_dump(exclude={"id", "usage"})
    assert final.usage.output_tokens == whole.usage.output_tokens
    gpt = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    args = dict(model="edge", input="What is the capital of France?", max_output_tokens=8, temperature=0, store=False)
    made = gpt.responses.create(**args)
    with gpt.responses.stream(**args) as stream:
        events = list(stream)
    assert events[-1].response.output_text == made.output_text and events[-1].response.status == made.status
    assert events[-1].response.usage.output_tokens == made.usage.output_tokens


def test_a_stream_cut_upstream_ends_with_one_error_event_of_the_api(bg, make_gateway):
    up = RunningApp(bg, fault_app("cut_stream", Recorder()))
    gw = make_gateway(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"], retries=0)])
    claude = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as err:
        with claude.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi."}]) as stream:
            for _ in stream:
                pass
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "api_error"
    body = {"model": "m", "input": "Hi.", "stream": True}
    with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=30) as r:
        text = r.read().decode()
    events = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "error"
    assert events.count("error") == 1 and "response.completed" not in events and "[DONE]" not in text
