"""What the edge lane cannot serve: found per feature, routed upstream for `auto`, a 400 when pinned."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from edge_engine.grammar import GrammarCompiler
from edge_engine.settings import GrammarSettings
from gateway.capabilities import EdgeCapabilities, edge_gaps
from gateway.errors import InvalidRequest

USER = [{"role": "user", "content": "What is 2+2?"}]


def gaps(body: dict[str, Any], operation: str = "chat", n_ctx: int = 2048, json_ok: bool = True) -> list[tuple[str, str]]:
    """The gaps an engine with this window finds; its grammars compiled by the real, bounded converter
    (llama.cpp's own parse is left out here: tests/unit/edge_engine/test_grammar_bounds.py runs it)."""
    compiler = GrammarCompiler(GrammarSettings())
    engine = SimpleNamespace(n_ctx=n_ctx, settings=SimpleNamespace(default_max_tokens=256))
    if json_ok:
        engine.compile_grammar = compiler.compile
    try:
        found = asyncio.run(EdgeCapabilities(engine).gaps(operation, {"model": "auto", **body}))
    finally:
        compiler.close()
    return [(g.capability, g.param) for g in found]


def test_a_plain_request_has_no_gaps() -> None:
    assert gaps({"messages": USER, "temperature": 0, "max_tokens": 8, "stop": ["\n"], "user": "u",
                 "metadata": {"a": "b"}, "logprobs": True, "top_logprobs": 3, "seed": 1}) == []
    assert gaps({"prompt": "Once upon", "max_tokens": 4, "logprobs": 2}, "completions") == []
    assert gaps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}) == []


@pytest.mark.parametrize(("body", "expected"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, [("tools", "tools")]),
    ({"functions": [{"name": "f"}]}, [("tools", "functions")]),
    ({"tool_choice": "required"}, [("tools", "tool_choice")]),
    ({"n": 2}, [("n", "n")]),
    ({"logit_bias": {"42": 5}}, [("logit_bias", "logit_bias")]),
    ({"min_p": 0.1}, [("min_p", "min_p")]),
    ({"modalities": ["text", "audio"]}, [("param", "modalities")]),
    ({"response_format": {"type": "json_object"}}, []),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, []),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}}},
     [("json_schema", "response_format")]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "maxLength": 30000}}}},
     [("json_schema", "response_format")]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": list(range(5000))}}}},
     [("json_schema", "response_format")]),
    ({"response_format": {"type": "text"}}, []),
])
def test_each_feature_is_named_with_its_parameter(body: dict[str, Any], expected: list[tuple[str, str]]) -> None:
    assert gaps({"messages": USER, **body}) == expected


def test_json_mode_is_a_gap_without_a_grammar_compiler() -> None:
    assert gaps({"messages": USER, "response_format": {"type": "json_object"}}, json_ok=False) == [("json", "response_format")]


def test_content_parts_and_tool_turns_are_found_where_they_are() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": "data:,"}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c"},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]},
    ]
    assert gaps({"messages": messages}) == [
        ("image", "messages[0].content[1]"), ("tools", "messages[1]"), ("tools", "messages[2]"),
        ("audio", "messages[3].content[0]"),
    ]


def test_completions_features() -> None:
    assert gaps({"prompt": "a", "echo": True, "best_of": 3, "suffix": "z"}, "completions") == [
        ("n", "best_of"), ("echo", "echo"), ("suffix", "suffix")]
    assert gaps({"prompt": ["a", "b"]}, "completions") == [("batch", "prompt")]
    assert gaps({"prompt": [1, 2, 3]}, "completions") == []


def test_context_counts_prompt_and_output() -> None:
    assert gaps({"messages": USER, "max_tokens": 100}, n_ctx=1024) == []
    assert gaps({"messages": USER, "max_tokens": 1020}, n_ctx=1024) == [("context", "max_tokens")]
    long = [{"role": "user", "content": "word " * 2000}]
    assert gaps({"messages": long, "max_tokens": 8}, n_ctx=1024) == [("context", "messages")]
    assert gaps({"prompt": list(range(1030)), "max_tokens": 8}, "completions", n_ctx=1024) == [("context", "prompt")]
    assert gaps({"prompt": list(range(1020)), "max_tokens": 8}, "completions", n_ctx=1024) == [("context", "max_tokens")]
    assert gaps({"messages": long, "max_tokens": 8}, n_ctx=0) == []  # unknown window: not checked


def test_embeddings_are_never_checked() -> None:
    assert gaps({"input": "x", "dimensions": 3}, "embeddings") == []


def test_a_gap_reads_as_a_route_reason_and_a_400() -> None:
    gap = edge_gaps("chat", {"messages": USER, "tools": [{}]}, context_tokens=0, json_mode=False,
                    default_max_tokens=16)[0]
    assert gap.reason == "capability:tools"
    error = gap.error()
    assert isinstance(error, InvalidRequest) and error.status == 400
    assert error.payload()["error"] == {"message": error.message, "type": "invalid_request_error", "param": "tools",
                                        "code": "unsupported_on_edge"}


def test_pinned_requests_leave_the_size_to_the_engine() -> None:
    engine = SimpleNamespace(n_ctx=64, settings=SimpleNamespace(default_max_tokens=16))
    caps = EdgeCapabilities(engine)
    big = {"model": "edge", "messages": USER, "max_tokens": 1000}
    assert [g.capability for g in asyncio.run(caps.gaps("chat", big))] == ["context"]
    asyncio.run(caps.check_pinned("chat", big))  # the engine counts tokens exactly and decides
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(caps.check_pinned("chat", {**big, "n": 3}))
    assert info.value.param == "n"


def test_a_schema_past_the_bounds_is_a_400_with_a_stable_code_when_pinned() -> None:
    compiler = GrammarCompiler(GrammarSettings())
    engine = SimpleNamespace(n_ctx=2048, settings=SimpleNamespace(default_max_tokens=16), compile_grammar=compiler.compile)
    body = {"model": "edge", "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "maxLength": 30000}}}}
    try:
        with pytest.raises(InvalidRequest) as info:
            asyncio.run(EdgeCapabilities(engine).check_pinned("chat", body))
    finally:
        compiler.close()
    assert info.value.param == "response_format" and info.value.code == "grammar_too_complex"
