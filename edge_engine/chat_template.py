"""Renders OpenAI chat messages into a prompt with the chat template stored in the GGUF."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from edge_engine.errors import InvalidInput
from edge_engine.llama_model import LlamaModel


class ChatTemplate:
    """The model's own template; chat prompts carry their special tokens in the text."""

    def __init__(self, model: LlamaModel) -> None:
        template = model.metadata("tokenizer.chat_template")
        if not template:
            raise RuntimeError(f"{model.path.name} has no tokenizer.chat_template in its metadata")
        self._formatter = Jinja2ChatFormatter(
            template=template, eos_token=model.eos_text, bos_token=model.bos_text
        )

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        plain = [{**m, "content": _text_content(m.get("content"), i)} for i, m in enumerate(messages)]
        try:
            # the formatter's TypedDict messages are what `plain` holds, checked by the wire model
            return self._formatter(messages=cast(Any, plain)).prompt
        except Exception as exc:  # the template raises for roles or orders it does not accept
            raise InvalidInput(f"the edge model's chat template rejected the messages: {exc}", param="messages") from exc


def _text_content(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise InvalidInput(
                    "the edge model reads text only; send image or audio parts to an upstream model",
                    param=f"messages[{index}].content",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidInput("message content must be a string or a list of parts", param=f"messages[{index}].content")
