"""Which learned template a request is: a header lookup, a few prefix checks, nothing that scans a prompt.

Pure: request messages (and the `x-tierlane-template` header) in, a TemplateMatch or None out.
`AppTemplates` is built once per tenant/app (policies.learn.config.LearnPolicy.for_app); a later
serving stage calls the same `match` at request time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

SYSTEM_ROLES = frozenset({"system", "developer"})
Via = Literal["header", "prefix", "app"]


@dataclass(frozen=True, slots=True)
class Template:
    """An enabled template of one tenant/app, with the bounds of its pairs."""

    name: str
    prefix: str | None
    prefix_sha256: str | None
    prefix_chars: int | None
    all_requests: bool
    max_pairs: int
    retention_s: float
    # 16 hex of the definition (prefix, digest, all_requests): pairs collected under another
    # definition of the same name carry another version
    version: str

    @property
    def fixed_chars(self) -> int | None:
        """The length of the fixed prefix in characters, where the template names one."""
        return len(self.prefix) if self.prefix is not None else self.prefix_chars

    def starts(self, text: str) -> bool:
        """Whether `text` starts with this template's fixed prefix."""
        if self.prefix is not None:
            return text.startswith(self.prefix)
        if self.prefix_sha256 is None or self.prefix_chars is None or len(text) < self.prefix_chars:
            return False
        return _digest(text[: self.prefix_chars]) == self.prefix_sha256


@dataclass(frozen=True, slots=True)
class TemplateMatch:
    """A request recognised as a template, and its variable part where the fixed prefix was found."""

    template: Template
    via: Via  # how it was recognised
    # the text after the fixed prefix in the message that starts with it, then every later
    # message's text; None where no fixed prefix was found in the request (header or app match)
    variable: str | None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def content_text(content: Any, limit: int | None = None) -> str:
    """A message's text: the string, or its text parts joined (stopping once `limit` characters are read)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    out: list[str] = []
    size = 0
    for part in content:
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            out.append(part["text"])
            size += len(part["text"])
            if limit is not None and size >= limit:
                break
    return "".join(out)


def heads(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indexes of the messages a fixed prefix may open: the leading system prompt, then the first user message."""
    out: list[int] = []
    if messages and messages[0].get("role") in SYSTEM_ROLES:
        out.append(0)
    for index, message in enumerate(messages):
        if message.get("role") == "user":
            out.append(index)
            break
    return out


def variable_part(messages: Sequence[Mapping[str, Any]], index: int, fixed: int) -> str:
    """What follows the fixed prefix: the rest of message `index`, then the text of each later message."""
    rest = content_text(messages[index].get("content"))[fixed:].strip()
    later = (content_text(m.get("content")).strip() for m in messages[index + 1:])
    return "\n\n".join(text for text in (rest, *later) if text)


class AppTemplates:
    """The templates enabled for one tenant/app, arranged once so that matching costs a few prefix checks."""

    def __init__(self, templates: Iterable[Template]) -> None:
        self.by_name: dict[str, Template] = {t.name: t for t in templates}
        # longest first: a longer fixed prefix is the more specific task
        self._prefixed = sorted((t for t in self.by_name.values() if t.prefix is not None),
                                key=lambda t: -len(t.prefix or ""))  # fmt: skip
        hashed: dict[int, dict[str, Template]] = {}
        for t in self.by_name.values():
            if t.prefix_sha256 is not None and t.prefix_chars is not None:
                hashed.setdefault(t.prefix_chars, {})[t.prefix_sha256] = t
        self._hashed = sorted(hashed.items(), key=lambda item: -item[0])  # longest first
        self._all = next((t for t in self.by_name.values() if t.all_requests), None)
        self._longest = max((t.fixed_chars or 0 for t in self.by_name.values()), default=0)

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def match(self, messages: Sequence[Mapping[str, Any]], header: str | None = None) -> TemplateMatch | None:
        """The template of a request: the header's (an enabled name only; any other is ignored), else the
        longest fixed prefix opening the system prompt or the first user message, else the app's own."""
        if not self.by_name:
            return None
        named = self.by_name.get(header.strip()) if header else None
        if named is not None:
            return TemplateMatch(named, "header", self._variable(named, messages))
        for index in heads(messages):
            text = content_text(messages[index].get("content"), self._longest)
            found = self._by_prefix(text)
            if found is not None:
                return TemplateMatch(found, "prefix", variable_part(messages, index, found.fixed_chars or 0))
        if self._all is not None:
            return TemplateMatch(self._all, "app", self._variable(self._all, messages))
        return None

    def _by_prefix(self, text: str) -> Template | None:
        best: Template | None = None
        for t in self._prefixed:
            if text.startswith(t.prefix or ""):
                best = t
                break
        for chars, table in self._hashed:
            if len(text) < chars or (best is not None and (best.fixed_chars or 0) >= chars):
                continue
            found = table.get(_digest(text[:chars]))
            if found is not None:
                return found
        return best

    @staticmethod
    def _variable(template: Template, messages: Sequence[Mapping[str, Any]]) -> str | None:
        fixed = template.fixed_chars
        if fixed is None:
            return None
        for index in heads(messages):
            if template.starts(content_text(messages[index].get("content"), fixed)):
                return variable_part(messages, index, fixed)
        return None
