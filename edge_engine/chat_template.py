"""Renders OpenAI chat messages into a prompt with the chat template stored in the GGUF.

The template is the model's own Jinja text (`tokenizer.chat_template`), rendered the way
Hugging Face's `apply_chat_template` does (llama-cpp-python's Jinja2ChatFormatter: sandboxed,
`raise_exception`, `strftime_now`, a JSON `tojson`, loop controls). It is checked once, at engine
start, on a probe conversation: a template that does not compile, cannot render a
system/user/assistant exchange, or ignores `add_generation_prompt` is refused there with a
`ChatTemplateError` naming the model file, never at the first request.

The probe also yields the text the template writes after an assistant turn (`end_of_turn`:
`<|im_end|>`, `<end_of_turn>`, `<|eot_id|>`, `<|end_of_text|>` ...); `stop_tokens` makes that
token end generation alongside llama.cpp's own end-of-generation set, so a model stops where
its template closes a turn even when the GGUF's metadata does not list that token.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import jinja2
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from edge_engine.errors import InvalidInput

if TYPE_CHECKING:
    from edge_engine.llama_model import LlamaModel

log = logging.getLogger(__name__)

_MARK = "\x00tierlane-answer\x00"  # assistant content whose end locates the end-of-turn text
PROBE: list[dict[str, str]] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


class ChatTemplateError(RuntimeError):
    """The model's chat template is missing or cannot be used; raised at engine start."""


class ChatTemplate:
    """The model's own template; chat prompts carry their special tokens in the text.

    `template` replaces the GGUF's (for a GGUF that carries none, e.g. a base model).
    """

    def __init__(self, model: LlamaModel, template: str | None = None) -> None:
        text = template if template is not None else model.metadata("tokenizer.chat_template")
        if not text:
            raise ChatTemplateError(
                f"{model.path.name} has no tokenizer.chat_template in its metadata (a base model, or a GGUF "
                "converted without its tokenizer_config.json): the edge engine needs an instruct model's template"
            )
        self._setup(text, bos_token=model.bos_text, eos_token=model.eos_text, source=model.path.name)

    @classmethod
    def from_text(cls, template: str, *, bos_token: str, eos_token: str, source: str = "template") -> ChatTemplate:
        """A template from its text alone (no model loaded); `source` names it in errors."""
        self = cls.__new__(cls)
        self._setup(template, bos_token=bos_token, eos_token=eos_token, source=source)
        return self

    def _setup(self, template: str, *, bos_token: str, eos_token: str, source: str) -> None:
        self.source = source
        self.template = template
        try:
            self._with_prompt = Jinja2ChatFormatter(template=template, eos_token=eos_token, bos_token=bos_token)
            self._without_prompt = Jinja2ChatFormatter(
                template=template, eos_token=eos_token, bos_token=bos_token, add_generation_prompt=False
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{source}: its chat template does not compile: {exc}") from exc
        self.folds_system = False
        try:
            self._render(PROBE, True)
        except Exception as exc:  # noqa: BLE001 - any failure of the model's template is reported, with its text
            try:
                self._render(PROBE[1:], True)
            except Exception as exc2:
                raise ChatTemplateError(
                    f"{source}: its chat template cannot render a user/assistant conversation: {_why(exc2)}"
                ) from exc2
            # templates that refuse the system role (e.g. Gemma 2) get it as the first user turn's preamble
            self.folds_system = True
            log.info("%s: the chat template refuses a system message (%s); it is folded into the first user turn", source, _why(exc))
        with_prompt = self.render(PROBE, add_generation_prompt=True)
        without = self.render(PROBE, add_generation_prompt=False)
        if not (len(with_prompt) > len(without) and with_prompt.startswith(without)):
            raise ChatTemplateError(
                f"{source}: its chat template ignores add_generation_prompt (no assistant turn is opened after "
                "the last user message), so the model would continue the user's text"
            )
        self.generation_prompt = with_prompt[len(without):]
        closed = self._render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _MARK}], False)
        after = closed.split(_MARK, 1)[1] if _MARK in closed else ""
        self.end_of_turn = after.strip()

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        plain = [{**m, "content": _text_content(m.get("content"), i)} for i, m in enumerate(messages)]
        if self.folds_system:
            plain = _fold_system(plain)
        try:
            return self._render(plain, add_generation_prompt)
        except Exception as exc:  # the template raises for roles or orders it does not accept
            raise InvalidInput(f"the edge model's chat template rejected the messages: {exc}", param="messages") from exc

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        formatter = self._with_prompt if add_generation_prompt else self._without_prompt
        # the formatter's TypedDict messages are what `messages` holds, checked by the wire model
        return formatter(messages=cast(Any, list(messages))).prompt


def stop_tokens(model: LlamaModel, template: ChatTemplate) -> frozenset[int]:
    """llama.cpp's end-of-generation tokens plus the token the template closes an assistant turn with.

    Raises ChatTemplateError when the template closes a turn with a special token the vocabulary
    does not have (a template from another model family).
    """
    eog = model.end_of_generation_tokens()
    marker = template.end_of_turn
    if not marker:
        return eog
    ids = model.tokenize(marker, add_special=False, parse_special=True)
    first = ids[0] if ids else None
    if first is not None and first in eog:
        return eog
    if len(ids) == 1 and first is not None and model.is_special(first):
        log.info("%s: %r closes an assistant turn in the chat template; it also ends generation", template.source, marker)
        return eog | {first}
    if marker.startswith("<") and len(ids) > 1 and not any(model.is_special(t) for t in ids):
        raise ChatTemplateError(
            f"{template.source}: the chat template closes an assistant turn with {marker!r}, which is not a token "
            "of this model's vocabulary (a template of another model family?)"
        )
    return eog


def _fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system = [m["content"] for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    if not system:
        return rest
    preamble = "\n\n".join(s for s in system if s)
    for i, m in enumerate(rest):
        if m.get("role") == "user":
            rest[i] = {**m, "content": f"{preamble}\n\n{m['content']}" if preamble else m["content"]}
            return rest
    return [{"role": "user", "content": preamble}, *rest]


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


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
