"""Valid inputs the front doors once refused or lost: Messages documents, search results, container
uploads and server-tool history; Responses `allowed_tools` choices and `local_shell` items."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from gateway import protocol
from gateway.apis import messages_wire as mw
from gateway.apis import responses_wire as rw
from gateway.apis.field_policy import DROPPED_HEADER, Dropped
from gateway.apis.responses import ResponsesEncoder, Turn
from gateway.context import Principal, RequestContext, Usage
from gateway.errors import InvalidRequest


def messages(turns: list[dict[str, Any]], **policy: Any) -> tuple[dict[str, Any], list[str]]:
    body = {"model": "m", "max_tokens": 8, "messages": turns}
    return mw.to_chat(protocol.check(mw.MessagesRequest, body), body, Dropped(**policy))


def responses(body: dict[str, Any], **policy: Any) -> tuple[dict[str, Any], list[str], Any]:
    req = protocol.check(rw.ResponsesRequest, body)
    return rw.translate(req, body, rw.input_items(req), Dropped(**policy))


PDF = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}}
SEARCH = {"type": "search_result", "source": "https://docs.example/a", "title": "A page",
          "content": [{"type": "text", "text": "First."}, {"type": "text", "text": "Second."}],
          "citations": {"enabled": True}}
SERVER_TURN = [
    {"type": "text", "text": "Let me search."},
    {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "tierlane"}},
    {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1",
     "content": [{"type": "web_search_result", "url": "https://x", "title": "X", "encrypted_content": "e"}]},
    {"type": "text", "text": "Found it."},
]


# Messages --------------------------------------------------------------------------------------


def test_text_documents_and_search_results_pass_as_text():
    chat, dropped = messages([{"role": "user", "content": [
        {"type": "document", "title": "Notes", "context": "c", "citations": {"enabled": True},
         "source": {"type": "text", "media_type": "text/plain", "data": "Line one."}},
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Part."}]}},
        SEARCH,
        {"type": "text", "text": "Summarise."},
    ]}])
    assert chat["messages"] == [{"role": "user", "content": "Notes\nLine one.\nPart.\nA page\nhttps://docs.example/a\n"
                                                            "First.\nSecond.\nSummarise."}]
    assert dropped == []


def test_search_results_in_a_tool_result_are_its_text():
    chat, _ = messages([
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "search", "input": {"q": "a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [SEARCH]}]},
    ])
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "t1",
                                   "content": "A page\nhttps://docs.example/a\nFirst.\nSecond."}


@pytest.mark.parametrize("source", [PDF["source"], {"type": "url", "url": "https://x/a.pdf"}])
def test_a_document_a_chat_model_cannot_read_is_dropped_and_named_or_refused(source):
    turn = [{"role": "user", "content": [{"type": "document", "source": source}, {"type": "text", "text": "Read it."}]}]
    chat, dropped = messages(turn)
    assert chat["messages"] == [{"role": "user", "content": "Read it."}]
    assert dropped == ["messages.content.document"]
    with pytest.raises(InvalidRequest) as err:
        messages(turn, unknown_fields="reject")
    assert err.value.param == "messages[0].content[0]" and "document" in err.value.message


def test_a_container_upload_goes_by_the_hosted_tools_policy():
    turn = [{"role": "user", "content": [{"type": "container_upload", "file_id": "file_1"},
                                         {"type": "text", "text": "Analyse the file."}]}]
    chat, dropped = messages(turn)
    assert chat["messages"] == [{"role": "user", "content": "Analyse the file."}]
    assert dropped == ["messages.content.container_upload"]
    with pytest.raises(InvalidRequest) as err:
        messages(turn, hosted_tools="reject")
    assert err.value.param == "messages[0].content[0].type" and err.value.code == "unsupported_tool"


def test_server_tool_history_is_dropped_and_named_keeping_the_rest_of_the_turn():
    turns = [{"role": "user", "content": "Search."}, {"role": "assistant", "content": SERVER_TURN},
             {"role": "user", "content": [{"type": "code_execution_tool_result", "tool_use_id": "srvtoolu_2",
                                           "content": {"type": "code_execution_result", "stdout": "1"}},
                                          {"type": "text", "text": "Thanks."}]}]
    chat, dropped = messages(turns)
    assert chat["messages"] == [{"role": "user", "content": "Search."},
                                {"role": "assistant", "content": "Let me search.Found it."},
                                {"role": "user", "content": "Thanks."}]
    assert dropped == ["messages.content.server_tool_use", "messages.content.web_search_tool_result",
                       "messages.content.code_execution_tool_result"]
    with pytest.raises(InvalidRequest) as err:
        messages(turns, hosted_tools="reject")
    assert err.value.param == "messages[1].content[1].type" and err.value.code == "unsupported_tool"


def test_a_turn_left_empty_by_dropping_leaves_no_empty_message_and_roles_alternate():
    chat, dropped = messages([
        {"role": "user", "content": "Search."},
        {"role": "assistant", "content": SERVER_TURN[1:3]},  # nothing but the provider's own tool
        {"role": "user", "content": [{"type": "text", "text": "And?"}]},
        {"role": "assistant", "content": "Nothing."},
        {"role": "user", "content": [PDF]},  # nothing a chat model can read
        {"role": "assistant", "content": "Still nothing."},
        {"role": "user", "content": "Bye."},
    ])
    assert chat["messages"] == [{"role": "user", "content": "Search.\nAnd?"},
                                {"role": "assistant", "content": "Nothing.\nStill nothing."},
                                {"role": "user", "content": "Bye."}]
    assert set(dropped) == {"messages.content.server_tool_use", "messages.content.web_search_tool_result",
                            "messages.content.document"}
    with pytest.raises(InvalidRequest) as err:  # nothing at all is left: a 400, not an empty chat request
        messages([{"role": "user", "content": [PDF]}])
    assert err.value.param == "messages"


# Responses -------------------------------------------------------------------------------------

def fn(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_an_allowed_tools_choice_sends_only_the_allowed_tools(mode):
    choice = {"type": "allowed_tools", "mode": mode,
              "tools": [{"type": "function", "name": "read"}, {"type": "function", "name": "grep"},
                        {"type": "web_search"}]}
    body, _, _ = responses({"model": "m", "input": "Hi.", "tool_choice": choice,
                            "tools": [fn("read"), fn("write"), fn("grep"), {"type": "web_search"}]})
    assert [t["function"]["name"] for t in body["tools"]] == ["read", "grep"]
    assert body["tool_choice"] == mode
    req = protocol.check(rw.ResponsesRequest, {"model": "m", "input": "Hi.", "tool_choice": choice})
    assert rw.envelope(req, "resp_1", 1, "m")["tool_choice"] == choice  # echoed as the client sent it


def test_an_allowed_tools_choice_of_no_offered_tool_sends_no_tools():
    body, _, _ = responses({"model": "m", "input": "Hi.", "tools": [fn("read")],
                            "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "file_search"}]}})
    assert "tools" not in body and "tool_choice" not in body


LS_CALL = {"type": "local_shell_call", "id": "lsh_1", "call_id": "call_1", "status": "completed",
           "action": {"type": "exec", "command": ["ls", "-la"], "workdir": "/w", "timeout_ms": 1000, "env": {}}}
LS_OUTPUT = {"type": "local_shell_call_output", "id": "call_1", "output": "total 0\n"}


def test_local_shell_history_becomes_a_call_and_its_result():
    body, dropped, _ = responses({"model": "m", "input": [
        {"role": "user", "content": "List the files."}, LS_CALL, LS_OUTPUT]})
    assert body["messages"] == [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "local_shell", "arguments": '{"command":["ls","-la"],"workdir":"/w","timeout_ms":1000,"env":{}}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "total 0\n"},
    ]
    assert dropped == []
    # only the call and its output (the rest of the conversation stored): still a request
    body, _, _ = responses({"model": "m", "input": [LS_CALL, {**LS_OUTPUT, "call_id": "call_1"}]})
    assert [m["role"] for m in body["messages"]] == ["assistant", "tool"]


def test_the_local_shell_tool_is_a_function_whose_calls_come_back_as_local_shell_call_items():
    body, dropped, tools = responses({"model": "m", "input": "List the files.", "tools": [{"type": "local_shell"}]})
    [tool] = body["tools"]
    assert tool["function"]["name"] == "local_shell" and dropped == []
    assert set(tool["function"]["parameters"]["properties"]) == {"command", "workdir", "timeout_ms", "env"}
    item = tools.call_item("fc_1", "call_9", "local_shell", '{"command":["ls"],"workdir":"/w"}', "completed")
    assert item == {"id": "fc_1", "type": "local_shell_call", "status": "completed", "call_id": "call_9",
                    "action": {"type": "exec", "command": ["ls"], "workdir": "/w"}}


def test_a_local_shell_call_streams_as_one_local_shell_call_item():
    req = protocol.check(rw.ResponsesRequest, {"model": "m", "input": "Hi.", "store": False,
                                               "tools": [{"type": "local_shell"}]})
    _, _, tools = rw.translate(req, {}, rw.input_items(req))
    turn = Turn(req=req, id="resp_1", created_at=1, tenant="t", inputs=[], store=None, model="m", tools=tools)
    ctx = RequestContext(request_id="r", operation="chat", body={}, headers={}, model="auto", client_model="m",
                         principal=Principal(tenant="t", app="a", key_id="k"), usage=Usage(input_tokens=3, output_tokens=2))
    encoder = ResponsesEncoder(ctx, turn)
    arguments = '{"command":["pwd"]}'
    chunks = [{"model": "u", "choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "id": "call_7", "function": {"name": "local_shell", "arguments": arguments[:5]}}]}}]},
              {"model": "u", "choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "function": {"arguments": arguments[5:]}}]}, "finish_reason": "tool_calls"}]}]
    whole = {"model": "u", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_7", "function": {"name": "local_shell", "arguments": arguments}}]}}]}
    raw = b"".join(encoder.chunk(c) for c in chunks) + asyncio.run(encoder.end(whole))
    events = [orjson.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.split(b"\n\n") if block]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.output_item.done", "response.completed"]
    done = {"id": "fc_1_0", "type": "local_shell_call", "status": "completed", "call_id": "call_7",
            "action": {"type": "exec", "command": ["pwd"]}}
    assert events[3]["item"] == done and events[-1]["response"]["output"] == [done]


# Through a gateway -----------------------------------------------------------------------------


def test_through_the_gateway_dropped_blocks_are_named_and_allowed_tools_taken(ok_gateway):
    r = httpx.post(ok_gateway.url + "/v1/messages", json={
        "model": "fake-model", "max_tokens": 8,
        "messages": [{"role": "user", "content": [PDF, {"type": "text", "text": "Hi."}]},
                     {"role": "assistant", "content": SERVER_TURN}, {"role": "user", "content": "More."}]})
    assert r.status_code == 200, r.text
    assert r.headers[DROPPED_HEADER] == ("messages.content.document,messages.content.server_tool_use,"
                                         "messages.content.web_search_tool_result")
    sent = ok_gateway.rec.bodies[-1]
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]
    r = httpx.post(ok_gateway.url + "/v1/responses", json={
        "model": "fake-model", "store": False, "input": [{"role": "user", "content": "Go."}, LS_CALL, LS_OUTPUT],
        "tools": [fn("read"), fn("write"), {"type": "local_shell"}],
        "tool_choice": {"type": "allowed_tools", "mode": "required",
                        "tools": [{"type": "function", "name": "read"}, {"type": "local_shell"}]}})
    assert r.status_code == 200, r.text
    sent = ok_gateway.rec.bodies[-1]
    assert [t["function"]["name"] for t in sent["tools"]] == ["read", "local_shell"]
    assert sent["tool_choice"] == "required" and [m["role"] for m in sent["messages"]] == ["user", "assistant", "tool"]
