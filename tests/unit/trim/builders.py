"""Message builders for hand-written trim tests."""

from __future__ import annotations

from typing import Any


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def system(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


def tool_call(call_id: str, name: str = "lookup") -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}],
    }


def tool_result(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}
