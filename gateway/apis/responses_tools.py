"""Responses API tools as chat function tools, and the model's calls as the items the client runs.

A chat upstream knows one kind of tool, the function with JSON arguments. The Responses API has
more that the *client* runs, and they translate without loss:
- `function` tools, also nested in a `namespace` (Codex groups its tools so): function tools;
- `custom` tools (freeform text input, optionally constrained by a grammar, e.g. Codex's
  `apply_patch`): a function with one string argument `input`, the grammar stated at the end of
  its description (not enforced), whose calls go back as `custom_tool_call` items carrying that text;
- `tool_search` with `execution: client`: a function with the tool's own parameters, whose calls go
  back as `tool_search_call` items; the `tool_search_output` the client returns adds the tools it
  found for the next call;
- `local_shell` (Codex's older shell tool): a function `local_shell` whose arguments are the exec
  action (`command`, `workdir`, `timeout_ms`, `env`), whose calls go back as `local_shell_call` items;
  the client's `local_shell_call_output` is the call's result.
Tools the provider would run (web search, file search, code interpreter, computer use, image
generation, MCP) go by the hosted-tools policy (field_policy). The same translation reads these
items when they come back as input (the conversation so far).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from gateway import protocol
from gateway.apis.common import arguments_object
from gateway.apis.field_policy import Dropped
from gateway.errors import InvalidRequest

Kind = Literal["function", "custom", "tool_search", "local_shell"]
# Chat function names: what OpenAI-compatible servers accept.
_CHAT_NAME = re.compile(r"[^a-zA-Z0-9_-]")
MAX_NAME = 64
CUSTOM_SCHEMA_DESCRIPTION = "The tool's whole input as plain text (not JSON)."
# The exec action of a `local_shell_call` (what the client runs), as a chat function's parameters.
LOCAL_SHELL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "description": "The command and its arguments."},
        "workdir": {"type": "string", "description": "The directory to run the command in."},
        "timeout_ms": {"type": "integer", "description": "How long the command may run, in milliseconds."},
        "env": {"type": "object", "additionalProperties": {"type": "string"},
                "description": "Environment variables to set for the command."},
    },
    "required": ["command"],
}


@dataclass(frozen=True, slots=True)
class ClientTool:
    """A tool the client runs, as the client names it."""

    kind: Kind
    name: str
    namespace: str | None = None


@dataclass(slots=True)
class ToolSet:
    """The request's tools as chat tools, and the way back from a chat tool call to the client's item."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    by_chat_name: dict[str, ClientTool] = field(default_factory=dict)
    chat_names: dict[tuple[str | None, str], str] = field(default_factory=dict)  # (namespace, name) -> chat name
    grammars_not_enforced: int = 0

    def add(self, tool: Any, param: str, dropped: Dropped, namespace: str | None = None) -> None:
        if not isinstance(tool, dict):
            raise InvalidRequest("a tool must be an object", param=param)
        kind = tool.get("type")
        if kind == "function":
            spec = protocol.check(FunctionSpec, tool)
            function: dict[str, Any] = {"name": self._name(ClientTool("function", spec.name, namespace))}
            if spec.description is not None:
                function["description"] = spec.description
            if spec.parameters is not None:
                function["parameters"] = spec.parameters
            if spec.strict is not None:
                function["strict"] = spec.strict
            self.chat.append({"type": "function", "function": function})
        elif kind == "custom":
            custom = protocol.check(CustomSpec, tool)
            description = custom.description or ""
            if custom.format is not None and custom.format.get("type") not in (None, "text"):
                # NOTE: no lane enforces a Lark grammar (the edge's compiler takes JSON schemas): the
                # model is told it in the description and the client checks the text, as it does anyway
                self.grammars_not_enforced += 1
                described = grammar_description(custom.format)
                if described is None:
                    dropped.add("tools.format")
                else:
                    description = f"{description}\n\n{described}" if description else described
            self.chat.append({"type": "function", "function": {
                "name": self._name(ClientTool("custom", custom.name, namespace)),
                "description": description,
                "parameters": {"type": "object", "properties": {"input": {"type": "string", "description": CUSTOM_SCHEMA_DESCRIPTION}},
                               "required": ["input"], "additionalProperties": False},
            }})
        elif kind == "namespace":
            nested = tool.get("tools")
            name = tool.get("name")
            if not isinstance(nested, list) or not isinstance(name, str) or not name:
                raise InvalidRequest("a namespace tool needs a `name` and a list of `tools`", param=param)
            for j, inner in enumerate(nested):
                self.add(inner, f"{param}.tools[{j}]", dropped, namespace=name)
        elif kind == "tool_search" and tool.get("execution") == "client":
            parameters = tool.get("parameters")
            self.chat.append({"type": "function", "function": {
                "name": self._name(ClientTool("tool_search", "tool_search", namespace)),
                "description": str(tool.get("description") or "Search for more tools to call."),
                "parameters": parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}},
            }})
        elif kind == "local_shell":
            self.chat.append({"type": "function", "function": {
                "name": self._name(ClientTool("local_shell", "local_shell", namespace)),
                "description": "Run a command on the user's machine.",
                "parameters": LOCAL_SHELL_PARAMETERS,
            }})
        elif isinstance(kind, str) and kind:
            dropped.hosted(kind, f"{param}.type")  # run by the provider: web_search, file_search, mcp, ...
        else:
            raise InvalidRequest("a tool needs a `type`", param=f"{param}.type", code="missing_required_parameter")

    def _name(self, tool: ClientTool) -> str:
        """A chat function name for `tool`, unique in the request (a namespace's tool may share a name)."""
        known = self.chat_names.get((tool.namespace, tool.name))
        if known is not None:
            return known
        base = _CHAT_NAME.sub("_", tool.name)[:MAX_NAME] or "tool"
        name = base
        if name in self.by_chat_name and tool.namespace:
            name = _CHAT_NAME.sub("_", f"{tool.namespace}__{tool.name}")[:MAX_NAME]
        suffix = 2
        while name in self.by_chat_name:
            name = f"{base[:MAX_NAME - 4]}_{suffix}"
            suffix += 1
        self.by_chat_name[name] = tool
        self.chat_names[(tool.namespace, tool.name)] = name
        return name

    def chat_name(self, name: str, namespace: str | None = None, kind: Kind = "function") -> str:
        """The chat name of a tool the conversation called earlier (one no longer offered keeps its own)."""
        known = self.chat_names.get((namespace, name))
        return known if known is not None else self._name(ClientTool(kind, name, namespace))

    def allowed(self, tools: list[dict[str, Any]]) -> set[str]:
        """The chat names of the tools an `allowed_tools` choice names (by `name`, in any namespace,
        or by `type` for the unnamed tool_search and local_shell); hosted ones have none."""
        names: set[str] = set()
        for spec in tools:
            name = spec.get("name")
            if not isinstance(name, str) and spec.get("type") in ("tool_search", "local_shell"):
                name = spec["type"]
            namespace = spec.get("namespace")
            for (space, client_name), chat_name in self.chat_names.items():
                if client_name == name and (namespace is None or namespace == space):
                    names.add(chat_name)
        return names

    def tool(self, chat_name: str) -> ClientTool:
        return self.by_chat_name.get(chat_name) or ClientTool("function", chat_name)

    # The model's calls as the client's items ----------------------------------------------

    def call_item(self, item_id: str, call_id: str, chat_name: str, arguments: str, status: str) -> dict[str, Any]:
        tool = self.tool(chat_name)
        item: dict[str, Any]
        if tool.kind == "custom":
            item = {"id": item_id, "type": "custom_tool_call", "status": status, "call_id": call_id, "name": tool.name,
                    "input": custom_input(arguments)}
        elif tool.kind == "tool_search":
            item = {"id": item_id, "type": "tool_search_call", "status": status, "call_id": call_id,
                    "execution": "client", "arguments": arguments_object(arguments)}
        elif tool.kind == "local_shell":
            item = {"id": item_id, "type": "local_shell_call", "status": status, "call_id": call_id,
                    "action": {**arguments_object(arguments), "type": "exec"}}
        else:
            item = {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": tool.name,
                    "arguments": arguments}
        if tool.namespace is not None and tool.kind not in ("tool_search", "local_shell"):
            item["namespace"] = tool.namespace
        return item


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class CustomSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["custom"]
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    format: dict[str, Any] | None = None


def grammar_description(spec: dict[str, Any]) -> str | None:
    """What a custom tool's grammar format (`{"type": "grammar", "syntax": "lark", "definition": ...}`)
    tells the model in a chat function's description; None for a format it cannot state."""
    definition, syntax = spec.get("definition"), spec.get("syntax")
    if spec.get("type") != "grammar" or not isinstance(definition, str) or not definition.strip():
        return None
    what = {"lark": "Lark grammar", "regex": "regular expression"}.get(str(syntax), "grammar")
    return f"The input must match this {what}:\n```\n{definition}\n```"


def custom_input(arguments: str) -> str:
    """A custom tool's text from the chat call's arguments (`{"input": ...}`; a model that sent
    bare text instead is taken at its word)."""
    try:
        value = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return str(value["input"])
    return arguments


def custom_arguments(text: str) -> str:
    """The chat arguments that stand for a custom tool's text input."""
    return orjson.dumps({"input": text}).decode()


def local_shell_arguments(action: dict[str, Any]) -> str:
    """The chat arguments that stand for a `local_shell_call`'s exec action (its fields but `type`)."""
    return orjson.dumps({k: v for k, v in action.items() if k != "type"}).decode()
