"""A chat request as a Messages request: the translation, the cache breakpoints, prefix stability."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.errors import InvalidRequest
from gateway.settings import UpstreamSettings
from gateway.upstream.to_messages import (
    DEFAULT_MAX_TOKENS,
    breakpoints,
    marked,
    to_messages,
    translated_headers,
    unmarked,
)

MARK = {"type": "ephemeral"}
TOOLS = [
    {"type": "function", "function": {"name": "read", "description": "Read a file.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}},
]


def turn(n: int) -> list[dict[str, Any]]:
    """A conversation after `n` tool round trips (each assistant call answered by two results)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."},
                                      {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
                                      {"role": "user", "content": "Read the files."}]
    for i in range(n):
        messages.append({"role": "assistant", "content": f"Reading {i}." if i % 2 else None, "tool_calls": [
            {"id": f"call_{i}a", "type": "function", "function": {"name": "read", "arguments": f'{{"path": "f{i}"}}'}},
            {"id": f"call_{i}b", "type": "function", "function": {"name": "ls", "arguments": ""}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}a", "content": f"contents of f{i}"})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}b", "content": [{"type": "text", "text": "a b"}]})
    return messages


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "claude", "messages": messages, "tools": TOOLS, "max_tokens": 256, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


def test_a_tool_conversation_translates_block_by_block():
    out = to_messages(body(turn(2), temperature=0.5, stop="END", parallel_tool_calls=False, user="u1"))
    assert list(out) == ["model", "max_tokens", "system", "messages", "tools", "tool_choice", "temperature",
                         "stop_sequences", "metadata", "stream"]
    assert unmarked(out["system"]) == [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Use tools."}]
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    first_call = unmarked(out["messages"][1]["content"])
    assert first_call == [{"type": "tool_use", "id": "call_0a", "name": "read", "input": {"path": "f0"}},
                          {"type": "tool_use", "id": "call_0b", "name": "ls", "input": {}}]
    assert unmarked(out["messages"][3]["content"])[0] == {"type": "text", "text": "Reading 1."}
    # both results of one exchange in one user turn, in order
    assert unmarked(out["messages"][2]["content"]) == [
        {"type": "tool_result", "tool_use_id": "call_0a", "content": "contents of f0"},
        {"type": "tool_result", "tool_use_id": "call_0b", "content": [{"type": "text", "text": "a b"}]}]
    assert unmarked(out["tools"]) == [
        {"name": "read", "description": "Read a file.", "input_schema": TOOLS[0]["function"]["parameters"]},
        {"name": "ls", "input_schema": {"type": "object", "properties": {}}}]
    assert out["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    assert out["stop_sequences"] == ["END"] and out["metadata"] == {"user_id": "u1"} and out["stream"] is True


def test_breakpoints_sit_on_the_last_tool_system_block_and_turn_ends():
    out = to_messages(body(turn(2)))
    # messages: user, assistant, user(results 0), assistant, user(results 1): the previous request ended at [2]
    assert marked(out) == ["tools[1]", "system[1]", "messages[2][1]", "messages[4][1]"]
    assert breakpoints(out) == 4
    assert out["messages"][4]["content"][-1]["cache_control"] == MARK
    first = to_messages(body(turn(0)))
    assert marked(first) == ["tools[1]", "system[1]", "messages[0][0]"]  # nothing answered yet: no 4th
    bare = to_messages({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert marked(bare) == ["messages[0][0]"] and "tools" not in bare and "system" not in bare


@pytest.mark.parametrize("rounds", range(0, 12))
def test_never_more_than_four_marks(rounds):
    for request in (body(turn(rounds)), {"model": "m", "messages": turn(rounds)}):
        assert 1 <= breakpoints(to_messages(request)) <= 4


def test_consecutive_turns_share_their_prefix_byte_for_byte():
    """Turn N+1 extends turn N: every field but `messages` the same bytes, turn N's messages a
    byte-identical prefix of turn N+1's, marks aside (Anthropic's cache key ignores them)."""
    for n in range(0, 8):
        before, after = to_messages(body(turn(n))), to_messages(body(turn(n + 1)))
        assert list(before) == list(after)
        for key in before:
            if key != "messages":
                assert orjson.dumps(before[key]) == orjson.dumps(after[key]), key
        old, new = before["messages"], after["messages"]
        assert len(new) > len(old)
        for i, message in enumerate(old):
            assert orjson.dumps(unmarked(message)) == orjson.dumps(unmarked(new[i])), (n, i)
        # the block turn N wrote its cache at is where turn N+1 reads it (its 4th mark)
        if n > 0:
            assert "cache_control" in new[len(old) - 1]["content"][-1]
    # and the same request twice is the same bytes, marks included
    assert orjson.dumps(to_messages(body(turn(3)))) == orjson.dumps(to_messages(body(turn(3))))


def test_a_later_system_message_stays_where_it_was():
    messages = [*turn(1), {"role": "system", "content": "Now be verbose."}, {"role": "user", "content": "Go on."}]
    out = to_messages(body(messages))
    assert [b["text"] for b in out["system"]] == ["You are terse.", "Use tools."]
    assert unmarked(out["messages"][3]) == {"role": "user", "content": [{"type": "text", "text": "Now be verbose."}]}
    assert unmarked(out["messages"][4]) == {"role": "user", "content": [{"type": "text", "text": "Go on."}]}


def test_images_and_limits():
    parts = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
             {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg", "detail": "low"}}]
    out = to_messages({"model": "m", "messages": [{"role": "user", "content": parts}], "max_completion_tokens": 99})
    assert unmarked(out["messages"][0]["content"]) == [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}}]
    assert out["max_tokens"] == 99
    question = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert to_messages(question)["max_tokens"] == DEFAULT_MAX_TOKENS
    assert to_messages(question, default_max_tokens=512)["max_tokens"] == 512


@pytest.mark.parametrize(("choice", "expected"), [
    ("auto", {"type": "auto"}), ("none", {"type": "none"}), ("required", {"type": "any"}),
    ({"type": "function", "function": {"name": "ls"}}, {"type": "tool", "name": "ls"}), (None, None)])
def test_tool_choice(choice, expected):
    out = to_messages(body(turn(0), tool_choice=choice))
    assert out.get("tool_choice") == expected


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"temperature": 1.5}, "temperature"), ({"brand_new": 1}, "brand_new")])
def test_what_messages_cannot_carry_is_a_400_naming_it(extra, param):
    with pytest.raises(InvalidRequest) as refused:
        to_messages(body(turn(0), **extra))
    assert refused.value.status == 400 and refused.value.param == param and param in refused.value.message
    # their harmless values, and hints, pass
    to_messages(body(turn(0), n=1, logprobs=False, response_format={"type": "text"}, seed=3, store=False,
                     prompt_cache_key="s", cache_salt="t", reasoning_effort="low"))


CUT = '{"path": "notes.md", "content": "# Notes\\n\\nThe first'  # a file write cut off by max_tokens


def test_a_tool_call_cut_off_goes_with_no_input_and_its_text_before_it():
    messages = turn(1)
    messages[3]["tool_calls"][0]["function"]["arguments"] = CUT
    messages[4]["content"] = "error: the arguments were not valid JSON"
    out = to_messages(body(messages))
    note, call, other = unmarked(out["messages"][1]["content"])
    assert call == {"type": "tool_use", "id": "call_0a", "name": "read", "input": {}}
    assert note["type"] == "text" and note["text"].endswith(f"The arguments as written: {CUT}]")
    assert "read" in note["text"] and "call_0a" in note["text"]
    assert other == {"type": "tool_use", "id": "call_0b", "name": "ls", "input": {}}
    messages[3]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"  # JSON, but no object
    assert unmarked(to_messages(body(messages))["messages"][1]["content"])[1]["input"] == {}
    messages[3]["tool_calls"][0]["function"]["arguments"] = 7
    with pytest.raises(InvalidRequest) as bad:
        to_messages(body(messages))
    assert bad.value.param == "messages[3].tool_calls[0].function.arguments"


def test_a_conversation_carrying_a_cut_call_stays_prefix_stable():
    def cut(n: int) -> list[dict[str, Any]]:
        messages = turn(n)
        messages[3]["tool_calls"][0]["function"]["arguments"] = CUT
        return messages

    for n in range(1, 5):
        before, after = to_messages(body(cut(n))), to_messages(body(cut(n + 1)))
        for i, message in enumerate(before["messages"]):
            assert orjson.dumps(unmarked(message)) == orjson.dumps(unmarked(after["messages"][i])), (n, i)
        assert 1 <= breakpoints(after) <= 4
    assert orjson.dumps(to_messages(body(cut(2)))) == orjson.dumps(to_messages(body(cut(2))))


def test_translated_headers_carry_the_gateways_version_and_no_client_anthropic_header():
    assert translated_headers({"x-a": "1"}) == {"x-a": "1", "anthropic-version": "2023-06-01"}
    client = {"Anthropic-Version": "2024-01-01", "anthropic-beta": "context-1m-2025-08-07", "traceparent": "t"}
    assert translated_headers(client) == {"traceparent": "t", "anthropic-version": "2023-06-01"}


@pytest.mark.parametrize("messages", [
    [], [{"role": "system", "content": "You are terse."}],
    [{"role": "developer", "content": "Rules."}, {"role": "user", "content": ""}]], ids=["empty", "system", "blank"])
def test_a_request_with_no_message_to_answer_is_a_400_before_sending(messages):
    with pytest.raises(InvalidRequest) as refused:
        to_messages({"model": "m", "messages": messages})
    assert refused.value.status == 400 and refused.value.param == "messages"


def test_an_assistant_refusal_is_kept_as_its_text():
    messages = [{"role": "user", "content": "Help me."}, {"role": "assistant", "content": None, "refusal": "I can't."},
                {"role": "user", "content": "Why?"}]
    out = to_messages({"model": "m", "messages": messages})
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user"]
    assert unmarked(out["messages"][1]) == {"role": "assistant", "content": [{"type": "text", "text": "I can't."}]}


def test_values_anthropic_refuses_that_ask_for_nothing_are_left_out():
    question = [{"role": "user", "content": "hi"}]
    for top_k in (0, -1):
        assert "top_k" not in to_messages({"model": "m", "messages": question, "top_k": top_k})
    assert to_messages({"model": "m", "messages": question, "top_k": 5})["top_k"] == 5
    assert "stop_sequences" not in to_messages({"model": "m", "messages": question, "stop": [""]})
    assert to_messages({"model": "m", "messages": question, "stop": ["", "END"]})["stop_sequences"] == ["END"]


def test_a_developer_message_between_tool_results_follows_them():
    messages = turn(1)
    messages.insert(5, {"role": "developer", "content": "The second result is late."})  # between the two results
    out = to_messages(body(messages))
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user"]
    assert [b["type"] for b in out["messages"][2]["content"]] == ["tool_result", "tool_result", "text"]
    assert out["messages"][2]["content"][2]["text"] == "The second result is late."
    # after the last result it stays a turn of its own, as before
    messages = [*turn(1), {"role": "developer", "content": "Done reading."}]
    out = to_messages(body(messages))
    assert unmarked(out["messages"][3]) == {"role": "user", "content": [{"type": "text", "text": "Done reading."}]}


def test_apis_must_name_one_api_and_chat_is_not_forced():
    assert UpstreamSettings(name="a", base_url="https://api.anthropic.com/v1", apis=["messages"]).apis == ["messages"]
    assert UpstreamSettings(name="a", base_url="http://x/v1").apis == ["chat"]
    for apis in ([], ["chat", "chat"]):
        with pytest.raises(ValueError):
            UpstreamSettings(name="a", base_url="http://x/v1", apis=apis)
