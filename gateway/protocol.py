"""Wire models: validation of OpenAI request bodies.

The models only validate; the body forwarded upstream is the client's own JSON, so fields
this gateway does not know about pass through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from gateway.errors import InvalidRequest

# NOTE: the wire is validated strictly, once: `"stream": "false"` or `"seed": "12"` is a 400
# naming the parameter, never a value coerced differently by each stage that reads it. Stages
# read the validated model kept on the context (ctx.request), not the raw body.
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
MAX_TOKENS = 2**31 - 1
# Deeper bodies are refused before any stage walks them: hashing (orjson stops at 255 levels)
# and copying them would fail, and no OpenAI request needs more.
MAX_DEPTH = 64


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Open):
    type: StrictStr
    text: StrictStr | None = None

    @model_validator(mode="after")
    def _text_part(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs a string `text`")
        return self


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role not in ("assistant", "function") and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content")
        return self


class StreamOptions(_Open):
    include_usage: StrictBool | None = None


class _Sampling(_Open):
    model: StrictStr = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, ge=0, le=1)
    n: StrictInt | None = Field(None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    # Sampling extensions of vLLM and llama.cpp's server; the edge engine reads these too.
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: Number | None = Field(None, ge=0, le=1)
    repeat_penalty: Number | None = Field(None, gt=0, le=10)

    @model_validator(mode="after")
    def _stop_list(self) -> _Sampling:
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    @property
    def output_limit(self) -> int | None:
        """The most completion tokens asked for (`max_completion_tokens` wins over `max_tokens`)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)


class TranslatedChatRequest(ChatCompletionRequest):
    """A chat body a front door built from its own API's request, validated there already.

    Its messages and tools were made by the gateway from blocks its own API's model checked (see
    gateway/apis/*_wire.py), so they are not validated a second time, nor copied into models: on an
    agent's turn of hundreds of messages that is most of the validation's time. The parameters,
    which a translation copies as the client wrote them, are checked as a chat request's are.
    """

    messages: list[Any] = Field(min_length=1)
    tools: list[Any] | None = None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool | None = None
    best_of: StrictInt | None = Field(None, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=5)


class EmbeddingRequest(_Open):
    model: StrictStr = Field(min_length=1)
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None

    @property
    def stream(self) -> bool:
        return False


WireRequest = ChatCompletionRequest | CompletionRequest | EmbeddingRequest


_MODELS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest] | type[EmbeddingRequest]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "embeddings": EmbeddingRequest,
}


# The names pydantic gives the branches of a union in an error location (not request fields).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "is-instance", "json-or-python", "lax-or-strict"})


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or part.startswith(("function-", "constrained-")):
            continue
        else:
            out += f".{part}" if out else part
    return out


def parse_body(raw: bytes, max_items: int | None = None) -> dict[str, Any]:
    """Decode a JSON object body or raise a 400 that says what is wrong.

    With `max_items`, the item count is checked (cheap: list lengths) before the depth walk,
    which visits every container: a body of 120,000 items is refused without walking them.
    """
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(
            f"the request body is not valid JSON in UTF-8: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    if max_items is not None:
        check_items(body, max_items)
    if _too_deep(body, MAX_DEPTH):
        raise InvalidRequest(f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
    return body


# The lists whose entries a request's validation walks one by one, and their nested lists.
_ITEM_LISTS = ("messages", "input", "tools")
_NESTED_LISTS = ("content", "tools", "output")


def check_items(body: dict[str, Any], limit: int) -> None:
    """A 400 when `body` carries more than `limit` messages, input items, content parts and tools
    in all: validating each costs event-loop time (pydantic holds the GIL), so this bounds it."""
    total = 0
    for name in _ITEM_LISTS:
        entries = body.get(name)
        if not isinstance(entries, list):
            continue
        total += len(entries)
        for entry in entries:
            if isinstance(entry, dict):
                for nested in _NESTED_LISTS:
                    inner = entry.get(nested)
                    if isinstance(inner, list):
                        total += len(inner)
        if total > limit:
            raise InvalidRequest(
                f"the request carries more than {limit} messages, items, content parts and tools "
                "(server.max_items); send a shorter conversation", param=name, code="too_many_items")


def _too_deep(value: Any, limit: int) -> bool:
    """Whether JSON containers nest more than `limit` levels.

    Recursive, but at most `limit` calls deep: it stops at the first container past the limit.
    """
    return isinstance(value, (dict, list)) and _deeper_than(value, limit)


def _deeper_than(node: dict[str, Any] | list[Any], levels: int) -> bool:
    # NOTE: exact types, as orjson returns them: a recursion over the containers alone, without a
    # tuple per node, walks an agent's 1.4 MB conversation in a third of the time of a stack of them
    if levels <= 0:
        return True
    values: Iterable[Any] = node.values() if type(node) is dict else node
    for value in values:
        kind = type(value)
        if (kind is dict or kind is list) and _deeper_than(value, levels - 1):
            return True
    return False


M = TypeVar("M", bound=BaseModel)


def check(model_type: type[M], body: Any) -> M:
    """`body` validated as `model_type`; raises InvalidRequest naming the first bad parameter."""
    try:
        return model_type.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # of a union's branches, the one that got furthest into the value says the most
        first = max(errors, key=lambda e: len(e["loc"]))
        param = _param(tuple(first["loc"]))
        message = first["msg"].removeprefix("Value error, ")
        raise InvalidRequest(
            f"invalid value for '{param}': {message}" if param else message,
            param=param or None,
            code="invalid_value" if first["type"] != "missing" else "missing_required_parameter",
        ) from None


def validate(operation: str, body: dict[str, Any], *, max_n: int, translated: bool = False) -> WireRequest:
    """The validated wire model of `body` for `operation`; raises InvalidRequest with `param`.

    `translated`: a chat body a front door built from a request it validated (TranslatedChatRequest)."""
    model = check(TranslatedChatRequest if translated and operation == "chat" else _MODELS[operation], body)
    n = getattr(model, "n", None)
    if n is not None and n > max_n:
        raise InvalidRequest(f"'n' must be at most {max_n}", param="n", code="invalid_value")
    return model
