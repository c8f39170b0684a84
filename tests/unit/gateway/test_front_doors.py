"""The front doors' translations, stream encoders, response store and model aliases, on their own."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest

from gateway import protocol
from gateway.apis import messages as msgs
from gateway.apis import messages_wire as mw
from gateway.apis import response_store
from gateway.apis import responses_wire as rw
from gateway.apis.field_policy import Dropped
from gateway.apis.response_store import SqliteResponseStore
from gateway.apis.responses import ResponsesEncoder, Turn
from gateway.context import Principal, RequestContext, Usage
from gateway.errors import InvalidRequest
from gateway.pipeline.resolve import ModelCatalog
from gateway.settings import Settings
from gateway.upstream.pool import UpstreamPool
from tests.support.config import PASS_THROUGH, upstream_cfg


def messages_chat(body: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    return mw.to_chat(protocol.check(mw.MessagesRequest, body), body)


def responses_chat(body: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    req = protocol.check(rw.ResponsesRequest, body)
    return rw.to_chat(req, body, rw.input_items(req))


def test_a_messages_request_becomes_the_equivalent_chat_body():
    body, dropped = messages_chat({
        "model": "m", "max_tokens": 16, "temperature": 0, "stop_sequences": ["\n\n"], "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi."}]}],
    })
    assert body == {"model": "m", "max_tokens": 16, "temperature": 0, "stop": ["\n\n"], "user": "u",
                    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]}
    assert dropped == ["thinking", "cache_control"]


def test_tool_blocks_become_tool_calls_and_tool_messages():
    body, _ = messages_chat({
        "model": "m", "max_tokens": 8,
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Go."},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "...", "signature": "s"},
                                              {"type": "text", "text": "Calling."},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "2"}],
                                          "is_error": True},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]},
        ],
    })
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["messages"][1] == {"role": "assistant", "content": "Calling.", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}
    assert body["messages"][2] == {"role": "tool", "tool_call_id": "t1", "content": "Error: 2"}
    assert body["messages"][3] == {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}


@pytest.mark.parametrize("change, param, hosted", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", "reject"),
    ({"container": "c1"}, "container", "reject"),
    ({"max_tokens": 0}, "max_tokens", "drop"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]", "drop"),
])
def test_what_a_chat_model_cannot_do_is_a_400_naming_it(change, param, hosted):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi."}], **change}
    with pytest.raises(InvalidRequest) as err:
        mw.to_chat(protocol.check(mw.MessagesRequest, body), body, Dropped(hosted_tools=hosted))
    assert (err.value.param or "").startswith(param), err.value.param


def frames(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            event, data = block.split("\n")
            out.append((event.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return out


def ctx(usage: Usage | None = None) -> RequestContext:
    return RequestContext(request_id="r", operation="chat", body={}, headers={}, model="m",
                          principal=Principal(tenant="t", app="a", key_id="k"), usage=usage)


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


CHUNKS = [
    chunk({"role": "assistant", "content": "Hel"}), chunk({"content": "lo"}),
    chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "tool_calls"),
]
WHOLE = {"model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
    "role": "assistant", "content": "Hello", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a":1}'}}]}}]}


def test_the_messages_stream_has_anthropics_event_sequence():
    encoder = msgs.MessagesEncoder(ctx(Usage(input_tokens=9, output_tokens=4)))
    raw = b"".join(encoder.chunk(c) for c in CHUNKS) + asyncio.run(encoder.end(WHOLE))
    events = frames(raw)
    assert [e for e, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert events[9][1]["delta"]["stop_reason"] == "tool_use"
    assert events[9][1]["usage"]["output_tokens"] == 4 and events[9][1]["usage"]["input_tokens"] == 9
    message = msgs.to_message(ctx(Usage(input_tokens=9, output_tokens=4)), WHOLE, "msg_1")
    assert message["content"] == [{"type": "text", "text": "Hello"},
                                  {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]


def test_the_responses_stream_numbers_every_event_and_ends_with_the_whole_response():
    req = protocol.check(rw.ResponsesRequest, {"model": "m", "input": "Hi.", "store": False})
    turn = Turn(req=req, id="resp_1", created_at=1, tenant="t", inputs=[], store=None)
    encoder = ResponsesEncoder(ctx(Usage(input_tokens=3, output_tokens=2)), turn)
    raw = b"".join(encoder.chunk(c) for c in CHUNKS) + asyncio.run(encoder.end(WHOLE))
    events = frames(raw)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(e == d["type"] for e, d in events)
    assert [e for e, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1][1]["response"]
    assert [item["id"] for item in final["output"]] == [events[2][1]["item"]["id"], events[9][1]["item"]["id"]]
    assert final["output"][1]["arguments"] == '{"a":1}' and final["usage"]["total_tokens"] == 5


def test_responses_items_become_chat_messages():
    body, dropped = responses_chat({
        "model": "m", "instructions": "Be brief.", "temperature": 0, "max_output_tokens": 8,
        "reasoning": {"effort": "low"}, "text": {"format": {"type": "json_object"}},
        "input": [
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"type": "reasoning", "summary": []},
        ],
    })
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Rules."},
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert body["response_format"] == {"type": "json_object"} and body["max_tokens"] == 8 and body["temperature"] == 0
    assert dropped == ["reasoning", "reasoning_items"]


@pytest.mark.parametrize("change, param, hosted", [
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type", "reject"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]", "drop"),
    ({"background": True}, "background", "drop"),
    ({"conversation": "conv_1"}, "conversation", "drop"),
    ({"input": [{"role": "user", "content": "Hi."}, {"type": "web_search_call", "id": "x"}]}, "input[1]", "reject"),
])
def test_what_the_gateway_cannot_run_is_a_400_naming_it(change, param, hosted):
    body = {"model": "m", "input": "Hi.", **change}
    req = protocol.check(rw.ResponsesRequest, body)
    with pytest.raises(InvalidRequest) as err:
        rw.to_chat(req, body, rw.input_items(req), Dropped(hosted_tools=hosted))
    assert (err.value.param or "").startswith(param), err.value.param


class WallClock:
    """The response store's `time`: a wall clock that moves only when the test moves it, so a TTL
    passes exactly when the test says (and never while a slow machine is still between two calls)."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now


def test_the_sqlite_store_scopes_by_tenant_and_expires(tmp_path, monkeypatch):
    clock = WallClock()
    monkeypatch.setattr(response_store, "time", clock)

    async def run() -> None:
        store = SqliteResponseStore(tmp_path / "r.sqlite3", ttl_s=0.2)
        await store.start()
        try:
            await store.put("a", "resp_1", {"response": {"id": "resp_1"}})
            assert await store.get("a", "resp_1") == {"response": {"id": "resp_1"}}
            assert await store.get("b", "resp_1") is None
            assert not await store.delete("b", "resp_1")
            clock.now += 0.3
            assert await store.get("a", "resp_1") is None
            await store.put("a", "resp_2", {"x": 1})
            assert await store.delete("a", "resp_2") and await store.get("a", "resp_2") is None
            store.ttl_s = 60
            # written behind in batches: readable at once, on disk once the store is closed
            await asyncio.gather(*(store.put("a", f"resp_{i}", {"i": i}) for i in range(40)))
            assert await store.get("a", "resp_39") == {"i": 39}
            await store.put("a", "gone", {"x": 1})
            assert await store.delete("a", "gone") and await store.get("a", "gone") is None
        finally:
            await store.close()
        reopened = SqliteResponseStore(tmp_path / "r.sqlite3", ttl_s=60)
        await reopened.start()
        try:
            assert [await reopened.get("a", f"resp_{i}") for i in range(40)] == [{"i": i} for i in range(40)]
            assert await reopened.get("a", "gone") is None
        finally:
            await reopened.close()

    asyncio.run(run())


def test_aliases_exact_then_globs_and_never_over_a_served_name():
    settings = Settings.load(env={}, overrides={**PASS_THROUGH, "upstreams": [
        upstream_cfg("a", "http://127.0.0.1:9/v1", models=["gpt-4o-mini", "big"])]})
    catalog = ModelCatalog(UpstreamPool(settings), "edge", ["local"],
                           {"gpt-4o*": "auto", "claude-*-haiku*": "edge", "claude-*": "big", "claude-x": "gpt-4o-mini"})
    assert catalog.alias("gpt-4o") == "auto"
    assert catalog.alias("gpt-4o-mini") is None  # an upstream serves it by name
    assert catalog.alias("claude-3-5-haiku-latest") == "edge"
    assert catalog.alias("claude-sonnet-4-5") == "big"
    assert catalog.alias("claude-x") == "gpt-4o-mini"
    assert catalog.alias("o3") is None


def test_the_api_and_the_dropped_fields_are_on_the_span_attributes():
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from gateway.apis.common import chat_context
    from gateway.keys import PRINCIPAL, RECEIVED_AT, REQUEST_ID, SETTINGS
    from telemetry.spans import request_attributes

    app = web.Application()
    app[SETTINGS] = Settings.load(env={}, overrides=PASS_THROUGH)
    request = make_mocked_request("POST", "/v1/messages", app=app)
    request[REQUEST_ID], request[RECEIVED_AT] = "r", 0.0
    request[PRINCIPAL] = Principal(tenant="t", app="a", key_id="k")
    body, dropped = messages_chat({"model": "m", "max_tokens": 8, "thinking": {"type": "adaptive"}, "speed": "fast",
                                   "messages": [{"role": "user", "content": "Hi."}]})
    attributes = request_attributes(chat_context(request, body, "messages", dropped))
    assert attributes["tierlane.api"] == "messages"
    assert attributes["tierlane.dropped_fields"] == "speed,thinking"


def test_the_sqlite_store_counts_each_tenants_usage_and_expiry_makes_room(tmp_path, monkeypatch):
    clock = WallClock()
    monkeypatch.setattr(response_store, "time", clock)

    async def run() -> None:
        store = SqliteResponseStore(tmp_path / "r.sqlite3", ttl_s=60)
        await store.start()
        try:
            await store.put("a", "resp_1", {"x": "1" * 100})
            await store.put("a", "resp_2", {"x": "2" * 100})
            await store.put("b", "resp_3", {"x": 3})
            used = await store.usage("a")
            assert used.records == 2 and used.bytes > 200
            assert await store.delete("a", "resp_1") and (await store.usage("a")).records == 1
            assert not await store.delete("a", "resp_1") and (await store.usage("a")).records == 1
        finally:
            await store.close()
        reopened = SqliteResponseStore(tmp_path / "r.sqlite3", ttl_s=60)
        await reopened.start()  # counted again from the file
        try:
            assert (await reopened.usage("a")).records == 1 and (await reopened.usage("b")).records == 1
        finally:
            await reopened.close()
        expiring = SqliteResponseStore(tmp_path / "e.sqlite3", ttl_s=0.05)
        await expiring.start()
        try:
            await expiring.put("a", "resp_1", {"x": 1})
            clock.now += 0.1
            for i in range(300):  # a sweep of expired rows comes every 256 writes and counts again
                await expiring.put("c", f"resp_{i}", {"x": i})
            deadline = time.monotonic() + 60  # written behind: polled until the sweep's count is in
            while (await expiring.usage("a")).records != 0:
                assert time.monotonic() < deadline, await expiring.usage("a")
                await asyncio.sleep(0.01)
        finally:
            await expiring.close()

    asyncio.run(run())
