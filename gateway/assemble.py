"""Assembling a streamed answer into the whole response it stands for (for caching and metering)."""

from __future__ import annotations

from typing import Any


class StreamAssembler:
    """Feed it each chunk of a chat or text completion stream; `response()` is the whole answer."""

    def __init__(self) -> None:
        self.id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.object: str | None = None
        self.usage: dict[str, Any] | None = None
        self._choices: dict[int, dict[str, Any]] = {}
        self.chunks = 0

    def add(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        self.id = self.id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        self.created = self.created or chunk.get("created")
        self.object = self.object or chunk.get("object")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            slot = self._choices.setdefault(
                index, {"index": index, "role": None, "content": [], "tool_calls": {}, "finish_reason": None}
            )
            if choice.get("finish_reason"):
                slot["finish_reason"] = choice["finish_reason"]
            if "text" in choice:
                slot["content"].append(choice.get("text") or "")
                continue
            delta = choice.get("delta") or {}
            if delta.get("role"):
                slot["role"] = delta["role"]
            if delta.get("content"):
                slot["content"].append(delta["content"])
            for call in delta.get("tool_calls") or ():
                acc = slot["tool_calls"].setdefault(
                    call.get("index", 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                acc["id"] = call.get("id") or acc["id"]
                fn = call.get("function") or {}
                acc["function"]["name"] += fn.get("name") or ""
                acc["function"]["arguments"] += fn.get("arguments") or ""

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for _, c in sorted(self._choices.items()) if c["finish_reason"]]

    def response(self) -> dict[str, Any]:
        text_completion = self.object == "text_completion"
        choices = []
        for _, slot in sorted(self._choices.items()):
            content = "".join(slot["content"])
            if text_completion:
                choices.append({"index": slot["index"], "text": content, "finish_reason": slot["finish_reason"]})
                continue
            message: dict[str, Any] = {"role": slot["role"] or "assistant", "content": content}
            if slot["tool_calls"]:
                message["tool_calls"] = [slot["tool_calls"][k] for k in sorted(slot["tool_calls"])]
                message["content"] = content or None
            choices.append({"index": slot["index"], "message": message, "finish_reason": slot["finish_reason"]})
        out: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion" if text_completion else "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.usage:
            out["usage"] = self.usage
        return out
