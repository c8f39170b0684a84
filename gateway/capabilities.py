"""What the edge lane cannot do, found in a request before it is routed.

`auto` traffic that needs any of it goes upstream with the reason `capability:<name>`; a request
pinned to the edge gets a 400 naming the parameter, never a silently different answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from edge_engine.errors import EngineError
from gateway.errors import InvalidRequest

# Top-level fields the edge lane honours, or that change nothing about the answer itself
# (attribution, storage hints, stream framing). Anything else is a feature the edge does not
# implement: it is reported, not ignored.
_HONOURED = frozenset(
    """model messages prompt stream stream_options max_tokens max_completion_tokens temperature
    top_p n stop seed presence_penalty frequency_penalty user top_k repeat_penalty logprobs
    top_logprobs response_format tools tool_choice parallel_tool_calls functions function_call
    logit_bias min_p echo best_of suffix""".split()
)
_NEUTRAL = frozenset(
    """user metadata store service_tier prompt_cache_key safety_identifier""".split()
)
# chat content part types the edge model reads
_TEXT_PARTS = frozenset({"text", "input_text"})
_PART_CAPABILITY = {"image_url": "image", "input_image": "image", "image": "image", "input_audio": "audio",
                    "audio": "audio", "file": "file", "input_file": "file", "video_url": "video"}


@dataclass(slots=True, frozen=True)
class Gap:
    """One feature of a request that the edge lane does not implement."""

    capability: str  # tools | json_schema | image | audio | context | n | ...
    param: str  # the request parameter that asks for it
    detail: str
    code: str = "unsupported_on_edge"  # the 400's code when the request is pinned to the edge

    @property
    def reason(self) -> str:
        """The route reason recorded when `auto` traffic goes upstream for it."""
        return f"capability:{self.capability}"

    def error(self) -> InvalidRequest:
        """The 400 of a request pinned to the edge lane."""
        return InvalidRequest(
            f"the edge lane does not support {self.detail}; send it with model 'auto' or to an "
            f"upstream model",
            param=self.param,
            code=self.code,
        )


GrammarCompile = Callable[[Mapping[str, Any]], Awaitable[object]]


class EdgeCapabilities:
    """What the running edge engine can serve; asked per request by the route stage and the edge lane."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        # NOTE: the engine's own compiler (edge_engine/grammar.py): the check and the engine take the
        # same bounded path to llama.cpp, so nothing passes here that the engine refuses later.
        self.compile: GrammarCompile | None = getattr(engine, "compile_grammar", None)
        settings = getattr(engine, "settings", None)
        self.default_max_tokens = int(getattr(settings, "default_max_tokens", 256) or 256)

    async def gaps(self, operation: str, body: Mapping[str, Any], *, context: bool = True) -> list[Gap]:
        """The features of `body` the edge cannot serve. `context=False` leaves the size check to
        the engine, which counts tokens exactly (for requests pinned to the edge)."""
        n_ctx = int(getattr(self.engine, "n_ctx", 0) or 0) if context else 0
        gaps = edge_gaps(operation, body, context_tokens=n_ctx, json_mode=self.compile is not None,
                         default_max_tokens=self.default_max_tokens)
        response_format = body.get("response_format")
        if (self.compile is not None and operation in ("chat", "completions") and _structured(response_format)
                and not any(g.param == "response_format" for g in gaps)):
            assert isinstance(response_format, Mapping)
            try:
                await self.compile(response_format)
            except EngineError as exc:
                kind = "json_schema" if response_format.get("type") == "json_schema" else "json"
                gaps.append(Gap(kind, "response_format", f"this response_format ({_first_line(exc)})",
                                code=exc.code or "unsupported_on_edge"))
        return gaps

    async def check_pinned(self, operation: str, body: Mapping[str, Any]) -> None:
        """Raises the 400 of the first feature a request pinned to the edge lane asks for in vain."""
        gaps = await self.gaps(operation, body, context=False)
        if gaps:
            raise gaps[0].error()


def edge_gaps(
    operation: str,
    body: Mapping[str, Any],
    *,
    context_tokens: int,
    json_mode: bool,
    default_max_tokens: int,
) -> list[Gap]:
    """Every feature of `body` that the edge lane cannot serve, but whether its grammar compiles
    (EdgeCapabilities.gaps asks the engine's compiler for that).

    `context_tokens`: the edge model's context window (0: unknown, not checked); `json_mode`:
    whether the engine constrains output by a grammar at all.
    """
    if operation not in ("chat", "completions"):
        return []
    gaps: list[Gap] = []
    for name in body:
        if name not in _HONOURED and name not in _NEUTRAL:
            gaps.append(Gap("param", name, f"the parameter {name!r}"))
    if _present(body.get("tools")) or _present(body.get("functions")):
        param = "tools" if _present(body.get("tools")) else "functions"
        gaps.append(Gap("tools", param, "tools or function calls"))
    elif body.get("tool_choice") not in (None, "none") or body.get("function_call") not in (None, "none"):
        param = "tool_choice" if body.get("tool_choice") not in (None, "none") else "function_call"
        gaps.append(Gap("tools", param, "tool_choice without tools"))
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        gaps.append(Gap("n", "n", "more than one choice per request (n > 1)"))
    best_of = body.get("best_of")
    if isinstance(best_of, int) and best_of > 1:
        gaps.append(Gap("n", "best_of", "best_of > 1"))
    if body.get("echo"):
        gaps.append(Gap("echo", "echo", "echo"))
    if body.get("suffix"):
        gaps.append(Gap("suffix", "suffix", "suffix (insertion)"))
    if body.get("logit_bias"):
        gaps.append(Gap("logit_bias", "logit_bias", "logit_bias"))
    min_p = body.get("min_p")
    if isinstance(min_p, (int, float)) and min_p > 0:
        gaps.append(Gap("min_p", "min_p", "min_p sampling"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and (len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)):
        gaps.append(Gap("batch", "prompt", "several prompts in one request"))
    gaps.extend(_messages(body.get("messages")))
    gaps.extend(_response_format(body.get("response_format"), json_mode))
    if context_tokens > 0:
        gaps.extend(_context(operation, body, context_tokens, default_max_tokens))
    return gaps


def _structured(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("type") in ("json_object", "json_schema")


def _present(value: Any) -> bool:
    return value is not None and value != [] and value != {}


def _messages(messages: Any) -> list[Gap]:
    if not isinstance(messages, list):
        return []
    gaps: list[Gap] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue
        if message.get("role") in ("tool", "function") or _present(message.get("tool_calls")) \
                or _present(message.get("function_call")):
            gaps.append(Gap("tools", f"messages[{i}]", "tool call turns in the conversation"))
        if _present(message.get("audio")):
            gaps.append(Gap("audio", f"messages[{i}].audio", "audio"))
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in _TEXT_PARTS:
                continue
            capability = _PART_CAPABILITY.get(str(kind), "content")
            gaps.append(Gap(capability, f"messages[{i}].content[{j}]", f"{kind!r} content parts"))
    return gaps


def _response_format(value: Any, json_mode: bool) -> list[Gap]:
    if not isinstance(value, Mapping) or value.get("type") in (None, "text"):
        return []
    kind = value.get("type")
    capability = "json_schema" if kind == "json_schema" else "json" if kind == "json_object" else "response_format"
    if not json_mode or capability == "response_format":
        return [Gap(capability, "response_format", f"response_format {kind!r}")]
    return []


def _context(operation: str, body: Mapping[str, Any], context_tokens: int, default_max_tokens: int) -> list[Gap]:
    """A prompt plus its output that cannot fit the edge context, by a bound that never undercounts much.

    NOTE: routing must not tokenize on the event loop; UTF-8 bytes / 3 over-estimates the token
    count of English for this tokenizer family (about 4 bytes a token), so a request kept at the
    edge fits; one sent upstream for it may have fit, which costs a little, not an error.
    """
    if operation == "chat":
        messages = body.get("messages")
        size = sum(_text_bytes(m.get("content")) for m in messages if isinstance(m, Mapping)) if isinstance(messages, list) else 0
        size += 8 * (len(messages) if isinstance(messages, list) else 0)  # chat template tokens per turn
        param = "messages"
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            size = 3 * len(prompt)  # token ids: exact
        else:
            size = _text_bytes(prompt)
        param = "prompt"
    wanted = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    estimate = size // 3 + (wanted if isinstance(wanted, int) else default_max_tokens)
    if estimate <= context_tokens:
        return []
    return [Gap("context", param if size // 3 >= context_tokens else "max_tokens",
                f"a prompt and max_tokens beyond its {context_tokens}-token context (about {estimate} tokens)")]


def _text_bytes(content: Any) -> int:
    if isinstance(content, str):
        return len(content.encode("utf-8", "surrogatepass"))
    if isinstance(content, list):
        return sum(_text_bytes(p.get("text") if isinstance(p, Mapping) else p) for p in content)
    return 0


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "message", None) or exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
