"""What a front door does with each field of a request: honour, translate, or drop and record.

A client newer than the gateway sends fields the gateway has never heard of; refusing them would
break the client on its upgrade, so by default they are dropped and their names recorded (on the
span and in the `x-tierlane-dropped` header). Types of the fields the gateway knows stay strictly
validated. Tools the provider would run itself (web search, file search, code interpreter, MCP
servers, ...) cannot run behind a chat upstream: they are dropped and recorded too, so the model
simply does not call them, unless the operator asks for a 400 (`apis.hosted_tools: reject`).
A custom tool's grammar (Codex's `apply_patch`) is not enforced by any lane but not dropped either:
it is stated at the end of the function's description (responses_tools), the same text every turn;
only a format that cannot be stated so is dropped as `tools.format`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from gateway.errors import InvalidRequest

Mode = Literal["drop", "reject"]
# The response header that names every field a front door dropped (comma-separated).
DROPPED_HEADER = "x-tierlane-dropped"
DROPPED_ATTRIBUTE = "tierlane.dropped_fields"  # the same names on the span


class KnownFields(BaseModel):
    """A request object whose fields are all known: any other key is an unknown field.

    Such models accept extra keys (so a newer client is not refused by validation); `unknown`
    lists them afterwards, and the request's `Dropped` record decides what happens to them.
    """

    KNOWN_ONLY: ClassVar[bool] = True


def unknown(model: BaseModel, path: str = "") -> Iterator[str]:
    """The dotted paths (list indices left out) of every unknown key in a validated request tree."""
    found: list[str] = []
    _unknown_of(model, path, found)
    return iter(found)


# NOTE: a validated model's fields are its __dict__ (in field order; extras are kept apart), and
# only models and lists can hold more of them: an agent's request re-sends its whole history, tens
# of thousands of fields, and reading each through model_fields and getattr cost 0.4 ms a turn.
_NESTED = (BaseModel, list)


def _unknown_of(model: BaseModel, path: str, found: list[str]) -> None:
    if getattr(type(model), "KNOWN_ONLY", False):
        for name in model.__pydantic_extra__ or ():
            found.append(f"{path}.{name}" if path else name)
    for name, value in model.__dict__.items():
        if isinstance(value, _NESTED):
            _unknown_in(value, f"{path}.{name}" if path else name, found)


def _unknown_in(value: Any, path: str, found: list[str]) -> None:
    if isinstance(value, BaseModel):
        _unknown_of(value, path, found)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, _NESTED):
                _unknown_in(item, path, found)


@dataclass(slots=True)
class Dropped:
    """The fields one request loses on its way to a chat upstream, under the operator's policy."""

    unknown_fields: Mode = "drop"
    hosted_tools: Mode = "drop"
    names: list[str] = field(default_factory=list)

    def add(self, name: str) -> None:
        """A known field that does not change what the answer means, dropped."""
        if name not in self.names:
            self.names.append(name)

    def unknown(self, model: BaseModel) -> None:
        """Drop (or refuse, under `reject`) every unknown field of a validated request."""
        for path in unknown(model):
            if self.unknown_fields == "reject":
                raise InvalidRequest(
                    f"unknown parameter '{path}' (apis.unknown_fields is reject; set it to drop to accept and record "
                    "fields of newer clients)",
                    param=path,
                    code="unknown_parameter",
                )
            self.add(path)

    def unknown_item(self, kind: str, param: str) -> None:
        """An input item of a type the gateway does not know (a newer client's): like an unknown field."""
        if self.unknown_fields == "reject":
            raise InvalidRequest(f"unknown input item type {kind!r} (apis.unknown_fields is reject)", param=param,
                                 code="unknown_parameter")
        self.add(f"input.{kind}")

    def part(self, name: str, param: str, what: str) -> None:
        """Content a chat model cannot take (a PDF, a file by id): like an unknown field, dropped and
        named, or a 400 naming it under `reject`."""
        if self.unknown_fields == "reject":
            raise InvalidRequest(f"{what} cannot be passed on to a chat model (apis.unknown_fields is reject; set it to "
                                 "drop to send the rest of the request without it)", param=param,
                                 code="unsupported_content")
        self.add(name)

    def hosted(self, kind: str, param: str, name: str | None = None) -> None:
        """A tool the provider would run (web search, MCP, ...): dropped, or a 400 under `reject`."""
        if self.hosted_tools == "reject":
            raise InvalidRequest(
                f"the gateway cannot run the hosted tool {kind!r}: its upstreams run no tools (apis.hosted_tools is "
                "reject; set it to drop to let the model answer without it)",
                param=param,
                code="unsupported_tool",
            )
        self.add(name or f"tools.{kind}")


def header_value(names: list[str]) -> str:
    """The `x-tierlane-dropped` value: the names, sorted, at most 2 KB."""
    value = ",".join(sorted(set(names)))
    return value if len(value) <= 2048 else value[:2044].rsplit(",", 1)[0] + ",..."
