"""The Anthropic Messages API's request model, and its translation into the chat-completions body."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from gateway import protocol
from gateway.apis.field_policy import Dropped, KnownFields
from gateway.errors import InvalidRequest

# NOTE: strict like gateway.protocol: a wrong type is a 400 naming the parameter. A field the
# gateway does not know is dropped and recorded (apis.unknown_fields: drop, the default) or refused
# (reject); the known fields below that do not change what the answer means are dropped and recorded.
DROPPED_FIELDS = ("thinking", "context_management", "service_tier", "inference_geo", "cache_control", "diagnostics",
                  "speed", "user_profile_id", "workspace_id")
# Fields that ask the provider to run something (a code container, MCP servers): the hosted-tools policy.
HOSTED_FIELDS = ("container", "mcp_servers")
Number = protocol.Number


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Closed(KnownFields):
    """Every field known: any other is a newer client's, dropped and recorded (field_policy)."""

    model_config = ConfigDict(extra="allow")


class _Block(_Open):
    cache_control: dict[str, Any] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr


class ImageSource(_Open):
    type: Literal["base64", "url"]
    media_type: StrictStr | None = None
    data: StrictStr | None = None
    url: StrictStr | None = None

    @model_validator(mode="after")
    def _complete(self) -> ImageSource:
        if self.type == "base64" and (self.media_type is None or self.data is None):
            raise ValueError("a base64 image source needs `media_type` and `data`")
        if self.type == "url" and self.url is None:
            raise ValueError("a url image source needs `url`")
        return self

    def data_url(self) -> str:
        return self.url if self.type == "url" else f"data:{self.media_type};base64,{self.data}"  # type: ignore[return-value]


class ImageBlock(_Block):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[ResultPart] | None = None
    is_error: StrictBool | None = None


class ThinkingBlock(_Open):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(_Closed):
    # `system` entries (per-turn instructions, Claude Code's per-turn-control beta) become system
    # messages at their place in the chat conversation
    role: Literal["user", "assistant", "system"]
    content: StrictStr | list[Block]


class Tool(_Open):
    name: StrictStr = Field(min_length=1)
    type: StrictStr | None = None  # absent or "custom" for client tools; a dated name for server tools
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    defer_loading: StrictBool | None = None  # tool search's "load on demand": the chat model gets every tool


class ToolChoice(_Closed):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type tool needs the tool's `name`")
        return self


class Metadata(_Closed):
    user_id: StrictStr | None = None


class OutputFormat(_Closed):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Open):
    effort: StrictStr | None = None  # how hard a Claude model thinks: dropped
    format: OutputFormat | None = None


class _Prompt(_Closed):
    """What a Messages request and a count_tokens request share."""

    model: StrictStr = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's name for output_config.format
    # accepted and dropped (DROPPED_FIELDS)
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    inference_geo: StrictStr | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    speed: StrictStr | None = None
    user_profile_id: StrictStr | None = None
    workspace_id: StrictStr | None = None
    # the hosted-tools policy (HOSTED_FIELDS)
    container: StrictStr | dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None


class MessagesRequest(_Prompt):
    max_tokens: StrictInt = Field(ge=1, le=protocol.MAX_TOKENS)
    stop_sequences: list[StrictStr] | None = Field(None, max_length=4)
    # sampling fields newer SDKs no longer offer; older clients and other SDKs still send them
    temperature: Number | None = Field(None, ge=0, le=1)
    top_p: Number | None = Field(None, ge=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)
    metadata: Metadata | None = None
    stream: StrictBool = False


class CountTokensRequest(_Prompt):
    pass


def to_chat(req: _Prompt, raw: dict[str, Any], record: Dropped | None = None) -> tuple[dict[str, Any], list[str]]:
    """The chat-completions body that asks what `req` asks, and the fields it dropped.

    `raw` is the body `req` was validated from: numbers are passed on as the client wrote them
    (`0` stays `0`, not `0.0`), so the cache key equals that of the same chat request. `record`
    (the operator's field policy; drop by default) collects the dropped names.
    """
    dropped = Dropped() if record is None else record
    dropped.unknown(req)
    for name in DROPPED_FIELDS:
        if getattr(req, name, None) is not None:
            dropped.add(name)
    for name in HOSTED_FIELDS:
        if getattr(req, name, None) is not None:
            dropped.hosted(name, name, name=name)
    config = getattr(req, "output_config", None)
    if config is not None:
        for name in ("effort", *(config.model_extra or {})):
            if getattr(config, name, None) is not None:
                dropped.add(f"output_config.{name}")
    marks = False
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        if isinstance(req.system, str):
            system = req.system
        else:
            system = "\n".join(block.text for block in req.system)
            marks = any(block.cache_control is not None for block in req.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        marks = marks or any(getattr(b, "cache_control", None) is not None for b in message.content)
        if any(isinstance(b, ThinkingBlock) for b in message.content):
            dropped.add("thinking_blocks")
        if message.role == "assistant":
            messages.append(_assistant(message.content, f"messages[{i}].content"))
        elif message.role == "system":
            messages.append(_system(message.content, f"messages[{i}].content"))
        else:
            messages.extend(_user(message.content, f"messages[{i}].content"))
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        marks = marks or any(tool.cache_control is not None for tool in req.tools)
        tools = [_tool(tool, f"tools[{i}]", dropped) for i, tool in enumerate(req.tools)]
        if any(tools):
            body["tools"] = [tool for tool in tools if tool is not None]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
            else {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        )
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if marks:
        dropped.add("cache_control")
    if isinstance(req, MessagesRequest):
        _sampling(req, raw, body)
    return body, list(dropped.names)


def _sampling(req: MessagesRequest, raw: dict[str, Any], body: dict[str, Any]) -> None:
    body["max_tokens"] = req.max_tokens
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = raw[name]
    if req.stop_sequences:
        body["stop"] = list(req.stop_sequences)
    if req.metadata is not None and req.metadata.user_id is not None:
        body["user"] = req.metadata.user_id
    config = req.output_config
    output_format = req.output_format or (config.format if config is not None else None)
    if output_format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": output_format.schema_}}
    if req.stream:
        # usage on every stream: message_delta reports it (stream_options is neutral for the cache)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}


def _tool(tool: Tool, param: str, dropped: Dropped) -> dict[str, Any] | None:
    """A client tool as a chat function tool; a server tool (run by the provider) goes by the hosted-tools policy."""
    if tool.type not in (None, "custom"):
        dropped.hosted(tool.type or "", f"{param}.type")
        return None
    if tool.defer_loading is not None:
        dropped.add("tools.defer_loading")
    if tool.input_schema is None:
        raise InvalidRequest(f"tool {tool.name!r} needs an `input_schema`", param=f"{param}.input_schema")
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema
    return {"type": "function", "function": function}


def _assistant(blocks: list[Any], param: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            arguments = orjson.dumps(block.input).decode()
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif not isinstance(block, ThinkingBlock):
            raise InvalidRequest(f"an assistant turn cannot carry a {block.type} block", param=f"{param}[{j}].type")
    # a string even beside tool calls: many self-hosted chat templates cannot render a null content
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    return out


def _system(blocks: list[Any], param: str) -> dict[str, Any]:
    """A `system` entry inside `messages`: its text blocks as one system message, in place."""
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise InvalidRequest(f"a system entry carries text blocks only, not {block.type}", param=f"{param}[{j}].type")
        texts.append(block.text)
    return {"role": "system", "content": "\n".join(texts)}


def _user(blocks: list[Any], param: str) -> list[dict[str, Any]]:
    """Tool results become tool messages (first, as chat wants them), the rest one user message."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            results.append(_tool_result(block, f"{param}[{j}]"))
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": block.source.data_url()}})
        elif not isinstance(block, ThinkingBlock):
            raise InvalidRequest(f"a user turn cannot carry a {block.type} block", param=f"{param}[{j}].type")
    if not parts:
        return results
    return [*results, {"role": "user", "content": text_or_parts(parts)}]


def text_or_parts(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text-only content as one string (what every self-hosted chat template takes, and what the
    same text sent as a string asks: one cache entry); content with images stays an array."""
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _tool_result(block: ToolResultBlock, param: str) -> dict[str, Any]:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        if any(isinstance(part, ImageBlock) for part in block.content):
            raise InvalidRequest("images in a tool_result cannot be passed on to a chat model", param=f"{param}.content")
        text = "\n".join(part.text for part in block.content if isinstance(part, TextBlock))
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}
