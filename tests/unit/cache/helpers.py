"""Drives the real embed stage, cache lookup stage and store hook for one request."""

from __future__ import annotations

import itertools
from typing import Any

from gateway import protocol
from gateway.context import Answer, Outcome, Principal, RequestContext
from gateway.pipeline.cache_lookup import CacheLookupStage
from gateway.pipeline.cache_store import CacheStoreHook
from policies.cache.service import SemanticCache
from policies.embedding.embedder import Embedder

_ids = itertools.count()


def chat(text: str, *, system: str | None = None, history: list[dict[str, Any]] | None = None, **params: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages += history or []
    messages.append({"role": "user", "content": text})
    return {"model": params.pop("model", "auto"), "messages": messages, **params}


def completion(answer: str, *, finish: str = "stop", model: str = "upstream-model") -> dict[str, Any]:
    return {
        "id": "chatcmpl-upstream",
        "object": "chat.completion",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": finish}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
    }


class Flow:
    """One gateway's cache stages over a real embedder and a real cache."""

    def __init__(self, cache: SemanticCache, embedder: Embedder) -> None:
        self.lookup = CacheLookupStage(cache, embedder)
        self.store = CacheStoreHook(cache)

    def context(self, body: dict[str, Any], *, tenant: str = "acme", headers: dict[str, str] | None = None) -> RequestContext:
        return RequestContext(
            request_id=f"req-{next(_ids)}",
            operation="chat",
            body=body,
            headers=headers or {},
            principal=Principal(tenant=tenant, app="web"),
            model=body.get("model", "auto"),
            stream=bool(body.get("stream")),
            request=protocol.validate("chat", body, max_n=8),
            requested_route=(headers or {}).get("x-tierlane-route"),
        )

    async def ask(self, body: dict[str, Any], **kw: Any) -> tuple[RequestContext, Answer | None]:
        ctx = self.context(body, **kw)
        return ctx, await self.lookup.run(ctx)

    async def answer(self, body: dict[str, Any], text: str, *, finish: str = "stop", complete: bool = True,
                     status: int = 200, **kw: Any) -> RequestContext:
        """Ask; on a miss, complete the request with `text` and run the store hook."""
        ctx, answer = await self.ask(body, **kw)
        assert answer is None, "expected a miss before storing"
        response = completion(text, finish=finish)
        await self.store.on_complete(
            ctx, Outcome(status=status, response=response, complete=complete, finish_reasons=[finish])
        )
        return ctx


class Gated:
    """A real sentence encoder whose encode calls wait until `release` is set (a busy worker thread, on demand)."""

    def __init__(self, inner: Any) -> None:
        import threading

        self.inner = inner
        self.backend, self.precision = inner.backend, inner.precision
        self.entered = threading.Event()  # set when an encode call has started
        self.release = threading.Event()
        self.calls: list[list[str]] = []

    def encode(self, texts: list[str]) -> Any:
        self.calls.append(list(texts))
        self.entered.set()
        self.release.wait(60)
        return self.inner.encode(texts)
