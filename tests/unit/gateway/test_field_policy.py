"""The front doors' field policy and the tools the client runs, on the agents' own request shapes."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway import protocol
from gateway.apis import messages_wire as mw
from gateway.apis import responses_wire as rw
from gateway.apis.field_policy import Dropped, header_value
from gateway.apis.messages import _session as messages_session
from gateway.apis.responses import ResponsesEncoder, Turn
from gateway.context import Principal, RequestContext, Usage
from gateway.errors import InvalidRequest

APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files. FREEFORM.",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
TOOL_SEARCH = {"type": "tool_search", "execution": "client", "description": "Find tools.",
               "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}


def messages(body: dict[str, Any], **policy: Any) -> tuple[dict[str, Any], list[str]]:
    return mw.to_chat(protocol.check(mw.MessagesRequest, body), body, Dropped(**policy))


def responses(body: dict[str, Any], **policy: Any) -> tuple[dict[str, Any], list[str], Any]:
    req = protocol.check(rw.ResponsesRequest, body)
    return rw.translate(req, body, rw.input_items(req), Dropped(**policy))


# Messages --------------------------------------------------------------------------------------


def test_claude_codes_first_request_is_taken_with_its_system_entries_in_place():
    body, dropped = messages({
        "model": "claude-opus-5-5", "max_tokens": 128000, "stream": True,
        "system": [{"type": "text", "text": "You are an agent."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<reminder>ctx</reminder>"},
                                         {"type": "text", "text": "read notes.txt", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /w"}]},
        ],
        "tools": [{"name": "Read", "input_schema": {"type": "object"}},
                  {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True}],
        "metadata": {"user_id": '{"device_id":"d","session_id":"s-1"}'},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
    })
    assert body["messages"] == [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "<reminder>ctx</reminder>\nread notes.txt"},  # text-only: one string
        {"role": "system", "content": "# Environment\ncwd: /w"},
    ]
    assert [t["function"]["name"] for t in body["tools"]] == ["Read", "Later"]
    assert set(dropped) == {"thinking", "context_management", "output_config.effort", "tools.defer_loading",
                            "cache_control"}


def test_messages_session_is_claude_codes_session_id_or_the_user_id():
    def session(user_id: str) -> str | None:
        return messages_session(protocol.check(mw.MessagesRequest, {
            "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "metadata": {"user_id": user_id}}))

    assert session('{"device_id":"d","session_id":"abc"}') == "abc"
    assert session("user-7") == "user-7"
    assert session("{not json") == "{not json"


def test_unknown_fields_are_dropped_and_named_or_refused_under_reject():
    body = {"model": "m", "max_tokens": 8, "brand_new_field": {"x": 1},
            "messages": [{"role": "user", "content": "Hi.", "turn_hint": 1}],
            "metadata": {"user_id": "u", "tier": "gold"}}
    chat, dropped = messages(body)
    assert chat["messages"] == [{"role": "user", "content": "Hi."}]
    assert set(dropped) == {"brand_new_field", "messages.turn_hint", "metadata.tier"}
    with pytest.raises(InvalidRequest) as err:
        messages(body, unknown_fields="reject")
    assert err.value.param == "brand_new_field" and err.value.code == "unknown_parameter"
    # types of known fields stay strict whatever the policy
    with pytest.raises(InvalidRequest) as err:
        messages({**body, "max_tokens": "8"})
    assert err.value.param == "max_tokens"


def test_server_tools_and_mcp_servers_are_dropped_by_default():
    chat, dropped = messages({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi."}],
                              "tools": [{"type": "web_search_20250305", "name": "web_search"},
                                        {"name": "f", "input_schema": {"type": "object"}}],
                              "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}], "container": "c1"})
    assert [t["function"]["name"] for t in chat["tools"]] == ["f"]
    assert set(dropped) == {"tools.web_search_20250305", "mcp_servers", "container"}


def test_an_assistant_turn_of_tool_calls_only_has_string_content():
    chat, _ = messages({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a"},
                                                                                             {"type": "text", "text": "b"}]}]},
    ]})
    assert chat["messages"][1]["content"] == "" and chat["messages"][2] == {"role": "tool", "tool_call_id": "t1", "content": "a\nb"}


# Responses -------------------------------------------------------------------------------------

CODEX_FIRST = {
    "model": "gpt-5.5", "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
    "reasoning": {"effort": "medium"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "sess-1",
    "text": {"verbosity": "low"},
    "client_metadata": {"session_id": "sess-1", "thread_id": "sess-1", "turn_id": "t-1"},
    "tools": [EXEC, APPLY_PATCH, TOOL_SEARCH, {"type": "web_search", "external_web_access": False}],
    "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env/>"},
                                                              {"type": "input_text", "text": "read notes"}]}],
}


def test_codexs_first_request_translates_every_tool_the_client_runs():
    body, dropped, tools = responses(CODEX_FIRST)
    assert body["messages"] == [{"role": "system", "content": "Rules."}, {"role": "user", "content": "<env/>\nread notes"}]
    functions = {t["function"]["name"]: t["function"] for t in body["tools"]}
    assert list(functions) == ["exec_command", "apply_patch", "tool_search"]
    assert functions["apply_patch"]["parameters"]["properties"]["input"]["type"] == "string"
    # the grammar is not enforced, but the model is told it: what a patch looks like
    assert functions["apply_patch"]["description"] == ("Edit files. FREEFORM.\n\nThe input must match this Lark "
                                                       "grammar:\n```\nstart: /.+/\n```")
    assert functions["tool_search"]["parameters"] == TOOL_SEARCH["parameters"]
    assert body["parallel_tool_calls"] is True
    assert set(dropped) == {"reasoning", "include", "prompt_cache_key", "client_metadata", "text.verbosity",
                            "tools.web_search"}
    assert tools.grammars_not_enforced == 1
    # the same bytes every turn, and a format that states no grammar is dropped and named
    assert orjson.dumps(responses(CODEX_FIRST)[0]["tools"]) == orjson.dumps(body["tools"])
    odd = {**CODEX_FIRST, "tools": [{**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark"}}]}
    odd_body, odd_dropped, _ = responses(odd)
    assert odd_body["tools"][0]["function"]["description"] == "Edit files. FREEFORM." and "tools.format" in odd_dropped
    with pytest.raises(InvalidRequest) as err:
        responses(CODEX_FIRST, hosted_tools="reject")
    assert err.value.param == "tools[3].type" and err.value.code == "unsupported_tool"


def test_namespaced_tools_in_additional_tools_items_are_flattened_and_called_back_by_namespace():
    body, _, tools = responses({"model": "m", "input": [
        {"type": "additional_tools", "role": "developer", "tools": [
            {"type": "namespace", "name": "functions", "tools": [
                {"type": "custom", "name": "exec", "description": "Run JS."},
                {"type": "function", "name": "wait", "parameters": {"type": "object"}}]},
            {"type": "namespace", "name": "other", "tools": [{"type": "function", "name": "wait"}]}]},
        {"role": "user", "content": "Go."}]})
    names = [t["function"]["name"] for t in body["tools"]]
    assert names == ["exec", "wait", "other__wait"]
    assert body["messages"] == [{"role": "user", "content": "Go."}]
    item = tools.call_item("fc_1", "call_1", "exec", '{"input": "text(1)"}', "completed")
    assert item == {"id": "fc_1", "type": "custom_tool_call", "status": "completed", "call_id": "call_1", "name": "exec",
                    "input": "text(1)", "namespace": "functions"}
    other = tools.call_item("fc_2", "call_2", "other__wait", "{}", "completed")
    assert other["type"] == "function_call" and other["name"] == "wait" and other["namespace"] == "other"


def test_custom_and_tool_search_items_round_trip_as_chat_calls_and_results():
    body, dropped, _ = responses({"model": "m", "tools": [APPLY_PATCH, TOOL_SEARCH], "input": [
        {"role": "user", "content": "Patch it."},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch\n*** End Patch\n"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
        {"type": "tool_search_call", "call_id": "c2", "execution": "client", "arguments": {"query": "git"}},
        {"type": "tool_search_output", "call_id": "c2", "execution": "client",
         "tools": [{"type": "function", "name": "git_log", "parameters": {"type": "object"}}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"type": "compaction_summary_v9", "id": "x"},
    ]})
    assert body["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "apply_patch",
                                                      "arguments": orjson.dumps({"input": "*** Begin Patch\n*** End Patch\n"}).decode()}}]}
    assert body["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "Done!"}
    assert body["messages"][3]["tool_calls"][0]["function"] == {"name": "tool_search", "arguments": '{"query":"git"}'}
    assert body["messages"][4] == {"role": "tool", "tool_call_id": "c2", "content": "Tools now available: git_log"}
    assert "git_log" in [t["function"]["name"] for t in body["tools"]]  # what the search found can be called next
    assert {"reasoning_items", "input.web_search_call", "input.compaction_summary_v9"} <= set(dropped)


def test_a_custom_tool_call_streams_as_custom_tool_call_events():
    req = protocol.check(rw.ResponsesRequest, {"model": "gpt-5.5", "input": "Hi.", "store": False, "tools": [APPLY_PATCH]})
    _, _, tools = rw.translate(req, {}, rw.input_items(req))
    turn = Turn(req=req, id="resp_1", created_at=1, tenant="t", inputs=[], store=None, model="gpt-5.5",
                tools=tools)
    ctx = RequestContext(request_id="r", operation="chat", body={}, headers={}, model="auto", client_model="gpt-5.5",
                         principal=Principal(tenant="t", app="a", key_id="k"), usage=Usage(input_tokens=3, output_tokens=2))
    encoder = ResponsesEncoder(ctx, turn)
    patch = "*** Begin Patch\n*** End Patch\n"
    arguments = orjson.dumps({"input": patch}).decode()
    chunks = [{"model": "upstream-x", "choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "id": "call_9", "function": {"name": "apply_patch", "arguments": arguments[:7]}}]}}]},
              {"model": "upstream-x", "choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "function": {"arguments": arguments[7:]}}]}, "finish_reason": "tool_calls"}]}]
    whole = {"model": "upstream-x", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "function": {"name": "apply_patch", "arguments": arguments}}]}}]}
    raw = b"".join(encoder.chunk(c) for c in chunks) + asyncio.run(encoder.end(whole))
    events = [orjson.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.split(b"\n\n") if block]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
                     "response.output_item.done", "response.completed"]
    assert events[2]["item"]["type"] == "custom_tool_call" and events[4]["input"] == patch
    final = events[-1]["response"]
    assert final["model"] == "gpt-5.5"  # the name the client asked for, not the upstream's
    assert final["output"] == [{"id": "fc_1_0", "type": "custom_tool_call", "status": "completed", "call_id": "call_9",
                                "name": "apply_patch", "input": patch}]


def test_refused_and_header():
    for name, value in (("background", True), ("conversation", "conv_1"), ("prompt", {"id": "p"})):
        with pytest.raises(InvalidRequest) as err:
            responses({"model": "m", "input": "Hi.", name: value})
        assert err.value.param == name
    assert header_value(["b", "a", "b"]) == "a,b"
    assert len(header_value([f"field_{i:04d}" for i in range(1000)])) <= 2048
