"""JSON mode: the GBNF grammar for an OpenAI-style `response_format`, for SamplingParams.grammar.

{"type": "json_object"} gets llama.cpp's JSON grammar (any object); {"type": "json_schema",
"json_schema": {"schema": {...}}} gets a grammar converted from the schema by
llama-cpp-python's converter; {"type": "text"} gets none. The conversion is bounded
(edge_engine/grammar.py); a running engine compiles through `EdgeEngine.compile_grammar`, which
also has llama.cpp parse the result, off the event loop and cached.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edge_engine.grammar import PARAM, convert
from edge_engine.settings import GrammarSettings

__all__ = ["PARAM", "grammar_for"]

_DEFAULT_LIMITS = GrammarSettings()


def grammar_for(response_format: Mapping[str, Any], limits: GrammarSettings | None = None) -> str | None:
    """GBNF (root rule "root") for the response format; InvalidInput (GrammarTooComplex past a bound)
    for one it cannot or may not convert. Blocking: call it off the event loop."""
    return convert(response_format, limits or _DEFAULT_LIMITS)
