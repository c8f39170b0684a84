"""Token counts for requests whose lane reported none: prompt/answer text and a local tokenizer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from policies.domain import Outcome, Usage
from telemetry.record import MeteredRequest

log = logging.getLogger(__name__)

# OpenAI's chat format adds a few tokens per message (role, separators) and primes the reply.
PER_MESSAGE_TOKENS = 4
REPLY_PRIMING_TOKENS = 3
# Texts longer than this are tokenized on a worker thread instead of the event loop.
INLINE_CHARS = 2_000
# `tokenizers` holds the GIL for a whole encode (~2.6 us a character of prose, more for
# punctuation, a token each; a punctuation string of megabytes grows the process by gigabytes):
# a text is tokenized in pieces of at most CHUNK_CHARS (cut at a space where there is one near
# the end, so few words are split; each piece holds the GIL ~10-20 ms, so the event loop waits at
# most that long behind it), and at most EXACT_CHARS of one request are tokenized at all.
# Past that the rest is estimated at the tokens per character of what was tokenized: exact for
# text like the start, off by the difference in density where the rest differs (documented).
CHUNK_CHARS = 4_096
EXACT_CHARS = 262_144

TokenCount = Callable[[str], int]


def heuristic_count(text: str) -> int:
    """About four characters per token for English; the fallback when no tokenizer is at hand."""
    return (len(text) + 3) // 4


def load_local_tokenizer(path: Path | None = None) -> TokenCount:
    """The bundled embedder's tokenizer (unpadded, untruncated, no special tokens), or the heuristic if missing."""
    try:
        from tokenizers import Tokenizer

        if path is None:
            from policies.embedding.embedder import bundled_model_path

            path = bundled_model_path() / "tokenizer.json"
        tokenizer = Tokenizer.from_file(str(path))
        # NOTE: an embedder's tokenizer.json usually pads every text to a fixed length (128 for
        # all-MiniLM-L6-v2) and truncates it; both must go, or "hi" counts 128 tokens and a long
        # prompt is capped. no_truncation() leaves the padding in place, hence no_padding() too.
        tokenizer.no_truncation()
        tokenizer.no_padding()
    except Exception as exc:  # noqa: BLE001 - a missing model package must not stop metering
        log.warning("local tokenizer unavailable, estimating tokens from characters: %s", exc)
        return heuristic_count

    def encode(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids) if text else 0

    return bounded(encode)


def chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """`text` in pieces of at most `size` characters, each cut after a space when one is in its last eighth."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            space = text.rfind(" ", end - size // 8, end)
            if space > start:
                end = space + 1
        yield text[start:end]
        start = end


def bounded(encode: TokenCount, exact_chars: int = EXACT_CHARS) -> TokenCount:
    """A count that tokenizes `text` in CHUNK_CHARS pieces, at most `exact_chars` of it, and
    estimates the rest at the density of what it tokenized (no piece holds the GIL for long)."""

    def count(text: str) -> int:
        if len(text) <= CHUNK_CHARS:
            return encode(text)
        head = text[:exact_chars]
        tokens = sum(encode(piece) for piece in chunks(head))
        rest = len(text) - len(head)
        return tokens + (round(rest * tokens / len(head)) if rest and head else 0)

    return count


def _content_texts(content: Any) -> Iterator[str]:
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                yield part["text"]
            elif isinstance(part, str):
                yield part


def prompt_texts(body: Mapping[str, Any]) -> tuple[list[str], int]:
    """The texts a request sends to the model, and the number of chat messages among them."""
    texts: list[str] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, Mapping):
                texts.extend(_content_texts(message.get("content")))
        tools = body.get("tools")
        if isinstance(tools, list) and tools:
            texts.append(orjson.dumps(tools).decode())  # tool definitions are read by the model too
        return texts, len(messages)
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            texts.extend(v for v in value if isinstance(v, str))
    return texts, 0


def answer_texts(response: Mapping[str, Any] | None) -> list[str]:
    """The generated texts of a chat or text completion response."""
    if not response:
        return []
    texts: list[str] = []
    for choice in response.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        if isinstance(choice.get("text"), str):
            texts.append(choice["text"])
        message = choice.get("message")
        if isinstance(message, Mapping):
            texts.extend(_content_texts(message.get("content")))
            for call in message.get("tool_calls") or ():
                fn = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(fn, Mapping):
                    texts.append(f"{fn.get('name') or ''}{fn.get('arguments') or ''}")
    return texts


def chunk_tokens(chunk: Mapping[str, Any]) -> int:
    """Tokens a streamed chunk carries (about one per chunk; at least one when it has text)."""
    total = 0
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        delta = choice.get("delta")
        texts = list(_content_texts(choice.get("text")))
        if isinstance(delta, Mapping):
            texts.extend(_content_texts(delta.get("content")))
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(fn, Mapping):
                    texts.append(f"{fn.get('name') or ''}{fn.get('arguments') or ''}")
        chars = sum(len(t) for t in texts)
        if chars:
            total += max(1, (chars + 3) // 4)
    return total


def estimate_request_tokens(body: Mapping[str, Any]) -> int:
    """A cheap upper-ish guess of a request's input tokens, for admission before any work."""
    texts, messages = prompt_texts(body)
    return sum(heuristic_count(t) for t in texts) + messages * PER_MESSAGE_TOKENS


def estimate_usage(count: TokenCount, body: Mapping[str, Any], response: Mapping[str, Any] | None) -> Usage:
    texts, messages = prompt_texts(body)
    input_tokens = count_texts(count, texts)
    if messages:
        input_tokens += messages * PER_MESSAGE_TOKENS + REPLY_PRIMING_TOKENS
    output_tokens = count_texts(count, answer_texts(response))
    return Usage(input_tokens=input_tokens, output_tokens=output_tokens, estimated=True)


def count_texts(count: TokenCount, texts: list[str], exact_chars: int = EXACT_CHARS) -> int:
    """The tokens of `texts`: counted while the request's first `exact_chars` characters last, the
    rest estimated at the density counted so far (heuristic_count when nothing was counted)."""
    total = counted_chars = counted_tokens = 0
    for text in texts:
        head = text[:max(0, exact_chars - counted_chars)]
        if head:
            tokens = count(head)
            total += tokens
            counted_chars += len(head)
            counted_tokens += tokens
        rest = len(text) - len(head)
        if rest:
            total += round(rest * counted_tokens / counted_chars) if counted_chars else heuristic_count(text[len(head):])
    return total


async def resolve_usage(ctx: MeteredRequest, outcome: Outcome, count: TokenCount) -> Usage:
    """The lane's own usage when it reported one, else a local estimate marked `estimated`."""
    if ctx.usage is not None:
        return ctx.usage
    response = outcome.response
    if isinstance(response, Mapping):
        reported = Usage.from_openai(response.get("usage"))
        if reported is not None:
            return reported
    if response is None and outcome.status == 499 and ctx.lane in ("edge", "upstream") and ctx.lane_seconds > 0:
        # the client left while the lane worked on it: the prompt was read, so it is billed
        if sum(len(t) for t in prompt_texts(ctx.body)[0]) > INLINE_CHARS:
            return await asyncio.to_thread(estimate_usage, count, ctx.body, None)
        return estimate_usage(count, ctx.body, None)
    if response is None and (outcome.status >= 400 or ctx.first_token_at is None):
        return Usage()  # nothing was generated, and a refused request is not billed
    chars = sum(len(t) for t in prompt_texts(ctx.body)[0]) + sum(len(t) for t in answer_texts(response))
    if chars > INLINE_CHARS:
        return await asyncio.to_thread(estimate_usage, count, ctx.body, response)
    return estimate_usage(count, ctx.body, response)
