"""The Anthropic Messages API's request model, and its translation into the chat-completions body."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag, model_validator

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


class SearchResultBlock(_Block):
    """A search result the client found (RAG): passed on as text, title and source first."""

    type: Literal["search_result"]
    source: StrictStr
    title: StrictStr
    content: list[TextBlock]
    citations: dict[str, Any] | None = None

    def text(self) -> str:
        return "\n".join([self.title, self.source, *(part.text for part in self.content)])


# what a client's tool result carries: search results too (a client's own search tool)
ToolResultPart = Annotated[TextBlock | ImageBlock | SearchResultBlock, Field(discriminator="type")]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[ToolResultPart] | None = None
    is_error: StrictBool | None = None


class ThinkingBlock(_Open):
    type: Literal["thinking", "redacted_thinking"]


class DocumentSource(_Open):
    """A document's source: plain text (`text`), content blocks (`content`), or what a chat model
    cannot read (a base64 PDF, a URL, a file id)."""

    type: StrictStr
    media_type: StrictStr | None = None
    data: StrictStr | None = None
    url: StrictStr | None = None
    content: StrictStr | list[ResultPart] | None = None


class DocumentBlock(_Block):
    type: Literal["document"]
    source: DocumentSource
    title: StrictStr | None = None
    context: StrictStr | None = None
    citations: dict[str, Any] | None = None

    def text(self) -> str | None:
        """The document as text (its title first), or None when its source is not text."""
        source = self.source
        if source.type == "text" and source.data is not None:
            body = source.data
        elif source.type == "content" and source.content is not None:
            if isinstance(source.content, str):
                body = source.content
            elif all(isinstance(part, TextBlock) for part in source.content):
                body = "\n".join(part.text for part in source.content if isinstance(part, TextBlock))
            else:
                return None
        else:
            return None
        return f"{self.title}\n{body}" if self.title else body


class ContainerUploadBlock(_Block):
    """A file for the provider's code-execution container: the hosted-tools policy."""

    type: Literal["container_upload"]
    file_id: StrictStr | None = None


class ServerToolBlock(_Open):
    """A call of a tool the provider runs (`server_tool_use`, `mcp_tool_use`) or its result
    (`web_search_tool_result`, `code_execution_tool_result`, ...: any `*_tool_result` but the
    client's `tool_result`): a chat upstream cannot run them, so the hosted-tools policy decides."""

    type: StrictStr


_BLOCK_TAGS = frozenset({"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking", "document",
                         "search_result", "container_upload"})
_SERVER_TOOL_USES = frozenset({"server_tool_use", "mcp_tool_use"})


def _block_type(value: Any) -> str | None:
    """A block's tag: its `type`, `server_tool` for the provider's own tools' calls and results."""
    tag = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(tag, str):
        return None
    if tag in _SERVER_TOOL_USES or (tag.endswith("_tool_result") and tag not in _BLOCK_TAGS):
        return "server_tool"
    return "thinking" if tag == "redacted_thinking" else tag


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[DocumentBlock, Tag("document")]
    | Annotated[SearchResultBlock, Tag("search_result")]
    | Annotated[ContainerUploadBlock, Tag("container_upload")]
    | Annotated[ServerToolBlock, Tag("server_tool")],
    Discriminator(_block_type),
]


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
    emptied = False  # the turn before was left empty by dropping: the next one may join its neighbour
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            _append(messages, [{"role": message.role, "content": message.content}], emptied)
            emptied = False
            continue
        marks = marks or any(getattr(b, "cache_control", None) is not None for b in message.content)
        if any(isinstance(b, ThinkingBlock) for b in message.content):
            dropped.add("thinking_blocks")
        param = f"messages[{i}].content"
        if message.role == "assistant":
            turn = _assistant(message.content, param, dropped)
        elif message.role == "system":
            turn = [_system(message.content, param)]
        else:
            turn = _user(message.content, param, dropped)
        if not turn:
            emptied = True
            continue
        _append(messages, turn, emptied)
        emptied = False
    if all(m["role"] == "system" for m in messages):
        raise InvalidRequest("no message is left once the blocks a chat model cannot take are dropped",
                             param="messages", code="missing_required_parameter")
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


def _append(messages: list[dict[str, Any]], turn: list[dict[str, Any]], emptied: bool) -> None:
    """Add a turn's chat messages. After a turn left empty by dropping, a user (or assistant)
    message that would follow one of its own role joins it: chat templates want roles to alternate."""
    first = turn[0]
    last = messages[-1] if messages else None
    if emptied and last is not None and last["role"] == first["role"] and first["role"] in ("user", "assistant") \
            and "tool_calls" not in last:
        if first["role"] == "user":
            parts = [*_as_parts(last["content"]), *_as_parts(first["content"])]
            last["content"] = text_or_parts(parts)
        else:
            last["content"] = "\n".join(text for text in (last["content"], first["content"]) if text)
            if "tool_calls" in first:
                last["tool_calls"] = first["tool_calls"]
        turn = turn[1:]
    messages.extend(turn)


def _as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _server_tool(block: Any, param: str, dropped: Dropped) -> None:
    """A provider-run tool's call or result in the history: the hosted-tools policy."""
    dropped.hosted(str(block.type), f"{param}.type", name=f"messages.content.{block.type}")


def _assistant(blocks: list[Any], param: str, dropped: Dropped) -> list[dict[str, Any]]:
    """The assistant message of a turn; none when every block was dropped (a chat template cannot
    render an assistant message with nothing in it)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            arguments = orjson.dumps(block.input).decode()
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, ServerToolBlock):
            _server_tool(block, f"{param}[{j}]", dropped)
        elif not isinstance(block, ThinkingBlock):
            raise InvalidRequest(f"an assistant turn cannot carry a {block.type} block", param=f"{param}[{j}].type")
    if not texts and not calls and any(isinstance(block, ServerToolBlock) for block in blocks):
        return []
    # a string even beside tool calls: many self-hosted chat templates cannot render a null content
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    return [out]


def _system(blocks: list[Any], param: str) -> dict[str, Any]:
    """A `system` entry inside `messages`: its text blocks as one system message, in place."""
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise InvalidRequest(f"a system entry carries text blocks only, not {block.type}", param=f"{param}[{j}].type")
        texts.append(block.text)
    return {"role": "system", "content": "\n".join(texts)}


def _user(blocks: list[Any], param: str, dropped: Dropped) -> list[dict[str, Any]]:
    """Tool results become tool messages (first, as chat wants them), the rest one user message."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{param}[{j}]"
        if isinstance(block, ToolResultBlock):
            results.append(_tool_result(block, at))
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": block.source.data_url()}})
        elif isinstance(block, SearchResultBlock):
            parts.append({"type": "text", "text": block.text()})
        elif isinstance(block, DocumentBlock):
            text = block.text()
            if text is None:  # a PDF, a URL, a file: a chat model reads text only
                dropped.part("messages.content.document", at, f"a {block.source.type} document")
            else:
                parts.append({"type": "text", "text": text})
        elif isinstance(block, ContainerUploadBlock):
            dropped.hosted(block.type, f"{at}.type", name="messages.content.container_upload")
        elif isinstance(block, ServerToolBlock):
            _server_tool(block, at, dropped)
        elif not isinstance(block, ThinkingBlock):
            raise InvalidRequest(f"a user turn cannot carry a {block.type} block", param=f"{at}.type")
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
        text = "\n".join(part.text if isinstance(part, TextBlock) else part.text() for part in block.content
                         if isinstance(part, TextBlock | SearchResultBlock))
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}
