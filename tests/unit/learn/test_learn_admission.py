"""Which answers are kept: whole plain-text answers that follow the request's response_format."""

from __future__ import annotations

from typing import Any

import pytest

from policies.learn.admission import answer_text, follows_format, input_reason
from policies.learn.json_schema import conforms


def chat(message: dict[str, Any], finish: str = "stop", n: int = 1) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}
    return {"object": "chat.completion", "choices": [choice] * n}


def test_a_whole_answer_is_kept() -> None:
    assert answer_text(chat({"content": "billing"}), ["stop"]) == ("billing", None)
    assert answer_text({"choices": [{"text": "yes", "finish_reason": "stop"}]}, ["stop"]) == ("yes", None)  # completions
    assert answer_text(chat({"content": "billing"}), []) == ("billing", None)  # the choice's own finish_reason


@pytest.mark.parametrize(("response", "finish", "reason"), [
    (chat({"content": "The ticket is about bil"}, "length"), ["length"], "length"),
    (chat({"content": ""}, "content_filter"), ["content_filter"], "refusal"),
    (chat({"content": None, "refusal": "I can't help with that."}), ["stop"], "refusal"),
    (chat({"content": None, "tool_calls": [{"id": "c1", "type": "function",
                                            "function": {"name": "f", "arguments": "{}"}}]}, "tool_calls"),
     ["tool_calls"], "tool_calls"),
    (chat({"content": "x", "tool_calls": [{"id": "c1"}]}), ["stop"], "tool_calls"),
    (chat({"content": "a"}, n=2), ["stop", "stop"], "choices"),
    (chat({"content": "   "}), ["stop"], "empty"),
    ({"choices": []}, [], "empty"),
    (None, [], "empty"),
    (chat({"content": "x"}, "weird"), ["weird"], "finish_reason"),
])  # fmt: skip
def test_cut_refused_tool_and_odd_answers_are_not_kept(response: Any, finish: list[str], reason: str) -> None:
    assert answer_text(response, finish) == (None, reason)


SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["billing", "bug", "other"]}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["label"],
    "additionalProperties": False,
}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "strict": True, "schema": schema}}


def test_an_answer_that_breaks_the_requests_json_schema_is_not_kept() -> None:
    fmt = schema_format(SCHEMA)
    assert answer_text(chat({"content": '{"label": "bug", "score": 0.5}'}), ["stop"], fmt) == ('{"label": "bug", "score": 0.5}', None)
    for bad in ('{"label": "spam"}', '{"score": 0.5}', '{"label": "bug", "extra": 1}', '{"label": "bug", "score": 2}',
                "label: bug", '```json\n{"label": "bug"}\n```'):
        assert answer_text(chat({"content": bad}), ["stop"], fmt) == (None, "schema"), bad
    assert follows_format('{"a": 1}', {"type": "json_object"})
    assert not follows_format("[1, 2]", {"type": "json_object"})
    assert not follows_format("not json", {"type": "json_object"})
    assert follows_format("not json", {"type": "text"}) and follows_format("not json", None)


@pytest.mark.parametrize(("value", "schema", "ok"), [
    (1, {"type": "integer"}, True),
    (1.0, {"type": "integer"}, True),
    (True, {"type": "integer"}, False),
    (True, {"const": 1}, False),
    ([1, "a"], {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, True),
    ([1, 2, 3], {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, False),
    ("abc", {"type": "string", "minLength": 4}, False),
    ("abc", {"type": "string", "pattern": "^z"}, True),  # pattern is not checked (documented)
    ({"a": {"b": 1}}, {"$defs": {"B": {"type": "object", "properties": {"b": {"type": "string"}}}},
                       "type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}}, False),
    ({"a": 1}, {"anyOf": [{"required": ["b"]}, {"required": ["a"]}]}, True),
    ({"a": 1}, {"oneOf": [{"required": ["a"]}, {"type": "object"}]}, False),
    ("x", {"not": {"type": "string"}}, False),
    ({"a": 1}, {"$ref": "#/definitions/missing"}, False),
    ({"a": 1}, True, True),
    ({"a": 1}, False, False),
    ({"next": {"next": None}}, {"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}}, True),
])  # fmt: skip
def test_the_json_schema_check(value: Any, schema: Any, ok: bool) -> None:
    assert conforms(value, schema) is ok


def test_a_schema_that_refers_to_itself_forever_is_a_failure_not_a_hang() -> None:
    assert not conforms({"a": 1}, {"$ref": "#"})
    nested: dict[str, Any] = {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}
    assert not conforms(1, nested)


def test_a_request_with_an_image_cannot_teach_a_text_model() -> None:
    image = {"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                         {"type": "image_url", "image_url": {"url": "data:,"}}]}  # fmt: skip
    assert input_reason([image]) == "not_text"
    assert input_reason([{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "user", "content": "x"}]) is None
