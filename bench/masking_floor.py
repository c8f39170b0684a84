"""How far observation masking could go on a recorded agent session: bounds computed from the
session itself, no gateway (bench/agent_sessions.py reports them beside the replayed bills).

A session is billed here as the provider with automatic prefix caching bills it (bench/
pricing_upstream.py, `mode="prefix"`), on the client's own requests: each request's prompt is cut
into the tools and instructions, then each message (Messages) or input item (Responses); the
prefix an earlier request sent is read, the rest written; every answer is the replayed one.

- `pass_through`: as sent;
- `oracle_mask`: every tool result older than the last `keep` model calls costs nothing, and
  dropping it causes no cache write (the rest is read and written as in pass-through): a bound no
  real masking reaches, since each drop changes the prefix after it;
- `write_once`: nothing old is read at all: each new part of the prompt (the first request's tools
  and instructions, each new message or tool result) is written once, then never paid for again.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from bench.pricing_upstream import ANSWER, usd
from gateway.upstream.to_messages import unmarked
from policies.trim.messages import estimate_tokens

MODEL_CALLS = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
RESULT_ITEMS = ("function_call_output", "custom_tool_call_output")


def _tokens(value: Any) -> int:
    return estimate_tokens(orjson.dumps(value).decode())


def parts(body: dict[str, Any]) -> list[tuple[bytes, int, dict[str, int]]]:
    """Each part of a request's prompt in order: (its bytes, its tokens, the tokens of each tool
    result in it by call id), cache marks left out."""
    body = unmarked(body)
    head = {k: body.get(k) for k in ("tools", "system", "instructions") if body.get(k) is not None}
    out: list[tuple[bytes, int, dict[str, int]]] = [(orjson.dumps(head), _tokens(head), {})]
    for message in body.get("messages") or ():  # Messages (and chat)
        results: dict[str, int] = {}
        content = message.get("content")
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                results[str(block.get("tool_use_id"))] = _tokens(block.get("content"))
        if message.get("role") == "tool":
            results[str(message.get("tool_call_id"))] = _tokens(content)
        out.append((orjson.dumps(message), _tokens(message), results))
    items = body.get("input")
    for item in items if isinstance(items, list) else []:  # Responses
        results = {str(item.get("call_id")): _tokens(item.get("output"))} if item.get("type") in RESULT_ITEMS else {}
        out.append((orjson.dumps(item), _tokens(item), results))
    return out


def bounds(session: list[dict[str, Any]], keep: int = 10, tier: str = "strong") -> dict[str, Any]:
    """The session's bill as sent, under the masking oracle, and written once (USD and tokens)."""
    output = estimate_tokens(ANSWER) + 1
    seen: set[bytes] = set()  # chained prefix hashes sent before
    written_once: set[bytes] = set()  # parts (by content) written before
    first_call: dict[str, int] = {}  # tool result -> the model call it first came in
    totals = {name: {"read": 0, "written": 0} for name in ("pass_through", "oracle_mask", "write_once")}
    masked = 0
    calls = [r["body"] for r in session if r["path"] in MODEL_CALLS]
    for index, body in enumerate(calls):
        chained, cold = b"", False
        for raw, tokens, results in parts(body):
            for call_id in results:
                first_call.setdefault(call_id, index)
            old = sum(t for call_id, t in results.items() if index - first_call[call_id] >= keep)
            chained = hashlib.blake2b(chained + raw, digest_size=16).digest()
            cold = cold or chained not in seen
            seen.add(chained)
            kind = "written" if cold else "read"
            totals["pass_through"][kind] += tokens
            totals["oracle_mask"][kind] += tokens - old
            masked += old
            digest = hashlib.blake2b(raw, digest_size=16).digest()
            if digest not in written_once:
                written_once.add(digest)
                totals["write_once"]["written"] += tokens
    out: dict[str, Any] = {"keep_last_calls": keep, "model_calls": len(calls), "oracle_masked_tokens": masked}
    for name, t in totals.items():
        out[name] = {"usd": round(usd(tier, t["read"], t["written"], 0, output * len(calls)), 6), **t}
    base = out["pass_through"]["usd"]
    for name in ("oracle_mask", "write_once"):
        out[name]["vs_pass_through"] = round(out[name]["usd"] / max(1e-12, base), 4)
    return out
