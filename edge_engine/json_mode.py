"""JSON mode: the GBNF grammar for an OpenAI-style `response_format`, for SamplingParams.grammar.

{"type": "json_object"} gets llama.cpp's JSON grammar (any object); {"type": "json_schema",
"json_schema": {"schema": {...}}} gets a grammar converted from the schema by
llama-cpp-python's converter; {"type": "text"} gets none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llama_cpp import llama_grammar

from edge_engine.errors import InvalidInput

PARAM = "response_format"


def grammar_for(response_format: Mapping[str, Any]) -> str | None:
    """GBNF (root rule "root") for the response format; InvalidInput for one it cannot convert."""
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return str(llama_grammar.JSON_GBNF)
    if kind != "json_schema":
        raise InvalidInput(f"response_format type {kind!r} is not supported: use text, json_object or json_schema", param=PARAM)
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if not isinstance(schema, Mapping):
        raise InvalidInput("response_format json_schema needs a `schema` object", param=PARAM)
    if _remote_ref(schema):
        # NOTE: the converter refuses remote $refs with an assert only, which `python -O` drops
        raise InvalidInput("response_format json_schema may only use local $refs (#/...)", param=PARAM)
    try:
        # NOTE: the converter reports what it cannot handle (remote or broken $ref, unknown
        # types, bad patterns) with assert, ValueError, KeyError and friends.
        grammar = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    except (AssertionError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        raise InvalidInput(f"response_format json_schema cannot be turned into a grammar: {exc}", param=PARAM) from exc
    return str(grammar)


def _remote_ref(node: Any) -> bool:
    if isinstance(node, Mapping):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return True
        return any(_remote_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_remote_ref(v) for v in node)
    return False
