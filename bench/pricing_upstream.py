"""A provider that bills prompt caching the way OpenAI and Anthropic do, for bench/agent_sessions.py.

Two ways a provider bills a prompt's cache, both with Anthropic's list ratios (cache read 0.1x,
cache write 1.25x the input price; uncached input 1x):

- automatic prefix caching (`mode="prefix"`, chat completions): the part of a prompt that a request
  within the TTL already sent (whole tools and messages, in order) is a cache read, the rest a write;
- explicit breakpoints (`mode="anthropic"`): on `/v1/messages` only a block marked `cache_control`
  creates a cache entry: the prefix up to and including it is written if it is not cached within
  the TTL; a read is the longest prefix, ending at a breakpoint or at any of the 20 blocks before
  one, that an earlier request wrote within the TTL; the input after the last breakpoint (and
  after the read) is billed at the full input price. Blocks: each tool, each system block, then
  each message's content blocks in order. Its chat endpoint (Anthropic's OpenAI-compatible one)
  caches nothing: every input token at the full price; with `chat=False` it has none (404).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web

from policies.trim.messages import estimate_tokens

# USD per M tokens at Anthropic's list ratios (cache read 0.1x, write 1.25x input): the strong tier
# (what the agent asked for) and the cost tier a session may be routed to
PRICES = {"strong": {"input": 3.0, "cached_input": 0.3, "cache_write": 3.75, "output": 15.0},
          "cost": {"input": 1.0, "cached_input": 0.1, "cache_write": 1.25, "output": 5.0}}
MODELS = {"strong": "strong-model", "cost": "cost-model"}
TTL_S = 300.0
LOOKBACK_BLOCKS = 20  # the blocks before a breakpoint whose prefixes Anthropic checks for a hit
ANSWER = "Noted."


@dataclass
class Billed:
    session: str | None
    read: int
    written: int
    output: int
    body: dict[str, Any]
    tier: str = "strong"
    uncached: int = 0  # input billed at the full price (neither read from nor written to the cache)
    api: str = "chat"

    @property
    def usd(self) -> float:
        price = PRICES[self.tier]
        return (self.read * price["cached_input"] + self.written * price["cache_write"] + self.uncached * price["input"]
                + self.output * price["output"]) / 1e6


def usd(tier: str, read: int, written: int, uncached: int, output: int) -> float:
    return Billed(None, read, written, output, {}, tier, uncached).usd


def chat_chunks(body: dict[str, Any]) -> list[bytes]:
    """What automatic prefix caching compares: the tools, then each message, whole."""
    return [orjson.dumps(body.get("tools") or [])] + [orjson.dumps(m) for m in body.get("messages") or ()]


def message_blocks(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Messages request's cacheable blocks in order: each tool, each system block, each message's content blocks."""
    blocks: list[dict[str, Any]] = [t for t in body.get("tools") or () if isinstance(t, dict)]
    system = body.get("system")
    blocks += [{"type": "text", "text": system}] if isinstance(system, str) else [b for b in system or () if isinstance(b, dict)]
    for message in body.get("messages") or ():
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or ())
        # the role is part of what a block's prefix means: the same text from another role is another prompt
        blocks += [{"role": message.get("role"), **p} if isinstance(p, dict) else {"role": message.get("role"), "text": str(p)}
                   for p in parts]
    return blocks


def _block_tokens(block: dict[str, Any]) -> int:
    return estimate_tokens(orjson.dumps({k: v for k, v in block.items() if k != "cache_control"}).decode())


def _prefix_hashes(blocks: list[dict[str, Any]]) -> list[bytes]:
    """The chained hash of each prefix (ending at each block), cache marks left out."""
    chained, out = b"", []
    for block in blocks:
        chained = hashlib.blake2b(chained + orjson.dumps({k: v for k, v in block.items() if k != "cache_control"}),
                                  digest_size=16).digest()
        out.append(chained)
    return out


def bill_breakpoints(blocks: list[dict[str, Any]], written: dict[bytes, float], now: float,
                     ttl_s: float = TTL_S) -> tuple[int, int, int]:
    """(read, written, uncached) tokens of one Messages request; `written` (prefix hash -> when
    written or last read) is updated: a breakpoint's prefix is written, a read refreshes its entry."""
    tokens = [_block_tokens(b) for b in blocks]
    cumulative = [0]
    for t in tokens:
        cumulative.append(cumulative[-1] + t)
    hashes = _prefix_hashes(blocks)
    marks = [i for i, b in enumerate(blocks) if b.get("cache_control")]
    hit = 0  # blocks in the longest cached prefix
    for mark in marks:
        for end in range(mark + 1, max(0, mark - LOOKBACK_BLOCKS), -1):  # prefixes ending at the mark and the 20 before
            if end <= hit:
                break
            if now - written.get(hashes[end - 1], -1e18) <= ttl_s:
                hit = end
                break
    if hit:
        written[hashes[hit - 1]] = now
    last = marks[-1] + 1 if marks else 0
    for mark in marks:
        written[hashes[mark]] = now
    read = cumulative[hit]
    wrote = cumulative[last] - cumulative[hit] if last > hit else 0
    return read, wrote, cumulative[-1] - cumulative[max(last, hit)]


@dataclass
class PricingUpstream:
    """A chat (and Messages) upstream that bills cache reads, cache writes and uncached input."""

    tier: str = "strong"  # whose prices, and its own cache: a switch of tier starts cold
    mode: Literal["prefix", "anthropic"] = "prefix"
    chat: bool = True  # serves /v1/chat/completions (a Messages-only upstream answers it 404)
    seen: dict[bytes, float] = field(default_factory=dict)  # chained prefix hash -> last sent (or written)
    billed: list[Billed] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_get("/v1/models", self._models)
        return app

    def reset(self) -> None:
        self.seen.clear()
        self.billed.clear()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODELS[self.tier], "object": "model",
                                                              "owned_by": "bench"}]})

    def _bill_prefix(self, body: dict[str, Any]) -> tuple[int, int]:
        now = time.monotonic()
        chained, read, written, cold = b"", 0, 0, False
        for chunk in chat_chunks(body):
            chained = hashlib.blake2b(chained + chunk, digest_size=16).digest()
            tokens = estimate_tokens(chunk.decode())
            if not cold and now - self.seen.get(chained, -1e18) <= TTL_S:
                read += tokens
            else:
                cold = True
                written += tokens
            self.seen[chained] = now
        return read, written

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if not self.chat:
            return web.json_response({"type": "error", "error": {"type": "not_found_error", "message":
                                      "this upstream serves /v1/messages only, not /v1/chat/completions"}}, status=404)
        body = orjson.loads(await request.read())
        if self.mode == "prefix":
            read, written = self._bill_prefix(body)
            uncached = 0
        else:  # Anthropic's OpenAI-compatible endpoint: no prompt caching
            read, written, uncached = 0, 0, sum(estimate_tokens(c.decode()) for c in chat_chunks(body))
        output = estimate_tokens(ANSWER) + 1
        self.billed.append(Billed(body.get("prompt_cache_key"), read, written, output, body, self.tier, uncached))
        prompt = read + written + uncached
        usage = {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
                 "prompt_tokens_details": {"cached_tokens": read}}
        ident, created = "chatcmpl-" + uuid.uuid4().hex[:12], int(time.time())
        message = {"role": "assistant", "content": ANSWER}
        if not body.get("stream"):
            return web.json_response({"id": ident, "object": "chat.completion", "created": created, "model": MODELS[self.tier],
                                      "choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        def chunk(delta: dict[str, Any], reason: str | None = None, extra: dict[str, Any] | None = None) -> bytes:
            data = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": MODELS[self.tier],
                    "choices": [{"index": 0, "delta": delta, "finish_reason": reason}] if extra is None else [], **(extra or {})}
            return b"data: " + orjson.dumps(data) + b"\n\n"

        await response.write(chunk({"role": "assistant", "content": ""}))
        await response.write(chunk({"content": ANSWER}))
        await response.write(chunk({}, "stop"))
        await response.write(chunk({}, extra={"usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        return response

    async def _count_tokens(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        return web.json_response({"input_tokens": sum(_block_tokens(b) for b in message_blocks(body))})

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        read, written, uncached = bill_breakpoints(message_blocks(body), self.seen, time.monotonic())
        output = estimate_tokens(ANSWER) + 1
        session = (body.get("metadata") or {}).get("user_id")
        self.billed.append(Billed(session, read, written, output, body, self.tier, uncached, api="messages"))
        # Anthropic's usage: input_tokens is the input after the last breakpoint, apart from the cache's
        usage = {"input_tokens": uncached, "cache_creation_input_tokens": written, "cache_read_input_tokens": read,
                 "output_tokens": output}
        ident, model = "msg_" + uuid.uuid4().hex[:20], MODELS[self.tier]
        text = {"type": "text", "text": ANSWER}
        if not body.get("stream"):
            return web.json_response({"id": ident, "type": "message", "role": "assistant", "model": model, "content": [text],
                                      "stop_reason": "end_turn", "stop_sequence": None, "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        def event(name: str, data: dict[str, Any]) -> bytes:
            return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"

        start = {**usage, "output_tokens": 1}
        await response.write(event("message_start", {"message": {
            "id": ident, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": start}}))
        await response.write(event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
        await response.write(event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": ANSWER}}))
        await response.write(event("content_block_stop", {"index": 0}))
        await response.write(event("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                                      "usage": usage}))
        await response.write(event("message_stop", {}))
        return response
