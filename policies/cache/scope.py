"""What makes two requests the same question: the scope key, the exact key and the matched text."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from policies.errors import InvalidInput
from policies.unicode_norm import nfkc_collapsed


@dataclass(slots=True, frozen=True)
class CacheKey:
    """Everything the store hook needs: computed once at lookup, reused at admission."""

    scope: str  # hex digest of tenant, model/route, system prompt, history and answer-changing params
    exact: str  # hex digest of scope + the normalised last user turn
    text: str  # the normalised last user turn, matched semantically
    tenant: str  # the owning tenant (even when the scope is shared)
    model: str
    # why this request is looked up and stored by its exact key only ("tools"); "" where a
    # semantic match may run (cache.max_text_chars is checked apart: semantic_skip)
    exact_only: str = ""


def semantic_skip(key: CacheKey, max_text_chars: int) -> str:
    """Why `key` is never matched semantically, nor stored with a vector: "" where it may be.

    - `tools`: the request carries tools (an agent turn): its answer depends on what those tools
      return later, so only an exact repeat (same tools, history and last turn) is served;
    - `max_text_chars`: the last turn is longer than the policy's `cache.max_text_chars`.
    """
    if key.exact_only:
        return key.exact_only
    return "max_text_chars" if len(key.text) > max_text_chars else ""


# The longest text normalised for a key (characters). A longer one keys on its normalised first
# NORMALISE_MAX_CHARS and a digest of the rest as sent: the key's cost stays bounded (~10 ms of
# non-ASCII text) whatever the body, and a repeat of the same long text is still the same key.
NORMALISE_MAX_CHARS = 65536


def normalise(text: str) -> str:
    """Unicode NFKC (stream-safe: linear time) with runs of whitespace collapsed; the exact key hashes this."""
    if len(text) <= NORMALISE_MAX_CHARS:
        return nfkc_collapsed(text)
    tail = hashlib.sha256(text[NORMALISE_MAX_CHARS:].encode("utf-8", "surrogatepass")).hexdigest()
    return f"{nfkc_collapsed(text[:NORMALISE_MAX_CHARS])} [+{len(text) - NORMALISE_MAX_CHARS} chars sha256:{tail}]"


def message_text(content: Any, *, param: str) -> str | None:
    """The text of a message's content; None when it carries anything but text (images, audio)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for index, part in enumerate(content):
            if not isinstance(part, Mapping) or "type" not in part:
                raise InvalidInput(
                    "each content part must be an object with a `type`", param=f"{param}[{index}]"
                )
            if part["type"] != "text":
                return None
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidInput("a text content part needs a string `text`", param=f"{param}[{index}].text")
            parts.append(text)
        return "\n".join(parts)
    raise InvalidInput("message content must be a string or a list of parts", param=param)


def last_user_text(body: Mapping[str, Any]) -> str | None:
    """The last user turn of a chat request (or the prompt of a completion); None if there is none."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for index in range(len(messages) - 1, -1, -1):
            message = messages[index]
            if isinstance(message, Mapping) and message.get("role") == "user":
                return message_text(message.get("content"), param=f"messages[{index}].content")
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    return None


# The embedding model reads 256 word pieces at most; longer text only costs tokenizer time.
EMBED_MAX_CHARS = 4000


def embedding_text(body: Mapping[str, Any]) -> str | None:
    """What is embedded for a request (cache and router alike): its last user turn, normalised."""
    text = last_user_text(body)
    # only what is embedded is normalised (twice the characters: NFKC and whitespace may shrink it)
    return nfkc_collapsed(text[:2 * EMBED_MAX_CHARS])[:EMBED_MAX_CHARS] if text else None


def _digest(value: Any) -> str:
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass(slots=True, frozen=True)
class ScopeRules:
    """The parts of the cache policy that decide scope and cacheability."""

    max_temperature: float
    # NOTE: an allow-list: every request field not named here (and not `messages`) is hashed into
    # the scope, so a sampling extension the gateway has never heard of (guided_json, min_p, ...)
    # splits the cache instead of being served an answer made without it.
    neutral_params: frozenset[str]
    share_across_tenants: bool


def build_key(
    body: Mapping[str, Any],
    *,
    tenant: str,
    model: str,
    route: str | None,
    rules: ScopeRules,
) -> tuple[CacheKey | None, str]:
    """The cache key of a chat request, or (None, why it cannot be cached)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("`messages` must be a non-empty list", param="messages")
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise InvalidInput("`temperature` must be a number", param="temperature")
        if float(temperature) > rules.max_temperature:
            return None, "temperature"
    last = messages[-1]
    if not isinstance(last, Mapping) or last.get("role") != "user":
        return None, "last turn is not a user turn"
    system: list[Any] = []
    history: list[Any] = []
    for index, message in enumerate(messages[:-1]):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidInput("each message must be an object with a string `role`", param=f"messages[{index}]")
        role = message["role"]
        if role in ("system", "developer"):
            text = message_text(message.get("content"), param=f"messages[{index}].content")
            system.append([role, normalise(text) if text is not None else message.get("content")])
        else:
            history.append(dict(message))
    text = message_text(last.get("content"), param=f"messages[{len(messages) - 1}].content")
    if text is None:
        return None, "the last turn carries more than text"
    text = normalise(text)
    if not text:
        return None, "empty last turn"
    params = {name: value for name, value in body.items() if name not in rules.neutral_params and name != "messages"}
    last_fields = {k: v for k, v in last.items() if k not in ("role", "content")}  # name, and anything else
    owner = "*" if rules.share_across_tenants else tenant
    scope = _digest(
        {
            "v": 2,
            "tenant": owner,
            "model": model,
            "route": route or "",
            "system": _digest(system),
            "history": _digest(history),
            "params": params,
            "last": last_fields,
        }
    )
    exact = hashlib.sha256(f"{scope}\x00{text}".encode()).hexdigest()
    exact_only = "tools" if _carries_tools(body) else ""
    return CacheKey(scope=scope, exact=exact, text=text, tenant=tenant, model=model, exact_only=exact_only), ""


def _carries_tools(body: Mapping[str, Any]) -> bool:
    """Whether a chat request offers the model tools (or the older `functions`)."""
    return any(isinstance(body.get(name), list) and len(body[name]) > 0 for name in ("tools", "functions"))


def wants(headers: Mapping[str, str], directive: str) -> bool:
    """Whether the request's Cache-Control header carries `directive` (no-cache, no-store)."""
    value = headers.get("Cache-Control") or headers.get("cache-control") or ""
    return any(part.strip().lower() == directive for part in value.split(","))
