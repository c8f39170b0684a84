"""The load driver: sends each workload request at its offset, with bounded concurrency.

Streaming requests are used by default so the time to first token is measured on the client,
the way an application sees it. Lane, cache status and usage are read from what the gateway
answers (the `x-tierlane-*` headers and the OpenAI `usage` object).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.replay.workload import WorkItem, expected_probe


@dataclass(slots=True)
class RequestResult:
    """What happened to one replayed request."""

    index: int
    kind: str | None
    status: int  # HTTP status; 0 when no answer came (connection failure, client timeout)
    lane: str  # cache | edge | upstream | none (no answer)
    started_at: float  # wall clock (unix seconds) when the request was sent
    latency_s: float
    ttft_s: float | None = None
    pool: str | None = None
    cache: str | None = None  # x-tierlane-cache: hit | miss | bypass
    route_reason: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    overhead_ms: float | None = None
    error: str | None = None
    escalated: bool = False  # the edge answered first and the cascade sent it upstream
    correct: bool | None = None  # None: the workload line carries no checkable answer


    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def base_url(url: str) -> str:
    """The gateway root, whether given with or without `/v1`."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def parse_lane(header: str | None) -> tuple[str, str | None, str | None]:
    """`upstream:standard; score=0.41; reason=router` -> (lane, pool, reason)."""
    if not header:
        return "unknown", None, None
    head, *params = (part.strip() for part in header.split(";"))
    lane, _, pool = head.partition(":")
    reason = None
    for param in params:
        key, _, value = param.partition("=")
        if key.strip() == "reason":
            reason = value.strip()
    return lane or "unknown", pool or None, reason


def escalated(header: str | None) -> bool:
    """Whether `x-tierlane-lane` says the cascade escalated an edge answer (`upstream; escalated; ...`)."""
    return bool(header) and "escalated" in (part.strip() for part in (header or "").split(";"))


def answer_text(payload: Any) -> str | None:
    """The first choice's text of a chat or completions answer."""
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list) or not payload["choices"]:
        return None
    choice = payload["choices"][0]
    if not isinstance(choice, dict):
        return None
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else None


def _has_text(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False


def _delta_texts(event: dict[str, Any]) -> list[str]:
    out = []
    for choice in event.get("choices") or ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str):
                out.append(text)
    return out


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        err = payload["error"]
        return f"{err.get('type') or 'error'}: {err.get('message')}"
    return str(payload)[:200]


class Driver:
    """Replays WorkItems against one gateway; `run` returns one RequestResult per item."""

    def __init__(
        self,
        url: str,
        *,
        concurrency: int = 8,
        api_key: str | None = None,
        stream: bool = True,
        timeout_s: float = 300.0,
        time_scale: float = 1.0,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if time_scale < 0:
            raise ValueError("time_scale must not be negative")
        self.root = base_url(url)
        self.concurrency = concurrency
        self.stream = stream
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.time_scale = time_scale
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    async def run(
        self, items: Sequence[WorkItem], progress: Callable[[RequestResult], None] | None = None
    ) -> list[RequestResult]:
        gate = asyncio.Semaphore(self.concurrency)
        connector = aiohttp.TCPConnector(limit=self.concurrency)
        async with aiohttp.ClientSession(connector=connector, timeout=self.timeout) as session:
            start = time.perf_counter()

            async def one(item: WorkItem) -> RequestResult:
                delay = start + item.at * self.time_scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                async with gate:
                    result = await self.send(session, item)
                if progress is not None:
                    progress(result)
                return result

            return list(await asyncio.gather(*(one(item) for item in items)))

    def _body(self, item: WorkItem) -> dict[str, Any]:
        body = dict(item.body)
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        else:
            body.pop("stream", None)
            body.pop("stream_options", None)
        return body

    async def send(self, session: aiohttp.ClientSession, item: WorkItem) -> RequestResult:
        body = self._body(item)
        result = RequestResult(
            index=item.index, kind=item.kind, status=0, lane="none", started_at=time.time(), latency_s=0.0
        )
        t0 = time.perf_counter()
        try:
            async with session.post(
                self.root + item.path, data=json.dumps(body), headers={**self.headers, **item.headers}
            ) as resp:
                result.status = resp.status
                result.lane, result.pool, result.route_reason = parse_lane(resp.headers.get("x-tierlane-lane"))
                result.escalated = escalated(resp.headers.get("x-tierlane-lane"))
                result.cache = resp.headers.get("x-tierlane-cache")
                overhead = resp.headers.get("x-tierlane-overhead-ms")
                result.overhead_ms = float(overhead) if overhead else None
                if resp.status != 200:
                    result.error = _error_text(await _json_or_text(resp))
                elif body.get("stream"):
                    text = await self._read_stream(resp, result, t0)
                    self._check(item, result, text)
                else:
                    payload = await resp.json(content_type=None)
                    result.ttft_s = None
                    self._usage(result, payload.get("usage") if isinstance(payload, dict) else None)
                    self._check(item, result, answer_text(payload))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        result.latency_s = time.perf_counter() - t0
        return result

    @staticmethod
    def _check(item: WorkItem, result: RequestResult, text: str | None) -> None:
        if item.check is None or result.error is not None:
            return
        from policies.edge_quality.checkers import CHECKERS

        probe = expected_probe(item.check, item.expected)
        result.correct = text is not None and bool(CHECKERS[item.check](probe, text))

    async def _read_stream(self, resp: aiohttp.ClientResponse, result: RequestResult, t0: float) -> str | None:
        """Reads the events to the end; the assembled text of the first choice."""
        done = False
        parts: list[str] = []
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if isinstance(event, dict) and "error" in event:
                result.error = _error_text(event)
                return None
            if result.ttft_s is None and isinstance(event, dict) and _has_text(event):
                result.ttft_s = time.perf_counter() - t0
            if isinstance(event, dict):
                parts.extend(_delta_texts(event))
            if isinstance(event, dict) and event.get("usage"):
                self._usage(result, event["usage"])
        if not done:
            result.error = "stream ended without [DONE]"
        return "".join(parts)

    @staticmethod
    def _usage(result: RequestResult, usage: Any) -> None:
        if isinstance(usage, dict):
            result.input_tokens = int(usage.get("prompt_tokens") or 0)
            result.output_tokens = int(usage.get("completion_tokens") or 0)


async def _json_or_text(resp: aiohttp.ClientResponse) -> Any:
    text = await resp.text()
    try:
        return json.loads(text)
    except ValueError:
        return text


async def fetch_usage(
    url: str, start: float, end: float, api_key: str | None = None, *, expect: int | None = None, wait_s: float = 10.0
) -> tuple[dict[str, Any] | None, str | None]:
    """GET /v1/usage grouped by lane over [start, end); returns (report, why it is missing).

    The ledger commits in groups, so with `expect` it polls until that many requests are in.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    params = {"from": f"{start:.6f}", "to": f"{end:.6f}", "group_by": "lane"}
    deadline = time.monotonic() + wait_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while True:
            try:
                async with session.get(base_url(url) + "/v1/usage", params=params, headers=headers) as resp:
                    payload = await _json_or_text(resp)
                    if resp.status != 200:
                        return None, f"GET /v1/usage answered {resp.status}: {_error_text(payload)}"
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                return None, f"GET /v1/usage failed: {exc}"
            have = int((payload.get("total") or {}).get("requests") or 0) if isinstance(payload, dict) else 0
            if expect is None or have >= expect or time.monotonic() >= deadline:
                return payload, None
            await asyncio.sleep(0.5)
