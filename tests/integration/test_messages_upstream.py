"""Chat and Responses clients on a member that serves only the Messages API (`apis: [messages]`).

The gateway sends their requests as Messages requests with the prompt-cache breakpoints placed,
reads the answers back into each client's API (JSON and stream), and meters the provider's
cache reads and writes.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.upstream.to_messages import marked
from tests.support.anthropic_upstream import TEXT, TOOL_INPUT, TOOL_USE_ID, anthropic_app
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app

pytestmark = pytest.mark.slow

USAGE = {"input_tokens": 11, "output_tokens": 5, "cache_read_input_tokens": 400, "cache_creation_input_tokens": 70}
TOOL = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MARK = {"type": "ephemeral"}


@pytest.fixture
def claude(bg, make_gateway):
    rec = Recorder()
    up = RunningApp(bg, anthropic_app(rec, usage=USAGE, call_tools=True))
    gw = make_gateway(upstreams=[upstream_cfg("claude", up.url + "/v1", models=["claude-x"], apis=["messages"],
                                              api_key="upstream-secret")],
                      telemetry={"metering": True})
    gw.rec = rec  # type: ignore[attr-defined]
    yield gw
    up.stop()


def sdk(gw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)


def ledger(tmp_path: Path, gw: Any) -> list[tuple[Any, ...]]:
    httpx.get(gw.url + "/v1/usage", timeout=30)  # flushes the ledger
    conn = sqlite3.connect(tmp_path / "state" / "ledger.sqlite3")
    try:
        return conn.execute("SELECT api, stream, input_tokens, output_tokens, cached_input_tokens, cache_write_tokens "
                            "FROM requests ORDER BY id").fetchall()
    finally:
        conn.close()


def test_chat_client_json_and_stream_with_breakpoints_and_cache_usage(claude, tmp_path):
    client = sdk(claude)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Capital of France?"}]
    whole = client.chat.completions.create(model="claude-x", messages=messages, temperature=0)
    assert whole.choices[0].message.content == TEXT and whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.prompt_tokens == 11 + 400 + 70 and whole.usage.completion_tokens == 5
    assert whole.usage.prompt_tokens_details is not None and whole.usage.prompt_tokens_details.cached_tokens == 400
    rec = claude.rec
    sent, headers = rec.bodies[-1], rec.headers[-1]
    assert headers["x-api-key"] == "upstream-secret" and headers["anthropic-version"] == "2023-06-01"
    assert "Authorization" not in headers  # Anthropic reads a Bearer token as OAuth and refuses an API key there
    assert sent == {"model": "claude-x", "max_tokens": 4096,
                    "system": [{"type": "text", "text": "Be brief.", "cache_control": MARK}],
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "Capital of France?",
                                                               "cache_control": MARK}]}],
                    "temperature": 0}
    stream = client.chat.completions.create(model="claude-x", messages=messages, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 481
    assert rec.bodies[-1]["stream"] is True and marked(rec.bodies[-1]) == ["system[0]", "messages[0][0]"]
    quiet = list(client.chat.completions.create(model="claude-x", messages=messages, stream=True))
    assert all(c.usage is None for c in quiet) and "".join(c.choices[0].delta.content or "" for c in quiet) == TEXT
    assert ledger(tmp_path, claude) == [("chat", 0, 481, 5, 400, 70), ("chat", 1, 481, 5, 400, 70),
                                        ("chat", 1, 481, 5, 400, 70)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_tool_round_trip(claude, stream):
    client = sdk(claude)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    kw: dict[str, Any] = dict(model="claude-x", tools=[TOOL], parallel_tool_calls=False, max_tokens=64)
    if stream:
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))  # type: ignore[call-overload]
        calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
        assert calls[0].id == TOOL_USE_ID and calls[0].function.name == "weather"
        assert orjson.loads("".join(c.function.arguments or "" for c in calls)) == TOOL_INPUT
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
        call_id, arguments = calls[0].id, "".join(c.function.arguments or "" for c in calls)
    else:
        first = client.chat.completions.create(messages=messages, **kw)  # type: ignore[call-overload]
        assert first.choices[0].finish_reason == "tool_calls"
        (call,) = first.choices[0].message.tool_calls
        assert call.id == TOOL_USE_ID and orjson.loads(call.function.arguments) == TOOL_INPUT
        call_id, arguments = call.id, call.function.arguments
    sent = claude.rec.bodies[-1]
    assert sent["tools"] == [{"name": "weather", "description": "The weather in a city.",
                              "input_schema": TOOL["function"]["parameters"], "cache_control": MARK}]
    assert sent["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True} and sent["max_tokens"] == 64
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call_id, "type": "function", "function": {"name": "weather", "arguments": arguments}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
    second = client.chat.completions.create(messages=messages, **kw)  # type: ignore[call-overload]
    assert second.choices[0].message.content == TEXT
    turn = claude.rec.bodies[-1]
    assert turn["messages"][1] == {"role": "assistant", "content": [
        {"type": "tool_use", "id": TOOL_USE_ID, "name": "weather", "input": TOOL_INPUT}]}
    assert turn["messages"][2] == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": TOOL_USE_ID, "content": "sunny", "cache_control": MARK}]}
    # the last tool, the conversation's end, and where the previous request ended (its cached prefix)
    assert marked(turn) == ["tools[0]", "messages[0][0]", "messages[2][0]"]
    # a call cut off by max_tokens (no JSON object) does not make every later turn a 400
    messages[1]["tool_calls"][0]["function"]["arguments"] = '{"city": '
    messages[2]["content"] = "error: the arguments are not JSON"
    cut = client.chat.completions.create(messages=messages, **kw)  # type: ignore[call-overload]
    assert cut.choices[0].message.content == TEXT
    note, use = claude.rec.bodies[-1]["messages"][1]["content"]
    assert use == {"type": "tool_use", "id": TOOL_USE_ID, "name": "weather", "input": {}}
    assert note["type"] == "text" and note["text"].endswith('The arguments as written: {"city": ]')
    with pytest.raises(openai.BadRequestError) as many:
        client.chat.completions.create(messages=messages[:1], n=2, **kw)  # type: ignore[call-overload]
    assert many.value.body["param"] == "n"  # type: ignore[index]


def test_responses_client_json_and_stream(claude, tmp_path):
    client = sdk(claude)
    kw: dict[str, Any] = dict(model="claude-x", instructions="Be brief.", input="Capital of France?", store=False)
    whole = client.responses.create(**kw)
    assert whole.output_text == TEXT and whole.status == "completed"
    assert whole.usage is not None and whole.usage.input_tokens == 481 and whole.usage.input_tokens_details.cached_tokens == 400
    sent = claude.rec.bodies[-1]
    assert sent["system"] == [{"type": "text", "text": "Be brief.", "cache_control": MARK}]
    with client.responses.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == TEXT and final.usage is not None and final.usage.output_tokens == 5
    assert claude.rec.bodies[-1]["stream"] is True and marked(claude.rec.bodies[-1]) == ["system[0]", "messages[0][0]"]
    tools = [{"type": "function", "name": "weather", "parameters": TOOL["function"]["parameters"]}]
    called = client.responses.create(**{**kw, "tools": tools})
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "weather" and orjson.loads(call.arguments) == TOOL_INPUT
    rows = ledger(tmp_path, claude)
    assert [row[0] for row in rows] == ["responses"] * 3 and all(row[2:] == (481, 5, 400, 70) for row in rows)


def test_a_chat_fallback_still_gets_chat(bg, make_gateway):
    rec, spare = Recorder(), Recorder()
    up = RunningApp(bg, anthropic_app(rec, usage=USAGE))
    spare_up = RunningApp(bg, fault_app("ok", spare, text="from the spare"))
    gw = make_gateway(upstreams=[upstream_cfg("claude", up.url + "/v1", models=["m"], apis=["messages"], pool="main",
                                              retries=0),
                                 upstream_cfg("spare", spare_up.url + "/v1", models=["m"], pool="spare")],
                      pools={"main": {"fallback": ["spare"]}})
    question = [{"role": "user", "content": "Capital of France?"}]
    raw = sdk(gw).chat.completions.with_raw_response.create(model="m", messages=question)
    assert raw.headers["x-tierlane-upstream"] == "claude" and raw.parse().choices[0].message.content == TEXT
    up.stop()
    raw = sdk(gw).chat.completions.with_raw_response.create(model="m", messages=question)
    assert raw.headers["x-tierlane-upstream"] == "spare" and raw.parse().choices[0].message.content == "from the spare"
    assert spare.bodies[-1]["messages"] == question and "max_tokens" not in spare.bodies[-1]
    spare_up.stop()


def overloaded_with_spare(bg: Any, make_gateway: Any, **fail: Any) -> tuple[Any, Recorder, Recorder, list[RunningApp]]:
    """A Messages member failing as `fail` says (anthropic_app's options), a chat spare pool behind it."""
    rec, spare = Recorder(), Recorder()
    ups = [RunningApp(bg, anthropic_app(rec, usage=USAGE, **fail)), RunningApp(bg, fault_app("ok", spare, text="spare"))]
    gw = make_gateway(upstreams=[upstream_cfg("claude", ups[0].url + "/v1", models=["m"], apis=["messages"], pool="main",
                                              retries=1, breaker_failures=2, breaker_cooldown_s=3600),
                                 upstream_cfg("spare", ups[1].url + "/v1", models=["m"], pool="spare")],
                      pools={"main": {"fallback": ["spare"]}})
    return gw, rec, spare, ups


QUESTION = [{"role": "user", "content": "Capital of France?"}]


@pytest.mark.parametrize("status", [529, 500])
def test_an_overload_or_api_error_is_retried_then_falls_back_and_opens_the_breaker(bg, make_gateway, status):
    gw, rec, spare, ups = overloaded_with_spare(bg, make_gateway, fail="status", status=status)
    try:
        for _ in range(3):
            raw = sdk(gw).chat.completions.with_raw_response.create(model="m", messages=QUESTION)
            assert raw.headers["x-tierlane-upstream"] == "spare" and raw.parse().choices[0].message.content == "spare"
        # asked twice for the first request (its retry), then its breaker (2 failures) is open
        assert rec.hits == 2 and spare.hits == 3
    finally:
        for up in ups:
            up.stop()


def test_an_overloads_long_retry_after_moves_on_at_once(bg, make_gateway):
    gw, rec, spare, ups = overloaded_with_spare(bg, make_gateway, fail="status", retry_after="3600")
    try:
        raw = sdk(gw).chat.completions.with_raw_response.create(model="m", messages=QUESTION)
        assert raw.headers["x-tierlane-upstream"] == "spare" and rec.hits == 1  # not waited for, not retried
    finally:
        for up in ups:
            up.stop()


def test_an_overload_event_before_any_content_falls_back_instead_of_a_200_that_fails(bg, make_gateway):
    gw, rec, spare, ups = overloaded_with_spare(bg, make_gateway, fail="before_content")
    try:
        for _ in range(3):
            with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=30,
                              json={"model": "m", "messages": QUESTION, "stream": True}) as r:
                assert r.status_code == 200 and r.headers["x-tierlane-upstream"] == "spare"
                events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        assert rec.hits == 2 and spare.hits == 3  # the breaker counted both failed tries
        # with no spare to take it, the client hears the overload as a status, not as a 200 stream
        alone = RunningApp(bg, anthropic_app(Recorder(), fail="before_content"))
        ups.append(alone)
        only = make_gateway(upstreams=[upstream_cfg("claude", alone.url + "/v1", models=["m"], apis=["messages"])])
        r = httpx.post(only.url + "/v1/chat/completions", json={"model": "m", "messages": QUESTION, "stream": True},
                       timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"
        assert "injected 529" in r.json()["error"]["message"]
    finally:
        for up in ups:
            up.stop()


def test_an_overload_after_content_ends_the_stream_with_an_error(bg, make_gateway, tmp_path):
    rec = Recorder()
    up = RunningApp(bg, anthropic_app(rec, usage=USAGE, fail="after_content"))
    gw = make_gateway(upstreams=[upstream_cfg("claude", up.url + "/v1", models=["m"], apis=["messages"])],
                      telemetry={"metering": True})
    try:
        with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=30,
                          json={"model": "m", "messages": QUESTION, "stream": True}) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert '"Paris "' in events[1] and "injected 529" in orjson.loads(events[-1])["error"]["message"]
        assert rec.hits == 1
        assert ledger(tmp_path, gw)[0][2] == 481  # its input billed, as message_start reported it
    finally:
        up.stop()


def test_translated_requests_carry_no_client_anthropic_header_native_ones_do(claude):
    beta = {"anthropic-beta": "context-1m-2025-08-07", "anthropic-version": "2099-01-01"}
    sdk(claude).chat.completions.create(model="claude-x", messages=QUESTION, extra_headers=beta)
    sent = {k.lower(): v for k, v in claude.rec.headers[-1].items()}
    assert "anthropic-beta" not in sent and sent["anthropic-version"] == "2023-06-01"
    native = httpx.post(claude.url + "/v1/messages", headers=beta, timeout=30,
                        json={"model": "claude-x", "max_tokens": 16, "messages": QUESTION})
    assert native.status_code == 200
    sent = {k.lower(): v for k, v in claude.rec.headers[-1].items()}
    assert sent["anthropic-beta"] == beta["anthropic-beta"] and sent["anthropic-version"] == "2099-01-01"


def test_a_request_with_nothing_to_answer_is_a_400_in_the_clients_shape(claude):
    hits = claude.rec.hits
    with pytest.raises(openai.BadRequestError) as bad:
        sdk(claude).chat.completions.create(model="claude-x", messages=[{"role": "system", "content": "Be brief."}])
    assert bad.value.body["param"] == "messages" and claude.rec.hits == hits  # type: ignore[index]
