"""The Responses API's request model, and its translation into a chat body and back into a Response."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag

from gateway import protocol
from gateway.apis.common import first_choice, new_id, tool_calls
from gateway.apis.field_policy import Dropped, KnownFields
from gateway.apis.messages_wire import text_or_parts
from gateway.apis.responses_tools import ToolSet, custom_arguments, local_shell_arguments
from gateway.context import Usage
from gateway.errors import InvalidRequest

# NOTE: strict like gateway.protocol. A field the gateway does not know is dropped and recorded
# (apis.unknown_fields: drop, the default) or refused (reject); these known ones are dropped and
# recorded on the span and in x-tierlane-dropped: none changes what the answer says.
DROPPED_FIELDS = ("reasoning", "truncation", "service_tier", "include", "prompt_cache_key", "safety_identifier",
                  "stream_options", "top_logprobs", "max_tool_calls", "prompt_cache_retention", "prompt_cache_options",
                  "context_management", "client_metadata")
# Input items of tools the provider ran (their results are not the client's to replay): the
# hosted-tools policy, like the tools themselves.
HOSTED_ITEMS = ("web_search_call", "file_search_call", "code_interpreter_call", "computer_call", "computer_call_output",
                "image_generation_call", "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
                "shell_call", "shell_call_output")
Number = protocol.Number


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputText(_Open):
    type: Literal["input_text"]
    text: StrictStr


class OutputText(_Open):
    type: Literal["output_text"]
    text: StrictStr


class Refusal(_Open):
    type: Literal["refusal"]
    refusal: StrictStr


class InputImage(_Open):
    type: Literal["input_image"]
    image_url: StrictStr | None = None
    file_id: StrictStr | None = None
    detail: Literal["low", "high", "auto"] | None = None


class InputFile(_Open):
    type: Literal["input_file"]


Part = Annotated[InputText | OutputText | Refusal | InputImage | InputFile, Field(discriminator="type")]


class MessageItem(_Open):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[Part]
    id: StrictStr | None = None


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    namespace: StrictStr | None = None
    id: StrictStr | None = None


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[Part]
    id: StrictStr | None = None


class ReasoningItem(_Open):
    type: Literal["reasoning"]


class CustomToolCallItem(_Open):
    type: Literal["custom_tool_call"]
    call_id: StrictStr
    name: StrictStr
    input: StrictStr
    namespace: StrictStr | None = None
    id: StrictStr | None = None


class CustomToolCallOutputItem(_Open):
    type: Literal["custom_tool_call_output"]
    call_id: StrictStr
    output: StrictStr | list[Part]
    id: StrictStr | None = None


class ToolSearchCallItem(_Open):
    type: Literal["tool_search_call"]
    call_id: StrictStr | None = None
    arguments: dict[str, Any] | StrictStr | None = None
    id: StrictStr | None = None


class ToolSearchOutputItem(_Open):
    type: Literal["tool_search_output"]
    call_id: StrictStr | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    id: StrictStr | None = None


class AdditionalToolsItem(_Open):
    """More tools for this request, sent as an input item (Codex's default models do so)."""

    type: Literal["additional_tools"]
    tools: list[dict[str, Any]]
    id: StrictStr | None = None


class LocalShellCallItem(_Open):
    """A command the model asked the client's `local_shell` tool to run: a chat call of `local_shell`."""

    type: Literal["local_shell_call"]
    call_id: StrictStr | None = None
    action: dict[str, Any]
    status: StrictStr | None = None
    id: StrictStr | None = None


class LocalShellCallOutputItem(_Open):
    """What the command printed: the chat call's tool result (`id` names the call where `call_id` is absent)."""

    type: Literal["local_shell_call_output"]
    output: StrictStr
    call_id: StrictStr | None = None
    status: StrictStr | None = None
    id: StrictStr | None = None


class OtherItem(_Open):
    """An item type the gateway does not know: the field policy decides (drop and record, or 400)."""

    type: StrictStr


_ITEM_TAGS = frozenset({"message", "function_call", "function_call_output", "reasoning", "custom_tool_call",
                        "custom_tool_call_output", "tool_search_call", "tool_search_output", "additional_tools",
                        "local_shell_call", "local_shell_call_output"})


def _item_type(value: Any) -> str | None:
    """An item's tag: its `type` (`other` for one the gateway does not know), or `message` for `{role, content}`."""
    tag = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(tag, str):
        return None
    return tag if tag in _ITEM_TAGS else "other"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ToolSearchCallItem, Tag("tool_search_call")]
    | Annotated[ToolSearchOutputItem, Tag("tool_search_output")]
    | Annotated[AdditionalToolsItem, Tag("additional_tools")]
    | Annotated[LocalShellCallItem, Tag("local_shell_call")]
    | Annotated[LocalShellCallOutputItem, Tag("local_shell_call_output")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_type),
]


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: StrictStr


class AllowedTools(BaseModel):
    """`tool_choice: {type: allowed_tools}`: the model may call only these of the request's tools."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class TextConfig(_Open):
    format: dict[str, Any] | None = None
    verbosity: StrictStr | None = None


class ResponsesRequest(KnownFields):
    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1)
    input: StrictStr | list[Item] | None = None
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | AllowedTools | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1, le=protocol.MAX_TOKENS)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, ge=0, le=1)
    text: TextConfig | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    background: StrictBool | None = None
    # accepted and dropped (DROPPED_FIELDS)
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: StrictStr | None = None
    include: list[StrictStr] | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    max_tool_calls: StrictInt | None = Field(None, ge=1)
    prompt_cache_options: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None  # a client's own ids (Codex: its session, thread and turn)
    # Refused: each would change what the answer means, and none can be honoured here
    conversation: Any = None
    prompt: Any = None

    def tool_set(self, items: list[dict[str, Any]], dropped: Dropped) -> ToolSet:
        """The request's tools (and those its items add) as chat tools; hosted tools go by the policy."""
        tools = ToolSet()
        for i, tool in enumerate(self.tools or ()):
            tools.add(tool, f"tools[{i}]", dropped)
        for i, item in enumerate(items):
            if item.get("type") in ("additional_tools", "tool_search_output"):
                for j, tool in enumerate(item.get("tools") or ()):
                    tools.add(tool, f"input[{i}].tools[{j}]", dropped)
        return tools


# Items ---------------------------------------------------------------------------------------


_ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "custom_tool_call": "ctc_", "tool_search_call": "tsc_",
                "local_shell_call": "lsh_"}


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as stored items, each with an id (what GET .../input_items lists)."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"id": new_id("msg_"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": req.input}]}]
    items: list[dict[str, Any]] = []
    for item in req.input:
        data = item.model_dump(exclude_none=True)
        if isinstance(item, MessageItem):
            content = item.content
            kind = "output_text" if item.role == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": content}] if isinstance(content, str) else data["content"]
            data.setdefault("status", "completed")
        data["id"] = getattr(item, "id", None) or new_id(_ID_PREFIXES.get(item.type, "item_"))
        items.append(data)
    return items


def _text(parts: Any) -> str:
    if isinstance(parts, str):
        return parts
    return "".join(str(p.get("text") or p.get("refusal") or "") for p in parts if isinstance(p, dict))


def _user_content(parts: list[dict[str, Any]], param: str) -> str | list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind in ("input_text", "output_text"):
            out.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image" and part.get("image_url"):
            image = {"url": part["image_url"]}
            if part.get("detail"):
                image["detail"] = part["detail"]
            out.append({"type": "image_url", "image_url": image})
        else:
            raise InvalidRequest(
                f"{kind} content needs the provider's file storage, which the gateway does not have; send the data inline",
                param=f"{param}[{j}]",
            )
    # text only: one string (one cache entry with the same chat text; what self-hosted templates take)
    return text_or_parts(out)


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A tool call joins the assistant turn before it (the calls of one turn share its message)."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def to_messages(instructions: str | None, items: list[dict[str, Any]], tools: ToolSet | None = None,
                dropped: Dropped | None = None) -> list[dict[str, Any]]:
    """Chat messages for a conversation of items (the stored context, then the new input)."""
    tools = ToolSet() if tools is None else tools
    dropped = Dropped() if dropped is None else dropped
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        kind = item.get("type")
        if kind == "message":
            role = item["role"]
            if role == "assistant":
                messages.append({"role": "assistant", "content": _text(item["content"])})
            else:
                content = _user_content(item["content"], f"input[{i}].content")
                messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            name = tools.chat_name(item["name"], item.get("namespace"))
            _add_call(messages, _call(item["call_id"], name, item["arguments"]))
        elif kind == "custom_tool_call":
            name = tools.chat_name(item["name"], item.get("namespace"), "custom")
            _add_call(messages, _call(item["call_id"], name, custom_arguments(item["input"])))
        elif kind == "tool_search_call":
            arguments = item.get("arguments")
            text = arguments if isinstance(arguments, str) else orjson.dumps(arguments or {}).decode()
            _add_call(messages, _call(item.get("call_id") or item.get("id") or new_id("call_"),
                                      tools.chat_name("tool_search", None, "tool_search"), text))
        elif kind == "local_shell_call":
            _add_call(messages, _call(item.get("call_id") or item.get("id") or new_id("call_"),
                                      tools.chat_name("local_shell", None, "local_shell"),
                                      local_shell_arguments(item.get("action") or {})))
        elif kind == "local_shell_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id") or item.get("id") or "",
                             "content": _text(item.get("output") or "")})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
        elif kind == "tool_search_output":
            found = [t.get("name") for t in item.get("tools") or () if isinstance(t, dict)]
            messages.append({"role": "tool", "tool_call_id": item.get("call_id") or "",
                             "content": "Tools now available: " + ", ".join(str(n) for n in found if n)})
        elif kind == "reasoning":
            dropped.add("reasoning_items")  # a chat upstream has no such state
        elif kind == "additional_tools":
            continue  # its tools are in `tools`
        elif kind in HOSTED_ITEMS:
            dropped.hosted(str(kind), f"input[{i}]", name=f"input.{kind}")
        else:
            dropped.unknown_item(str(kind), f"input[{i}]")
    if not messages or all(m["role"] == "system" for m in messages):
        raise InvalidRequest("the request has no input: send `input` (text or items)", param="input",
                             code="missing_required_parameter")
    return messages


def to_chat(req: ResponsesRequest, raw: dict[str, Any], items: list[dict[str, Any]],
            record: Dropped | None = None) -> tuple[dict[str, Any], list[str]]:
    """The chat-completions body for `req` over the conversation `items`, and the fields it dropped.

    `raw` is the body `req` was validated from: numbers are passed on as the client wrote them
    (`0` stays `0`, not `0.0`), so the cache key equals that of the same chat request.
    """
    body, dropped, _ = translate(req, raw, items, record)
    return body, dropped


def translate(req: ResponsesRequest, raw: dict[str, Any], items: list[dict[str, Any]],
              record: Dropped | None = None) -> tuple[dict[str, Any], list[str], ToolSet]:
    """`to_chat`, and the tool set that maps the model's calls back to the client's items."""
    for name in ("background", "conversation", "prompt"):
        if getattr(req, name):
            raise InvalidRequest(f"`{name}` is not supported by the gateway: it needs state the provider keeps",
                                 param=name, code="unsupported_parameter")
    dropped = Dropped() if record is None else record
    dropped.unknown(req)
    for name in DROPPED_FIELDS:
        if getattr(req, name) is not None:
            dropped.add(name)
    if req.text is not None and req.text.verbosity is not None:
        dropped.add("text.verbosity")
    tools = req.tool_set(items, dropped)
    body: dict[str, Any] = {"model": req.model, "messages": to_messages(req.instructions, items, tools, dropped)}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "user"):
        if getattr(req, name) is not None:
            body[name] = raw[name]
    chat_tools = tools.chat
    choice = req.tool_choice
    if isinstance(choice, AllowedTools):
        # NOTE: chat has no "allowed tools" choice: only the allowed tools are sent upstream (the
        # full list is not), so the model cannot call the others; the mode becomes auto/required.
        allowed = tools.allowed(choice.tools)
        chat_tools = [tool for tool in chat_tools if tool["function"]["name"] in allowed]
    if chat_tools:
        body["tools"] = chat_tools
        if req.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = raw["parallel_tool_calls"]
    if isinstance(choice, AllowedTools):
        if chat_tools:
            body["tool_choice"] = choice.mode
    elif choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": tools.chat_name(choice.name)}}
    response_format = _response_format(req.text.format if req.text is not None else None)
    if response_format is not None:
        body["response_format"] = response_format
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # the final event reports usage
    return body, list(dropped.names), tools


def _response_format(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    if spec is None or spec.get("type") == "text":
        return None
    if spec.get("type") == "json_object":
        return {"type": "json_object"}
    if spec.get("type") == "json_schema" and isinstance(spec.get("schema"), dict):
        schema = {k: spec[k] for k in ("name", "schema", "strict", "description") if k in spec}
        schema.setdefault("name", "output")
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest("text.format must be text, json_object or json_schema (with a `schema`)", param="text.format")


# Answers -------------------------------------------------------------------------------------


def message_item_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


def call_item_id(response_id: str, index: int) -> str:
    return f"fc_{response_id.removeprefix('resp_')}_{index}"


def usage_block(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_input_tokens},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }


def status_of(reason: str | None) -> tuple[str, dict[str, str] | None]:
    """The response status and incomplete_details for a chat finish reason."""
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def envelope(req: ResponsesRequest, response_id: str, created_at: int, model: str) -> dict[str, Any]:
    """The Response object before any output: the request's settings as the API echoes them."""
    text_format = (req.text.format if req.text is not None else None) or {"type": "text"}
    tool_choice: Any = req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text_format},
        "tool_choice": tool_choice or "auto",
        "tools": list(req.tools or ()),
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def output_items(response_id: str, body: dict[str, Any], tools: ToolSet | None = None) -> list[dict[str, Any]]:
    """The output items of a chat answer: its text as one message, then one item per tool call."""
    message, reason = first_choice(body)
    item_status = "incomplete" if status_of(reason)[0] == "incomplete" else "completed"
    output: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        output.append(message_item(response_id, text, item_status))
    for index, (call_id, name, arguments) in enumerate(tool_calls(message)):
        output.append(call_item(response_id, index, call_id, name, arguments, "completed", tools))
    return output


def message_item(response_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": message_item_id(response_id), "type": "message", "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(response_id: str, index: int, call_id: str, name: str, arguments: str, status: str,
              tools: ToolSet | None = None) -> dict[str, Any]:
    """The item for the model's call of the chat tool `name`: a function, custom tool or tool search call."""
    return (tools or ToolSet()).call_item(call_item_id(response_id, index), call_id, name, arguments, status)
