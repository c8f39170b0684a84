"""Which upstream answers are worth teaching: whole, plain-text answers that did what the request asked.

Not kept (each a reason, counted on /metrics): an answer cut by max_tokens (`length`), a refusal
(a `refusal` field, or finish_reason content_filter), tool calls, a JSON answer that breaks the
request's response_format (json_object: not an object; json_schema: policies.learn.json_schema),
several choices (n > 1: samples, not the answer), an empty answer, and a request that is not text alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from policies.learn.json_schema import conforms

# Every reason a matched request is not kept: a fixed set, so metric labels stay bounded. The first
# five are decided by the gateway (lane, status, size, store), the rest here.
SKIP_REASONS = ("lane", "status", "too_large", "dropped", "error",
                "length", "refusal", "tool_calls", "schema", "choices", "empty", "not_text", "finish_reason")  # fmt: skip

_FINISH = {"length": "length", "content_filter": "refusal", "tool_calls": "tool_calls", "function_call": "tool_calls"}


def input_reason(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """Why a request cannot teach a text model (`not_text`: an image, audio or file part), or None."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(
            not isinstance(part, Mapping) or part.get("type", "text") != "text" for part in content
        ):
            return "not_text"
    return None


def answer_text(response: Mapping[str, Any] | None, finish_reasons: Sequence[str],
                response_format: Any = None) -> tuple[str | None, str | None]:  # fmt: skip
    """(the answer's text, None) for an answer worth keeping, else (None, the reason it is not)."""
    choices = response.get("choices") if isinstance(response, Mapping) else None
    if not isinstance(choices, list) or not choices:
        return None, "empty"
    if len(choices) != 1 or not isinstance(choices[0], Mapping):
        return None, "choices"
    reasons = list(finish_reasons) or [str(choices[0].get("finish_reason") or "")]
    for reason in reasons:
        if reason != "stop":
            return None, _FINISH.get(reason, "finish_reason")
    choice = choices[0]
    message = choice.get("message")
    if isinstance(message, Mapping):
        if message.get("refusal"):
            return None, "refusal"
        if message.get("tool_calls") or message.get("function_call"):
            return None, "tool_calls"
        text = message.get("content")
    else:
        text = choice.get("text")  # a completions answer
    if not isinstance(text, str) or not text.strip():
        return None, "empty"
    if not follows_format(text, response_format):
        return None, "schema"
    return text, None


def follows_format(text: str, response_format: Any) -> bool:
    """Whether the text is what the request's response_format asked for (any text where it asked none)."""
    if not isinstance(response_format, Mapping):
        return True
    kind = response_format.get("type")
    if kind not in ("json_object", "json_schema"):
        return True
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    if kind == "json_object":
        return isinstance(value, dict)
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    return schema is None or conforms(value, schema)
