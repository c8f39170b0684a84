"""A chat body as one upstream takes it: what a self-hosted server declares it cannot do.

Hosted APIs take any `max_tokens` and system messages anywhere; a small self-hosted model may
have a context of a few thousand tokens (a coding agent asks for 128,000 output tokens) and a
chat template that renders one system message, first. Both are per-upstream settings; a body
for an upstream that declares neither is sent as it is, serialized once for every member.
An upstream that routes its prompt cache by `prompt_cache_key` (OpenAI) gets the request's
session key there, unless the client set one; one that keeps its prefix cache apart by
`cache_salt` (vLLM) gets a salt per tenant (a digest: the tenant's name never leaves).
"""

from __future__ import annotations

import hashlib
from typing import Any

from gateway.settings import UpstreamSettings

_LIMITS = ("max_tokens", "max_completion_tokens")


def adapts(cfg: UpstreamSettings) -> bool:
    """Whether `adapt` may change a body for this upstream."""
    return (cfg.max_output_tokens is not None or cfg.system_messages == "first" or cfg.sends_prompt_cache_key
            or cfg.cache_salt)


def tenant_salt(tenant: str) -> str:
    """The cache_salt of a tenant's requests: stable across replicas and restarts, and not its name."""
    return hashlib.blake2b(tenant.encode(), digest_size=16, person=b"tierlane-salt").hexdigest()


def adapt(body: dict[str, Any], cfg: UpstreamSettings, path: str, session: str | None = None,
          tenant: str | None = None) -> dict[str, Any]:
    """`body` with the output limit clamped to `max_output_tokens`, under `system_messages: first`
    every system message merged into one at the start (in their order, blank-line apart), and the
    session as `prompt_cache_key` where the upstream takes one and the client gave none."""
    if not adapts(cfg) or path not in ("/chat/completions", "/completions"):
        return body
    out = body
    if cfg.sends_prompt_cache_key and session and path == "/chat/completions" and not out.get("prompt_cache_key"):
        out = {**out, "prompt_cache_key": session}
    if cfg.cache_salt and tenant is not None and not out.get("cache_salt"):
        out = {**out, "cache_salt": tenant_salt(tenant)}
    limit = cfg.max_output_tokens
    if limit is not None:
        asked = [int(out[name]) for name in _LIMITS if isinstance(out.get(name), int)]
        if not asked:
            out = {**out, "max_tokens": limit}
        elif any(value > limit for value in asked):
            out = {**out, **{name: min(int(out[name]), limit) for name in _LIMITS if isinstance(out.get(name), int)}}
    messages = out.get("messages")
    if cfg.system_messages == "first" and isinstance(messages, list):
        system = [m for m in messages if isinstance(m, dict) and m.get("role") in ("system", "developer")]
        if len(system) > 1 or (system and messages[0] is not system[0]):
            text = "\n\n".join(_text(m.get("content")) for m in system)
            rest = [m for m in messages if not (isinstance(m, dict) and m.get("role") in ("system", "developer"))]
            out = {**out, "messages": [{"role": "system", "content": text}, *rest]}
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return ""
