"""Wire models: validation of OpenAI request bodies.

The models only validate; the body forwarded upstream is the client's own JSON, so fields
this gateway does not know about pass through untouched.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.errors import InvalidRequest


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Open):
    type: str


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role not in ("assistant", "function") and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content")
        return self


class StreamOptions(_Open):
    include_usage: bool | None = None


class _Sampling(_Open):
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None

    @model_validator(mode="after")
    def _stop_list(self) -> _Sampling:
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return self


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)


class EmbeddingRequest(_Open):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1)


_MODELS: dict[str, type[_Open]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "embeddings": EmbeddingRequest,
}


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(("function-", "list[", "str", "int")) and "[" not in part:
            out += f".{part}" if out else part
    return out


def parse_body(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body or raise a 400 that says what is wrong."""
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
    return body


def validate(operation: str, body: dict[str, Any], *, max_n: int) -> None:
    """Check `body` against the wire model of `operation`; raise InvalidRequest with `param`."""
    try:
        model = _MODELS[operation].model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = _param(tuple(first["loc"]))
        message = first["msg"].removeprefix("Value error, ")
        raise InvalidRequest(
            f"invalid value for '{param}': {message}" if param else message,
            param=param or None,
            code="invalid_value" if first["type"] != "missing" else "missing_required_parameter",
        ) from None
    n = getattr(model, "n", None)
    if n is not None and n > max_n:
        raise InvalidRequest(f"'n' must be at most {max_n}", param="n", code="invalid_value")
