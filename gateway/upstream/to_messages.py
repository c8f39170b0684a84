"""A chat request as Anthropic's Messages API takes it, with the prompt-cache breakpoints placed.

A member whose `apis` leave out `chat` (api.anthropic.com: `apis: [messages]`) gets a chat (or
Responses) client's request here, POSTed to `/messages`. Anthropic caches only what the request
marks: `cache_control: {"type": "ephemeral"}` on at most 4 blocks, a hit being looked up at each
mark and at up to 20 block boundaries before it. A chat client cannot place the marks, so the
gateway does, on:

1. the last tool (the tool list is the start of the cached prefix),
2. the last system block,
3. the last content block of the conversation: the next turn reads everything up to there,
4. the last block of the previous request's conversation (the message before the last assistant
   message): exactly where the previous turn wrote its cache, so the lookup finds it however
   many blocks (parallel tool calls and their results) the last exchange added.

The translation is deterministic and prefix-stable: two consecutive turns of one conversation
give bodies whose shared part is byte-identical (dicts built in one key order, tools in the
client's order, no id or timestamp made up), but for the marks: the last-block mark of turn N
sits on a block that turn N+1 leaves unmarked or marks as its 4th. Anthropic's cache key is the
content, not the marks (a mark only says where to look up and write), so that move costs no hit.

What Messages cannot carry (n > 1, logprobs, a JSON response format, penalties, a request with no
message to answer, ...) is a 400 naming the field, in the client's API shape; hints that do not
change what the answer says (`seed`, `store`, `prompt_cache_key`, `reasoning_effort`, ...) are left
out, and so are values Anthropic refuses that ask for nothing (`top_k` of 0 or less, empty stop
strings). A tool call whose arguments are no JSON object (one cut off by the output limit) goes with
`input: {}` and its text, as written, in a text block just before it: Anthropic refuses such a call,
and a conversation carrying one would be refused on every later turn.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.errors import InvalidRequest

PATH = "/messages"
VERSION_HEADER = "anthropic-version"
VERSION = "2023-06-01"
# Messages requires max_tokens; a client that set none, on a member without max_output_tokens, gets this.
DEFAULT_MAX_TOKENS = 4096
MAX_BREAKPOINTS = 4
EPHEMERAL = {"type": "ephemeral"}
# What stands before a tool call whose arguments are no JSON object, the call itself going with none.
UNPARSED_ARGUMENTS = ("[The arguments of this call of {name} ({id}) are not a JSON object (cut off by the output "
                      "limit, or malformed), so the call goes with no input. The arguments as written: {arguments}]")

# Fields the translation reads.
_CARRIED = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                      "stop", "stream", "tools", "tool_choice", "parallel_tool_calls", "user"})
# Fields left out: they ask nothing of the answer's content (hints, storage, the gateway's own cache keys).
_IGNORED = frozenset({"stream_options", "seed", "store", "metadata", "service_tier", "prompt_cache_key",
                      "prompt_cache_retention", "cache_salt", "safety_identifier", "reasoning_effort", "verbosity"})
_DATA_URI = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+);base64,(?P<data>.*)", re.DOTALL)


def translated_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers of a Messages request the gateway made itself: the client's `anthropic-*` headers
    left out and the gateway's own `anthropic-version` in. A client's `anthropic-beta` would opt the
    operator's account into betas (a 1M context, ...) that the body was not written for and that the
    tiers' prices do not know."""
    out = {name: value for name, value in headers.items() if not name.lower().startswith("anthropic-")}
    out[VERSION_HEADER] = VERSION
    return out


def _refuse(field: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{why}: the upstream serves the Messages API, which cannot carry {field!r}", param=field,
                          code="unsupported_parameter")


def _check_fields(body: Mapping[str, Any]) -> None:
    """A 400 naming the first field the Messages API cannot carry with its meaning."""
    for name, value in body.items():
        if name in _CARRIED or name in _IGNORED or value is None:
            continue
        if name == "n" and value == 1:
            continue
        if name in ("logprobs", "echo") and value is False:
            continue
        if name in ("presence_penalty", "frequency_penalty", "top_logprobs") and value == 0:
            continue
        if name == "logit_bias" and not value:
            continue
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        if name == "modalities" and value == ["text"]:
            continue
        raise _refuse(name, f"{name!r} is not supported here")


def to_messages(body: Mapping[str, Any], default_max_tokens: int | None = None) -> dict[str, Any]:
    """The Messages request for the chat request `body` (already adapted to the member), marks placed."""
    _check_fields(body)
    chat = body.get("messages")
    if not isinstance(chat, list):
        raise InvalidRequest("'messages' must be a list", param="messages")
    lead = 0
    while lead < len(chat) and isinstance(chat[lead], dict) and chat[lead].get("role") in ("system", "developer"):
        lead += 1
    system = [block for i in range(lead) for block in _text_blocks(chat[i].get("content"), f"messages[{i}].content")]
    messages = _conversation(chat, lead)
    if not messages:
        raise InvalidRequest("the upstream serves the Messages API, which needs at least one user or assistant "
                             "message with content: this request has none besides its system messages",
                             param="messages")
    out: dict[str, Any] = {"model": body.get("model")}
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens or DEFAULT_MAX_TOKENS
    out["max_tokens"] = limit
    if system:
        out["system"] = system
    out["messages"] = messages
    tools = _tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls"))
        if choice is not None:
            out["tool_choice"] = choice
    temperature = body.get("temperature")
    if temperature is not None:
        if temperature > 1:
            raise InvalidRequest("the upstream serves the Messages API, whose temperature runs from 0 to 1",
                                 param="temperature")
        out["temperature"] = temperature
    if body.get("top_p") is not None:
        out["top_p"] = body["top_p"]
    top_k = body.get("top_k")
    if isinstance(top_k, int) and top_k > 0:  # 0 and -1 mean "no top-k" elsewhere; Anthropic refuses them
        out["top_k"] = top_k
    stop = body.get("stop")
    stops = [s for s in ([stop] if isinstance(stop, str) else stop or ()) if s]  # Anthropic refuses empty ones
    if stops:
        out["stop_sequences"] = stops
    if isinstance(body.get("user"), str) and body["user"]:
        out["metadata"] = {"user_id": body["user"]}
    if body.get("stream"):
        out["stream"] = True
    place_breakpoints(out)
    return out


def _conversation(chat: list[Any], start: int) -> list[dict[str, Any]]:
    """The chat messages from `start` as Messages turns: tool results of one exchange in one user turn."""
    out: list[dict[str, Any]] = []
    results: list[dict[str, Any]] | None = None  # the user turn that consecutive tool messages fill
    held: list[dict[str, Any]] = []  # system text met among one exchange's tool results: after them
    for i in range(start, len(chat)):
        message = chat[i]
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        role = message.get("role")
        if role == "tool":
            if results is None:
                results = []
                out.append({"role": "user", "content": results})
            results.append(_tool_result(message, where))
            continue
        if role in ("system", "developer") and results is not None and _more_results(chat, i + 1):
            # NOTE: Anthropic takes a user turn's tool_result blocks first: the text of a system message
            # between two results of one exchange follows the last of them, in the same turn
            held += _text_blocks(message.get("content"), f"{where}.content")
            continue
        if results is not None:
            results += held
            held = []
        results = None
        if role in ("system", "developer"):
            # NOTE: a system message after the conversation began stays where it was, as a user turn of
            # its own: moving it into `system` would rewrite the cached prefix of every later turn.
            # Anthropic joins consecutive user turns into one.
            blocks = _text_blocks(message.get("content"), f"{where}.content")
            role = "user"
        elif role == "user":
            blocks = _user_blocks(message.get("content"), f"{where}.content")
        elif role == "assistant":
            blocks = _assistant_blocks(message, where)
        else:
            raise _refuse(f"{where}.role", f"the role {role!r} is not supported here")
        if blocks:  # a message with nothing in it (empty text) is left out: Messages refuses empty content
            out.append({"role": role, "content": blocks})
    if results is not None:
        results += held
    return out


def _more_results(chat: list[Any], start: int) -> bool:
    """Whether a tool message follows from `start` with only system or developer messages before it."""
    for message in chat[start:]:
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("system", "developer"):
            return role == "tool"
    return False


def _text(text: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(text, str):
        raise InvalidRequest(f"{where} must be a string", param=where)
    return [{"type": "text", "text": text}] if text else []  # Messages refuses empty text blocks


def _text_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A system message's content as text blocks."""
    return _user_blocks(content, where, images=False)


def _user_blocks(content: Any, where: str, images: bool = True) -> list[dict[str, Any]]:
    """A message's content as text blocks, and image blocks where `images`."""
    if content is None:
        return []
    if isinstance(content, str):
        return _text(content, where)
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of parts", param=where)
    blocks: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            blocks += _text(part.get("text"), f"{where}[{j}].text")
        elif kind == "image_url" and images:
            blocks.append(_image(part.get("image_url"), f"{where}[{j}].image_url"))
        elif not images:
            raise _refuse(f"{where}[{j}]", "a system message may hold only text here")
        else:
            raise _refuse(f"{where}[{j}]", f"content of type {kind!r} is not supported here")
    return blocks


def _image(spec: Any, where: str) -> dict[str, Any]:
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise InvalidRequest(f"{where}.url must be a string", param=where)
    match = _DATA_URI.fullmatch(url)
    if match is not None:
        return {"type": "image", "source": {"type": "base64", "media_type": match["type"], "data": match["data"]}}
    if url.startswith(("https://", "http://")):
        return {"type": "image", "source": {"type": "url", "url": url}}
    raise _refuse(where, "an image must be a base64 data: URI or an http(s) URL")


def _assistant_blocks(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    content = message.get("content")
    blocks: list[dict[str, Any]] = []
    if isinstance(content, list):  # an assistant's parts: text, or a refusal (as text)
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "refusal"):
                raise _refuse(f"{where}.content[{j}]", f"assistant content of type {kind!r} is not supported here")
            blocks += _text(part.get(kind), f"{where}.content[{j}].{kind}")
    elif content is not None:
        blocks += _text(content, f"{where}.content")
    refusal = message.get("refusal")
    if refusal is not None:  # the model's refusal is what it said: dropping it would drop its turn
        blocks += _text(refusal, f"{where}.refusal")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    for k, call in enumerate(calls):
        at = f"{where}.tool_calls[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{at} needs a function with a name", param=at)
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise InvalidRequest(f"{at} needs an id (Messages pairs each tool result with its call by id)", param=f"{at}.id")
        arguments = function.get("arguments")
        parsed = _arguments(arguments, f"{at}.function.arguments")
        if parsed is None:
            blocks.append({"type": "text", "text": UNPARSED_ARGUMENTS.format(name=function["name"], id=call["id"],
                                                                            arguments=arguments)})
            parsed = {}
        blocks.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": parsed})
    return blocks


def _arguments(arguments: Any, where: str) -> dict[str, Any] | None:
    """A call's arguments (a JSON string) as the object Messages takes; none given is `{}`; None for a
    string that is no JSON object (cut off by the output limit, or malformed)."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        raise InvalidRequest(f"{where} must be a string", param=where)
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _tool_result(message: dict[str, Any], where: str) -> dict[str, Any]:
    call = message.get("tool_call_id")
    if not isinstance(call, str) or not call:
        raise InvalidRequest(f"{where}.tool_call_id is required", param=f"{where}.tool_call_id")
    content = message.get("content")
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call}
    if isinstance(content, str):
        if content:
            block["content"] = content
    elif content is not None:
        parts = _user_blocks(content, f"{where}.content")
        if parts:
            block["content"] = parts
    return block


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not tools:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list", param="tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _refuse(f"tools[{i}]", "only function tools are supported here")
        entry: dict[str, Any] = {"name": function["name"]}
        if isinstance(function.get("description"), str) and function["description"]:
            entry["description"] = function["description"]
        schema = function.get("parameters")
        entry["input_schema"] = schema if isinstance(schema, dict) and schema else {"type": "object", "properties": {}}
        out.append(entry)
    return out


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    out: dict[str, Any]
    if choice is None or choice == "auto":
        out = {"type": "auto"}
    elif choice == "none":
        return {"type": "none"}
    elif choice == "required":
        out = {"type": "any"}
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
        out = {"type": "tool", "name": choice["function"]["name"]}
    else:
        raise InvalidRequest(f"unsupported tool_choice {choice!r}", param="tool_choice")
    if parallel is False:
        out["disable_parallel_tool_use"] = True
    elif choice is None:
        return None  # the client chose nothing: Messages' default (auto) stands
    return out


def place_breakpoints(request: dict[str, Any]) -> None:
    """Mark the last tool, the last system block, the conversation's last block and the previous
    request's last block (see the module's docstring): never more than 4."""
    targets: list[dict[str, Any]] = []
    if request.get("tools"):
        targets.append(request["tools"][-1])
    if request.get("system"):
        targets.append(request["system"][-1])
    messages: list[dict[str, Any]] = request.get("messages") or []
    if messages:
        targets.append(messages[-1]["content"][-1])
        # the previous request ended just before the last assistant message (its answer)
        answered = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
        if 0 < answered < len(messages) - 1:
            targets.append(messages[answered - 1]["content"][-1])
    for block in targets[:MAX_BREAKPOINTS]:
        block["cache_control"] = dict(EPHEMERAL)


def marked(request: Mapping[str, Any]) -> list[str]:
    """Where a Messages request's cache marks are, as paths (`tools[1]`, `system[0]`, `messages[4][1]`)."""
    out = [f"tools[{i}]" for i, t in enumerate(request.get("tools") or ()) if "cache_control" in t]
    system = request.get("system")
    if isinstance(system, list):
        out += [f"system[{i}]" for i, b in enumerate(system) if isinstance(b, dict) and "cache_control" in b]
    for i, message in enumerate(request.get("messages") or ()):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            out += [f"messages[{i}][{j}]" for j, b in enumerate(content) if isinstance(b, dict) and "cache_control" in b]
    return out


def breakpoints(request: Mapping[str, Any]) -> int:
    """How many blocks of a Messages request carry a cache mark."""
    return len(marked(request))


def unmarked(value: Any) -> Any:
    """`value` without its `cache_control` keys: the request as Anthropic's cache keys it (the marks
    say only where to look up and write)."""
    if isinstance(value, dict):
        return {k: unmarked(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [unmarked(v) for v in value]
    return value
