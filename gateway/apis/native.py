"""Answers of an upstream that serves the Messages API natively, read into the chat shape.

The client gets the upstream's own answer (JSON, or its events as they come); the completion
hooks (cache admission, metering) get the same answer in the chat shape they read, made here.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.context import NativeApi, Usage

# Anthropic stop reasons as chat finish reasons.
FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "pause_turn": "stop", "max_tokens": "length",
                  "tool_use": "tool_calls", "refusal": "content_filter"}


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def message_usage(usage: Any) -> Usage | None:
    """Anthropic's usage as tierlane's: cache reads and writes are input tokens too, each priced as
    itself (writes for an hour apart, from `cache_creation.ephemeral_1h_input_tokens`)."""
    if not isinstance(usage, dict):
        return None
    cached = _count(usage.get("cache_read_input_tokens"))
    written = _count(usage.get("cache_creation_input_tokens"))
    breakdown = usage.get("cache_creation")
    written_1h = min(written, _count(breakdown.get("ephemeral_1h_input_tokens"))) if isinstance(breakdown, dict) else 0
    total = _count(usage.get("input_tokens")) + cached + written
    return Usage(input_tokens=total, output_tokens=_count(usage.get("output_tokens")), cached_input_tokens=cached,
                 cache_write_tokens=written - written_1h, cache_write_1h_tokens=written_1h)


def chat_from_message(message: dict[str, Any]) -> dict[str, Any]:
    """A Message as the chat completion it stands for."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.get("content") or ():
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif block.get("type") == "tool_use":
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": str(block.get("name") or ""),
                                       "arguments": orjson.dumps(block.get("input") or {}).decode()}})
    chat_message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        chat_message["tool_calls"] = calls
    reason = FINISH_REASONS.get(str(message.get("stop_reason")), "stop")
    out: dict[str, Any] = {"id": message.get("id"), "object": "chat.completion", "created": int(time.time()),
                           "model": message.get("model"),
                           "choices": [{"index": 0, "message": chat_message, "finish_reason": reason}]}
    usage = message_usage(message.get("usage"))
    if usage is not None:
        out["usage"] = usage.to_openai()
    return out


class MessagesStreamReader:
    """Each native stream event as a chat chunk that carries the event itself under `native`."""

    def __init__(self) -> None:
        self.id: Any = None
        self.model: Any = None
        self.created = int(time.time())
        self.tools: dict[Any, int] = {}  # content block index -> tool call position
        self._usage: dict[str, Any] = {}
        self.usage: Usage | None = None

    def _count_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self._usage.update({k: v for k, v in usage.items() if v is not None})
            self.usage = message_usage(self._usage)

    def chunk(self, event: dict[str, Any]) -> dict[str, Any]:
        kind = event.get("type")
        delta: dict[str, Any] = {}
        finish: str | None = None
        if kind == "message_start" and isinstance(event.get("message"), dict):
            message = event["message"]
            self.id, self.model = message.get("id"), message.get("model")
            delta["role"] = "assistant"
            self._count_usage(message.get("usage"))
        elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            block = event["content_block"]
            if block.get("type") == "tool_use":
                position = self.tools[event.get("index")] = len(self.tools)
                delta["tool_calls"] = [{"index": position, "id": str(block.get("id") or ""), "type": "function",
                                        "function": {"name": str(block.get("name") or ""), "arguments": ""}}]
        elif kind == "content_block_delta" and isinstance(event.get("delta"), dict):
            piece = event["delta"]
            if piece.get("type") == "text_delta" and isinstance(piece.get("text"), str):
                delta["content"] = piece["text"]
            elif piece.get("type") == "input_json_delta" and event.get("index") in self.tools:
                delta["tool_calls"] = [{"index": self.tools[event.get("index")],
                                        "function": {"arguments": str(piece.get("partial_json") or "")}}]
        elif kind == "message_delta":
            stop = (event.get("delta") or {}).get("stop_reason") if isinstance(event.get("delta"), dict) else None
            finish = FINISH_REASONS.get(str(stop), "stop") if stop else None
            self._count_usage(event.get("usage"))
        choices = [{"index": 0, "delta": delta, "finish_reason": finish}] if delta or finish else []
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": choices, "native": event}

    def ends(self, event: dict[str, Any]) -> bool:
        """Whether the event is the stream's last (`message_stop`)."""
        return event.get("type") == "message_stop"


# What the Messages front door puts on the context with the client's own body (`RequestContext.native_api`).
MESSAGES = NativeApi(usage=message_usage, chat=chat_from_message, stream=MessagesStreamReader)
