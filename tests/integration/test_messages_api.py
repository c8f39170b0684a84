"""The Anthropic Messages API through the gateway, with the official `anthropic` SDK.

Text answers come from the real llama.cpp upstream; the tool round trip from a small upstream
that asks for a tool (see tests/support/tool_upstream.py for why).
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from gateway.auth import hash_key
from tests.support.anthropic_upstream import TEXT, anthropic_app
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app
from tests.support.llama_server import UPSTREAM_MODEL
from tests.support.tool_upstream import TOOL, tool_app, weather

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}
QUESTION = [{"role": "user", "content": "Name one colour of the rainbow."}]
WEATHER_TOOL = {"name": TOOL, "description": "The weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
def gateway(llama_upstream, make_gateway):
    return make_gateway(upstreams=[upstream_cfg("llama", llama_upstream.base_url, models=[UPSTREAM_MODEL])])


def client(gw, key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)


def test_create_and_stream_give_the_same_message(gateway):
    sdk = client(gateway)
    # temperature is no argument of newer SDKs: sent as the wire field it still is
    kw = dict(model=UPSTREAM_MODEL, max_tokens=12, messages=QUESTION, system="Answer briefly.", extra_body=GREEDY)
    raw = sdk.messages.with_raw_response.create(**kw)
    whole = raw.parse()
    assert raw.headers["x-tierlane-lane"] == "upstream:default"
    assert whole._request_id == raw.headers["x-request-id"]
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.content and whole.content[0].type == "text" and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    with sdk.messages.stream(**kw) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events and "message_delta" in events
    assert final.model_dump(exclude={"id", "usage"}) == whole.model_dump(exclude={"id", "usage"})
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_length_stop_maps_to_max_tokens(gateway):
    out = client(gateway).messages.create(model=UPSTREAM_MODEL, max_tokens=1, extra_body=GREEDY,
                                          messages=[{"role": "user", "content": "Count from one to twenty."}])
    assert out.stop_reason == "max_tokens"
    assert out.usage.output_tokens == 1


def test_count_tokens_grows_with_the_prompt(gateway):
    sdk = client(gateway)
    short = sdk.messages.count_tokens(model=UPSTREAM_MODEL, messages=QUESTION)
    long = sdk.messages.count_tokens(model=UPSTREAM_MODEL, system="You are a careful assistant. " * 10, messages=QUESTION,
                                     thinking={"type": "disabled"}, cache_control={"type": "ephemeral"})
    assert 0 < short.input_tokens < long.input_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_round_trip(bg, make_gateway, stream):
    rec = Recorder()
    up = RunningApp(bg, tool_app(rec))
    gw = make_gateway(upstreams=[upstream_cfg("tools", up.url + "/v1", models=["tool-model"])])
    sdk = client(gw)
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="tool-model", max_tokens=16, tools=[WEATHER_TOOL], tool_choice={"type": "auto"})
    if stream:
        with sdk.messages.stream(messages=messages, **kw) as s:
            first = s.get_final_message()
    else:
        first = sdk.messages.create(messages=messages, **kw)
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == TOOL and use.input == {"city": "Paris"}
    sent = rec.bodies[0]
    assert sent["tools"][0]["function"]["name"] == TOOL and sent["tool_choice"] == "auto"
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": weather(use.input)}]},
    ]
    second = sdk.messages.create(messages=messages, **kw)
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == "It is sunny in Paris."
    turn = rec.bodies[1]["messages"]
    assert turn[-2]["tool_calls"][0]["id"] == use.id
    assert turn[-1] == {"role": "tool", "tool_call_id": use.id, "content": "sunny in Paris"}


def test_errors_are_anthropic_errors(make_gateway, llama_upstream):
    key = "tl-messages-test-key"
    gw = make_gateway(
        upstreams=[upstream_cfg("llama", llama_upstream.base_url, models=[UPSTREAM_MODEL])],
        auth={"mode": "keys", "keys": [{"sha256": hash_key(key), "tenant": "acme"}]},
    )
    body = dict(model=UPSTREAM_MODEL, max_tokens=4, messages=QUESTION)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client(gw, "wrong").messages.create(**body)
    assert auth.value.body["error"]["type"] == "authentication_error"
    sdk = client(gw, key)  # sent as x-api-key
    assert sdk.messages.create(**body).content
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk.messages.create(**{**body, "model": "claude-nonexistent"})
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.create(**body, extra_body={"temperature": 1.5})
    assert "temperature" in bad.value.message
    # a server tool is dropped and named by default (the model answers without it)
    served = sdk.messages.with_raw_response.create(**body, tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert served.headers["x-tierlane-dropped"] == "tools.web_search_20250305" and served.parse().content
    strict = make_gateway(
        upstreams=[upstream_cfg("llama", llama_upstream.base_url, models=[UPSTREAM_MODEL])],
        auth={"mode": "keys", "keys": [{"sha256": hash_key(key), "tenant": "acme"}]},
        apis={"hosted_tools": "reject", "unknown_fields": "reject"},
    )
    with pytest.raises(anthropic.BadRequestError) as server_tool:
        client(strict, key).messages.create(**body, tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "web_search" in server_tool.value.message and server_tool.value.body["error"]["type"] == "invalid_request_error"
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    wrong_method = httpx.get(gw.url + "/v1/messages", headers=headers)
    assert wrong_method.status_code == 405
    assert wrong_method.json()["type"] == "error" and wrong_method.json()["error"]["type"] == "invalid_request_error"
    no_route = httpx.post(gw.url + "/v1/messages/nope", headers=headers, json={})
    assert no_route.status_code == 404 and no_route.json()["error"]["type"] == "not_found_error"
    too_big = httpx.post(gw.url + "/v1/messages", headers=headers, content=b"x" * (5 * 1024 * 1024))
    assert too_big.status_code == 413 and too_big.json()["error"]["type"] == "request_too_large"
    unknown = httpx.post(strict.url + "/v1/messages", headers=headers, json={**body, "brand_new": 1})
    assert unknown.status_code == 400 and "brand_new" in unknown.json()["error"]["message"]
    assert unknown.json()["type"] == "error"
    dropped = httpx.post(gw.url + "/v1/messages", headers=headers, json={**body, "brand_new": 1, "mcp_servers": []},
                         timeout=60)
    assert dropped.status_code == 200 and dropped.headers["x-tierlane-dropped"] == "brand_new,mcp_servers"


def test_dropped_fields_are_accepted(gateway):
    out = client(gateway).messages.create(
        model=UPSTREAM_MODEL, max_tokens=4,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=QUESTION, metadata={"user_id": "u-1"},
        service_tier="auto", thinking={"type": "disabled"}, output_config={"effort": "low"}, cache_control={"type": "ephemeral"},
        extra_body=GREEDY,
        extra_headers={"anthropic-beta": "context-management-2025-06-27"},
    )
    assert out.content


def test_an_upstream_serving_messages_natively_gets_the_body_as_sent(bg, make_gateway, tmp_path):
    """`apis: [chat, messages]`: thinking and cache marks reach it; its own answer (thinking block
    included) reaches the client, JSON and stream alike, and is metered once each."""
    rec = Recorder()
    up = RunningApp(bg, anthropic_app(rec))
    gw = make_gateway(upstreams=[upstream_cfg("claude", up.url + "/v1", models=["big-model"], apis=["chat", "messages"],
                                              api_key="upstream-secret")],
                      model_aliases={"claude-*": "big-model"}, telemetry={"metering": True})
    sdk = client(gw)
    kw = dict(model="claude-sonnet-4-5", max_tokens=16, thinking={"type": "enabled", "budget_tokens": 1024},
              system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
              messages=[{"role": "user", "content": "Capital of France?"}])
    whole = sdk.messages.create(**kw)
    assert [block.type for block in whole.content] == ["thinking", "text"] and whole.content[1].text == TEXT
    assert whole.content[0].signature == "sig"  # type: ignore[union-attr]  # the signature untouched
    assert whole.model == "claude-sonnet-4-5"  # the name the client asked for
    sent = rec.bodies[-1]
    assert sent["model"] == "big-model" and sent["thinking"] == kw["thinking"] and sent["system"] == kw["system"]
    assert rec.headers[-1]["x-api-key"] == "upstream-secret"
    with sdk.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.model_dump(exclude={"usage"}) == whole.model_dump(exclude={"usage"})
    assert final.usage.output_tokens == whole.usage.output_tokens
    httpx.get(gw.url + "/v1/usage", timeout=30)  # flushes the ledger
    import sqlite3

    conn = sqlite3.connect(tmp_path / "state" / "ledger.sqlite3")
    try:
        rows = conn.execute("SELECT api, stream, input_tokens, output_tokens FROM requests").fetchall()
    finally:
        conn.close()
    assert rows == [("messages", 0, 15, 5), ("messages", 1, 15, 5)]


def test_count_tokens_is_rate_limited_metered_and_counts_tools(make_gateway, tmp_path):
    gw = make_gateway(upstreams=[upstream_cfg("none", "http://127.0.0.1:9/v1", models=["m"])],
                      policy={"budgets": {"enabled": True, "tenant": {"requests_per_minute": 3}}})
    sdk = client(gw)
    tools: Any = [{"name": "lookup", "description": "Look a word up in the dictionary. " * 5,
                   "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}}}]
    bare = sdk.messages.count_tokens(model="m", messages=QUESTION).input_tokens
    with_tools = sdk.messages.count_tokens(model="m", messages=QUESTION, tools=tools).input_tokens
    assert with_tools > bare + 30  # the tool definitions are read by the model: they count
    sdk.messages.count_tokens(model="m", messages=QUESTION)
    with pytest.raises(anthropic.RateLimitError) as limited:  # the fourth in a minute, at 3 per minute
        sdk.messages.count_tokens(model="m", messages=QUESTION)
    assert limited.value.body["type"] == "error" and limited.value.body["error"]["type"] == "rate_limit_error"
    httpx.get(gw.url + "/v1/usage", timeout=30)  # flushes the ledger
    import sqlite3

    conn = sqlite3.connect(tmp_path / "state" / "ledger.sqlite3")
    try:
        rows = conn.execute("SELECT operation, api, lane, status, cost, input_tokens FROM requests ORDER BY id").fetchall()
    finally:
        conn.close()
    assert sorted(rows) == sorted([("count_tokens", "messages", "none", 200, 0.0, 0)] * 3
                                  + [("count_tokens", "messages", "none", 429, 0.0, 0)])


def test_a_native_messages_upstream_records_no_trim_saving_it_did_not_get(bg, make_gateway, tmp_path):
    """The native upstream gets the client's body untrimmed: the ledger must not count a trim saving."""
    rec = Recorder()
    up = RunningApp(bg, anthropic_app(rec))
    gw = make_gateway(upstreams=[upstream_cfg("claude", up.url + "/v1", models=["big-model"], apis=["chat", "messages"])],
                      policy={"trim": {"enabled": True}}, telemetry={"metering": True})
    padded = "Answer in one word, please.\n" * 30  # identical lines: the boilerplate pass collapses them
    raw = client(gw).messages.with_raw_response.create(model="big-model", max_tokens=16, system=padded,
                                                       messages=[{"role": "user", "content": "Capital of France?"}])
    assert raw.headers["x-tierlane-trim"] == "none;native"
    assert rec.bodies[-1]["system"] == padded  # sent as the client sent it
    httpx.get(gw.url + "/v1/usage", timeout=30)  # flushes the ledger
    import sqlite3

    conn = sqlite3.connect(tmp_path / "state" / "ledger.sqlite3")
    try:
        rows = conn.execute("SELECT trimmed_tokens, saved_trim FROM requests").fetchall()
    finally:
        conn.close()
    assert rows == [(0, 0.0)]


def test_native_pass_through_is_decided_per_member_that_answers(bg, make_gateway, tmp_path):
    """A pool whose fallback serves only chat: the native member still gets the client's own body
    (cache marks included) and nothing is named dropped; when the fallback answers, it gets the
    translation and the marks it lost are named."""
    native, spare = Recorder(), Recorder()
    native_up = RunningApp(bg, anthropic_app(native))
    spare_up = RunningApp(bg, fault_app("ok", spare, text="from the spare"))
    gw = make_gateway(
        upstreams=[upstream_cfg("claude", native_up.url + "/v1", models=["big-model"], apis=["chat", "messages"],
                                pool="main", retries=0),
                   upstream_cfg("spare", spare_up.url + "/v1", models=["big-model"], pool="spare")],
        pools={"main": {"fallback": ["spare"]}}, model_aliases={"claude-*": "big-model"})
    kw = dict(model="claude-sonnet-4-5", max_tokens=16,
              system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
              messages=[{"role": "user", "content": "Capital of France?"}])
    raw = client(gw).messages.with_raw_response.create(**kw)
    assert raw.headers["x-tierlane-upstream"] == "claude" and "x-tierlane-dropped" not in raw.headers
    assert native.bodies[-1]["system"][0]["cache_control"] == {"type": "ephemeral"}  # the marks reached it
    native_up.stop()  # the native member goes away: the fallback answers, translated
    raw = client(gw).messages.with_raw_response.create(**kw)
    assert raw.headers["x-tierlane-upstream"] == "spare" and "cache_control" in raw.headers["x-tierlane-dropped"]
    assert spare.bodies[-1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert raw.parse().content[0].text == "from the spare"
    spare_up.stop()
