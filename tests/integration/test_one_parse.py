"""One parse per body: a request's bytes are decoded once, validated once, and forwarded as they came
where no stage changed them.

Through a gateway in this process (the shipped trim policy on), to an upstream that keeps the bytes
it was sent: `orjson.loads` is counted on the client's body, and the validations (`protocol.check`)
by model. A chat body the trim leaves alone reaches the upstream as the client's own bytes; a
Messages body is validated as Messages once, and its translation as chat without its messages
validated again; a Messages body sent natively, its model unmapped, is the client's bytes upstream.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway import protocol
from gateway.apis import messages_wire
from gateway.errors import InvalidRequest
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg

MODEL = "up-model"
CHAT_ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}
MESSAGE_ANSWER = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
                  "content": [{"type": "text", "text": "done"}], "stop_reason": "end_turn", "stop_sequence": None,
                  "usage": {"input_tokens": 10, "output_tokens": 1}}
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{\"path\":\"a.py\"}"}}
# an agent's turn: a system prompt, a tool call and its result, the newest user message; nothing the
# shipped (lossless) passes rewrite
CHAT_BODY = {"model": MODEL, "messages": [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Read a.py"},
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "def f():\n    return 1\n" * 50},
    {"role": "user", "content": "Now explain it."}],
    "tools": [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}],
    "max_tokens": 64, "temperature": 0}
MESSAGES_BODY = {"model": MODEL, "max_tokens": 64, "system": [{"type": "text", "text": "You are a coding agent."}],
                 "messages": [{"role": "user", "content": "Read a.py"},
                              {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read",
                                                                 "input": {"path": "a.py"}}]},
                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                            "content": "def f():\n    return 1\n"},
                                                           {"type": "text", "text": "Now explain it."}]}],
                 "tools": [{"name": "read", "input_schema": {"type": "object"}}]}


class Upstream:
    """Chat and Messages answers; keeps each request's path and the bytes it came with."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/messages", self._answer)
        return app

    async def _answer(self, request: web.Request) -> web.Response:
        self.sent.append((request.path, await request.read()))
        return web.json_response(MESSAGE_ANSWER if request.path.endswith("/messages") else CHAT_ANSWER)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """`orjson.loads` calls by the bytes they decoded, and `protocol.check` calls by model name."""
    loads, check = orjson.loads, protocol.check
    seen: dict[str, Any] = {"loads": Counter(), "checks": []}

    def counting_loads(data: Any) -> Any:
        seen["loads"][bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) else str(data).encode()] += 1
        return loads(data)

    def counting_check(model_type: Any, body: Any) -> Any:
        seen["checks"].append(model_type.__name__)
        return check(model_type, body)

    monkeypatch.setattr(orjson, "loads", counting_loads)
    monkeypatch.setattr(protocol, "check", counting_check)
    return seen


def _gateway(bg: BackgroundLoop, make_gateway: Any, upstream: Upstream, **member: Any) -> tuple[RunningApp, RunningApp]:
    up = RunningApp(bg, upstream.app())
    shipped = copy.deepcopy(PASS_THROUGH)
    del shipped["policy"]["trim"]  # the shipped trim policy
    gw = make_gateway(base=shipped, upstreams=[upstream_cfg("up", up.url + "/v1", models=[MODEL], **member)])
    return gw, up


def _post(bg: BackgroundLoop, url: str, body: bytes, **headers: str) -> tuple[int, bytes]:
    import aiohttp

    async def go() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as client:
            async with client.post(url, data=body, headers={"Content-Type": "application/json",
                                                             "Authorization": "Bearer t", **headers}) as resp:
                return resp.status, await resp.read()

    return bg.call(go())


def test_a_chat_body_no_stage_changes_is_parsed_once_and_forwarded_as_its_bytes(bg, make_gateway, counted):
    upstream = Upstream()
    gw, up = _gateway(bg, make_gateway, upstream)
    try:
        raw = orjson.dumps(CHAT_BODY)
        status, answer = _post(bg, gw.url + "/v1/chat/completions", raw)
        assert status == 200, answer
        assert counted["loads"][raw] == 1  # one parse of the client's bytes
        assert counted["checks"] == ["ChatCompletionRequest"]  # one validation
        assert upstream.sent == [("/v1/chat/completions", raw)]  # the trim changed nothing: the client's bytes
    finally:
        up.stop()


def test_a_messages_body_is_parsed_and_validated_once(bg, make_gateway, counted, monkeypatch):
    made: list[dict[str, Any]] = []
    to_chat = messages_wire.to_chat

    def keeping(*args: Any, **kwargs: Any) -> Any:
        body, dropped = to_chat(*args, **kwargs)
        made.append(body)
        return body, dropped

    from gateway.apis import messages

    monkeypatch.setattr(messages, "to_chat", keeping)
    upstream = Upstream()
    gw, up = _gateway(bg, make_gateway, upstream)
    try:
        raw = orjson.dumps(MESSAGES_BODY)
        status, answer = _post(bg, gw.url + "/v1/messages", raw, **{"anthropic-version": "2023-06-01"})
        assert status == 200, answer
        assert counted["loads"][raw] == 1
        # the Messages request validated once; its chat translation's parameters only, not its messages
        assert counted["checks"] == ["MessagesRequest", "TranslatedChatRequest"]
        (path, sent), = upstream.sent
        # the translation is what goes (no stage changed it), serialised once
        assert path == "/v1/chat/completions" and sent == orjson.dumps(made[0])
    finally:
        up.stop()


def test_a_messages_body_sent_natively_is_the_clients_bytes(bg, make_gateway, counted):
    upstream = Upstream()
    gw, up = _gateway(bg, make_gateway, upstream, apis=["chat", "messages"])
    try:
        raw = orjson.dumps(MESSAGES_BODY)
        status, answer = _post(bg, gw.url + "/v1/messages", raw, **{"anthropic-version": "2023-06-01"})
        assert status == 200, answer
        assert counted["loads"][raw] == 1
        assert upstream.sent == [("/v1/messages", raw)]
    finally:
        up.stop()


def test_translated_chat_validates_the_parameters_not_the_messages():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 3}
    with pytest.raises(InvalidRequest, match="temperature"):
        protocol.validate("chat", body, max_n=1, translated=True)
    ok = {**body, "temperature": 0.5}
    wire = protocol.validate("chat", ok, max_n=1, translated=True)
    assert isinstance(wire, protocol.ChatCompletionRequest) and wire.messages == ok["messages"]
    assert wire.messages[0] is ok["messages"][0]  # the translation's own dict, not a model made of it
    with pytest.raises(InvalidRequest, match="messages"):
        protocol.validate("chat", {**ok, "messages": []}, max_n=1, translated=True)


def test_a_stored_responses_body_is_not_serialised_again_for_its_size(bg, make_gateway, counted, monkeypatch):
    """The response store's reservation takes the body's size as read, not the size of it serialised again."""
    dumps = orjson.dumps
    made: Counter[bytes] = Counter()

    def counting_dumps(*args: Any, **kwargs: Any) -> bytes:
        out = dumps(*args, **kwargs)
        made[out] += 1
        return out

    monkeypatch.setattr(orjson, "dumps", counting_dumps)
    upstream = Upstream()
    gw, up = _gateway(bg, make_gateway, upstream)
    try:
        raw = dumps({"model": MODEL, "input": "Explain a.py " * 200, "store": True, "max_output_tokens": 16})
        status, answer = _post(bg, gw.url + "/v1/responses", raw)
        assert status == 200, answer
        assert counted["loads"][raw] == 1 and made[raw] == 0
        assert counted["checks"] == ["ResponsesRequest", "TranslatedChatRequest"]
    finally:
        up.stop()
