"""Which requests the gateway embeds, end to end: the real embedder, cache and router behind HTTP.

The embedder's own count of the texts it encoded (`Embedder.texts`) is read after each request:
a plain `auto` request the cache can match semantically is embedded once, and the requests the
cache cannot serve semantically by policy (tools, a last turn past cache.max_text_chars,
`Cache-Control: no-cache`, a tool result as the last turn, a tenant with the cache off) are not
embedded at all, the router needing no score here (one upstream, no tiers). Every body reaches
the upstream as the client sent it.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from gateway.auth import hash_key
from gateway.keys import SERVICES
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app

pytestmark = pytest.mark.slow  # the embedder loads a real model

QUIET_KEY, LOUD_KEY = "sk-quiet-tenant", "sk-loud-tenant"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


@pytest.fixture
def gateway(bg: Any, make_gateway: Any) -> Any:
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text="Canberra."))
    cache = {"enabled": True, "max_text_chars": 200, "overrides": [{"match": {"tenant": "quiet"}, "set": {"enabled": False}}]}
    gw = make_gateway(
        base={**PASS_THROUGH, "embedder": {"enabled": True},
              "auth": {"mode": "keys", "keys": [{"sha256": hash_key(QUIET_KEY), "tenant": "quiet"},
                                                {"sha256": hash_key(LOUD_KEY), "tenant": "loud"}]},
              "policy": {**PASS_THROUGH["policy"], "cache": cache, "router": {"enabled": True}}},
        upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"], retries=0)],
    )  # fmt: skip
    yield gw, rec
    up.stop()


def send(gw: Any, body: dict[str, Any], key: str = LOUD_KEY, **headers: str) -> tuple[httpx.Response, int]:
    """The response, and how many texts the gateway's embedder encoded meanwhile."""
    embedder = gw.app[SERVICES].embedder
    before = embedder.texts
    raw = orjson.dumps(body)
    r = httpx.post(gw.url + "/v1/chat/completions", content=raw,
                   headers={"authorization": f"Bearer {key}", "content-type": "application/json", **headers}, timeout=60)
    assert r.status_code == 200, r.text
    return r, embedder.texts - before


def ask(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": text}], **extra}


def test_only_requests_the_cache_can_match_semantically_are_embedded(gateway: Any) -> None:
    gw, rec = gateway
    r, embedded = send(gw, ask("What is the capital of Australia?"))
    assert (r.headers.get("x-tierlane-cache"), embedded) == ("miss", 1)
    cases = {
        "tools": ask("What is the capital of Austria?", tools=TOOLS),
        "past max_text_chars": ask("Explain: " + "the quick brown fox jumps over the lazy dog " * 6),
        "tool result last": {"model": "auto", "tools": TOOLS, "messages": [
            {"role": "user", "content": "Find the capital of Peru."},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "Lima"}]},
    }
    for why, body in cases.items():
        r, embedded = send(gw, body)
        assert embedded == 0, why
        assert r.headers.get("x-tierlane-cache") in ("miss", "bypass"), why
        assert rec.bodies[-1]["messages"] == body["messages"], why
    r, embedded = send(gw, ask("What is the capital of Chile?"), **{"Cache-Control": "no-cache"})
    assert (r.headers.get("x-tierlane-cache"), embedded) == ("bypass", 0)
    r, embedded = send(gw, ask("Which river runs through Vienna?"), key=QUIET_KEY)  # this tenant's cache is off
    assert (r.headers.get("x-tierlane-cache"), embedded) == (None, 0)  # no cache header: off
    r, embedded = send(gw, ask("Which river runs through Vienna?"))  # the same request of a tenant with it on
    assert (r.headers.get("x-tierlane-cache"), embedded) == ("miss", 1)
