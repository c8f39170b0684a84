"""What a job's lines must be: OpenAI's JSONL input file, Anthropic's list of requests.

Checked once, when the file is uploaded (or the Anthropic batch created), so a bad one is refused
with a 400 that names its line; what is kept of a line is its custom_id, endpoint and body.
Whether a body is a valid request for its endpoint is each line's own answer (its error line).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import orjson

from gateway import protocol
from gateway.apis.messages_wire import MessagesRequest
from gateway.errors import GatewayError, InvalidRequest

# The OpenAI endpoints a line may name (the gateway serves each); Anthropic's lines are Messages.
OPENAI_URLS = ("/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/completions")
MESSAGES_URL = "/v1/messages"
MAX_CUSTOM_ID = 512
_ANTHROPIC_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class BadFile(InvalidRequest):
    """An input file (or a batch's requests) the Batch API cannot run: 400, naming the line."""

    code = "invalid_batch_file"


@dataclass(frozen=True, slots=True)
class Line:
    """One request of a job as it is kept: its endpoint and its body as JSON."""

    custom_id: str
    url: str
    body: bytes

    def key(self) -> str:
        """What identical lines share: the endpoint and the body with its keys sorted."""
        canonical = orjson.dumps(orjson.loads(self.body), option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(self.url.encode() + b"\n" + canonical).hexdigest()


def _body(body: Any, where: str, max_body_bytes: int, param: str) -> bytes:
    if not isinstance(body, dict):
        raise BadFile(f"{where}: `body` must be a JSON object", param=param)
    if body.get("stream") is True:
        raise BadFile(f"{where}: a batch line is answered whole; remove `stream: true`", param=param)
    raw = orjson.dumps(body)
    if len(raw) > max_body_bytes:
        raise BadFile(f"{where}: the body is {len(raw)} bytes, more than one request may carry (server.max_body_bytes "
                      f"{max_body_bytes})", param=param)
    return raw


def openai_lines(content: bytes, *, max_lines: int, max_body_bytes: int) -> list[Line]:
    """The lines of an OpenAI batch input file, or BadFile naming the first line that is wrong."""
    lines: list[Line] = []
    seen: set[str] = set()
    for number, text in enumerate(content.split(b"\n"), start=1):
        if not text.strip():
            continue
        where = f"line {number}"
        try:
            entry = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise BadFile(f"{where} is not JSON: the file must be JSONL, one request object per line ({exc})",
                          param="file") from None
        if not isinstance(entry, dict):
            raise BadFile(f"{where} is not a JSON object", param="file")
        custom_id = entry.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            raise BadFile(f"{where}: `custom_id` must be a string of 1 to {MAX_CUSTOM_ID} characters", param="file")
        if custom_id in seen:
            raise BadFile(f"{where}: custom_id {custom_id!r} is already used by an earlier line; each must be unique",
                          param="file")
        seen.add(custom_id)
        if entry.get("method") != "POST":
            raise BadFile(f"{where}: `method` must be POST", param="file")
        url = entry.get("url")
        if url not in OPENAI_URLS:
            raise BadFile(f"{where}: `url` {url!r} is not an endpoint the Batch API runs; use one of "
                          f"{', '.join(OPENAI_URLS)}", param="file")
        lines.append(Line(custom_id, str(url), _body(entry.get("body"), where, max_body_bytes, "file")))
        if len(lines) > max_lines:
            raise BadFile(f"the file holds more than {max_lines} requests (batches.max_file_lines)", param="file")
    if not lines:
        raise BadFile("the file holds no requests: one JSON object per line", param="file")
    return lines


def anthropic_lines(body: dict[str, Any], *, max_lines: int, max_body_bytes: int, max_items: int) -> list[Line]:
    """The requests of a Message Batch, each params checked as a Messages request (400 naming it)."""
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise BadFile("`requests` must be a non-empty list of {custom_id, params}", param="requests")
    if len(requests) > max_lines:
        raise BadFile(f"`requests` holds {len(requests)} requests, more than {max_lines} (batches.max_file_lines)",
                      param="requests")
    lines: list[Line] = []
    seen: set[str] = set()
    for i, entry in enumerate(requests):
        where = f"requests[{i}]"
        if not isinstance(entry, dict):
            raise BadFile(f"{where} must be an object with custom_id and params", param=where)
        custom_id = entry.get("custom_id")
        if not isinstance(custom_id, str) or not _ANTHROPIC_CUSTOM_ID.match(custom_id):
            raise BadFile(f"{where}.custom_id must be 1 to 64 letters, digits, _ or -", param=f"{where}.custom_id")
        if custom_id in seen:
            raise BadFile(f"{where}.custom_id {custom_id!r} is already used; each must be unique", param=f"{where}.custom_id")
        seen.add(custom_id)
        raw = _body(entry.get("params"), where, max_body_bytes, f"{where}.params")
        try:
            protocol.check(MessagesRequest, protocol.parse_body(raw, max_items))
        except GatewayError as exc:
            raise BadFile(f"{where}.params: {exc.message}", param=f"{where}.params.{exc.param}" if exc.param else
                          f"{where}.params") from None
        lines.append(Line(custom_id, MESSAGES_URL, raw))
    return lines
