"""The Responses API's request model, and its translation into a chat body and back into a Response."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag

from gateway import protocol
from gateway.apis.common import first_choice, new_id, tool_calls
from gateway.context import Usage
from gateway.errors import InvalidRequest

# NOTE: strict like gateway.protocol. Unknown top-level fields are refused (their meaning would
# be lost); these are accepted, dropped and recorded on the span: none changes what the answer says.
DROPPED_FIELDS = ("reasoning", "truncation", "service_tier", "include", "prompt_cache_key", "safety_identifier",
                  "stream_options", "top_logprobs", "max_tool_calls", "prompt_cache_retention", "prompt_cache_options",
                  "context_management")
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
    id: StrictStr | None = None


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[Part]
    id: StrictStr | None = None


class ReasoningItem(_Open):
    type: Literal["reasoning"]


def _item_type(value: Any) -> str | None:
    """An item's tag: its `type`, or `message` for the short form `{role, content}`."""
    if isinstance(value, dict):
        tag = value.get("type", "message")
        return tag if isinstance(tag, str) else None
    return getattr(value, "type", None)


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Open):
    type: Literal["function"]
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: StrictStr


class TextConfig(_Open):
    format: dict[str, Any] | None = None
    verbosity: StrictStr | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr = Field(min_length=1)
    input: StrictStr | list[Item] | None = None
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
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

    def function_tools(self) -> list[FunctionTool]:
        """The tools, each a function tool; a tool the gateway cannot run is a 400 naming it."""
        out = []
        for i, tool in enumerate(self.tools or ()):
            kind = tool.get("type")
            if kind != "function":
                raise InvalidRequest(
                    f"the gateway cannot run the tool {kind!r}: it serves function tools only (the client runs them)",
                    param=f"tools[{i}].type",
                    code="unsupported_tool",
                )
            out.append(protocol.check(FunctionTool, tool))
        return out


# Items ---------------------------------------------------------------------------------------


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
        data["id"] = getattr(item, "id", None) or new_id({"message": "msg_", "function_call": "fc_"}.get(item.type, "item_"))
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
    # one text part asks what the same text as a string asks (one cache entry with chat)
    return out[0]["text"] if len(out) == 1 and out[0]["type"] == "text" else out


def to_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for a conversation of items (the stored context, then the new input)."""
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
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the calls of one turn share its message
                if not last["content"]:
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
    if not messages or all(m["role"] == "system" for m in messages):
        raise InvalidRequest("the request has no input: send `input` (text or items)", param="input",
                             code="missing_required_parameter")
    return messages


def to_chat(req: ResponsesRequest, raw: dict[str, Any], items: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The chat-completions body for `req` over the conversation `items`, and the fields it dropped.

    `raw` is the body `req` was validated from: numbers are passed on as the client wrote them
    (`0` stays `0`, not `0.0`), so the cache key equals that of the same chat request.
    """
    if req.background:
        raise InvalidRequest("background responses are not supported by the gateway", param="background")
    dropped = [name for name in DROPPED_FIELDS if getattr(req, name) is not None]
    if req.text is not None and req.text.verbosity is not None:
        dropped.append("text.verbosity")
    if any(item.get("type") == "reasoning" for item in items):
        dropped.append("reasoning_items")
    body: dict[str, Any] = {"model": req.model, "messages": to_messages(req.instructions, items)}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        if getattr(req, name) is not None:
            body[name] = raw[name]
    tools = req.function_tools()
    if tools:
        body["tools"] = [_chat_tool(tool) for tool in tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
    response_format = _response_format(req.text.format if req.text is not None else None)
    if response_format is not None:
        body["response_format"] = response_format
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # the final event reports usage
    return body, dropped


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


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
    tool_choice: Any = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else req.tool_choice
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
        "tools": [t.model_dump(exclude_none=True) for t in req.function_tools()],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def output_items(response_id: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of a chat answer: its text as one message, then one item per tool call."""
    message, reason = first_choice(body)
    item_status = "incomplete" if status_of(reason)[0] == "incomplete" else "completed"
    output: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        output.append(message_item(response_id, text, item_status))
    for index, (call_id, name, arguments) in enumerate(tool_calls(message)):
        output.append(call_item(response_id, index, call_id, name, arguments, "completed"))
    return output


def message_item(response_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": message_item_id(response_id), "type": "message", "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(response_id: str, index: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": call_item_id(response_id, index), "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}
