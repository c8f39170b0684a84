"""The semantic cache shared by two gateway replicas through a real Valkey server
(`state.backend: redis`): an answer admitted through one is served by the other (exact and
paraphrase), a purge on one reaches both, tenants stay apart, and a store outage fails no
request (misses), with hits again once the store is back.

Real embedder and faiss on each replica; the upstream is a fault upstream (tests/support/faults.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.auth import hash_key
from gateway.keys import SERVICES
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app
from tests.support.valkey import ValkeyServer, through_an_outage

ACME, GLOBEX, OPS = "sk-acme-shared-cache", "sk-globex-shared-cache", "sk-ops-shared-cache"
KEYS = [
    {"sha256": hash_key(ACME), "tenant": "acme", "app": "web"},
    {"sha256": hash_key(GLOBEX), "tenant": "globex", "app": "web"},
    {"sha256": hash_key(OPS), "tenant": "ops", "admin": True},
]
QUESTION = "How long should I boil water to make it safe to drink?"
PARAPHRASE = "how long do i need to boil water so that it is safe to drink"
# The shipped min_probability (0.96) serves only near-rewrites; the paraphrase path is exercised
# with a lenient policy an operator may set.
LENIENT = 0.5
ANSWER = "Boil the water for ten minutes"


def _replicas(bg: BackgroundLoop, make_gateway: Any, tmp_path: Path, valkey: ValkeyServer, **state: Any) -> tuple[list[Any], Recorder]:
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text=ANSWER))
    base = {**PASS_THROUGH, "embedder": {"enabled": True}, "policy": {**PASS_THROUGH["policy"], "cache": {"enabled": True, "verify": {"min_probability": LENIENT}}}}
    replicas = [
        make_gateway(
            base=base,
            state_dir=str(tmp_path / f"replica{i}"),
            auth={"mode": "keys", "keys": KEYS},
            upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"], retries=0)],
            state={"backend": "redis", "url": valkey.url, **state},
        )
        for i in range(2)
    ]
    return replicas, rec


def chat(gw: Any, text: str, key: str = ACME, *, store: bool = True) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({} if store else {"Cache-Control": "no-store"})}
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def wait_for_hit(gw: Any, text: str, key: str = ACME, within: float = 10.0) -> float:
    """Seconds until `text` is a hit on `gw` (asked with no-store, so asking stores nothing)."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        r = chat(gw, text, key, store=False)
        assert r.status_code == 200, r.text
        if r.headers["x-tierlane-cache"] == "hit":
            assert r.json()["choices"][0]["message"]["content"] == ANSWER
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"{text!r} never became a hit on {gw.url}")


def test_entries_hits_purges_and_tenants_are_shared_by_replicas(bg, make_gateway, tmp_path, valkey):
    (a, b), rec = _replicas(bg, make_gateway, tmp_path, valkey)
    first = chat(a, QUESTION)
    assert first.status_code == 200 and first.headers["x-tierlane-cache"] == "miss"
    wait_for_hit(a, QUESTION)  # admitted (after the answer was sent)
    assert wait_for_hit(b, QUESTION, within=1.0) < 1.0  # the exact key, from the store
    assert wait_for_hit(b, PARAPHRASE, within=1.0) < 1.0  # the vector, from the stream
    para = chat(b, PARAPHRASE, store=False)
    assert 0.8 < float(para.headers["x-tierlane-cache-similarity"]) < 1.0
    assert rec.hits == 1  # only the first request reached the upstream

    # Another tenant never sees acme's entry, on either replica.
    for gw in (a, b):
        assert chat(gw, QUESTION, GLOBEX, store=False).headers["x-tierlane-cache"] == "miss"
        assert chat(gw, PARAPHRASE, GLOBEX, store=False).headers["x-tierlane-cache"] == "miss"

    # A tenant purge on A: gone on B at once (exact and semantic).
    r = httpx.delete(a.url + "/v1/cache", params={"tenant": "acme"}, headers={"Authorization": f"Bearer {OPS}"}, timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] == 1, r.text
    for gw in (b, a):
        assert chat(gw, QUESTION, store=False).headers["x-tierlane-cache"] == "miss"
        assert chat(gw, PARAPHRASE, store=False).headers["x-tierlane-cache"] == "miss"

    # Stored again through B, purged by key on A.
    chat(b, QUESTION)
    wait_for_hit(a, PARAPHRASE)
    key = chat(a, QUESTION, store=False).headers["x-tierlane-cache-key"]
    r = httpx.delete(a.url + f"/v1/cache/{key}", headers={"Authorization": f"Bearer {OPS}"}, timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] == 1, r.text
    for gw in (a, b):
        assert chat(gw, QUESTION, store=False).headers["x-tierlane-cache"] == "miss"
        assert chat(gw, PARAPHRASE, store=False).headers["x-tierlane-cache"] == "miss"
    time.sleep(0.5)  # B has read the purge event by now: its index holds no vector of acme
    stats = bg.call(b.app[SERVICES].cache.stats())
    assert stats["backend"] == "redis" and stats["vectors"] == 0 and stats["errors"] == 0, stats


async def _traffic_through_an_outage(urls: list[str], valkey: ValkeyServer) -> list[tuple[int, str]]:
    """Four callers ask (half of them the same question) while the store is killed, then started again."""
    results: list[tuple[int, str]] = []

    async def send(client: httpx.AsyncClient, i: int) -> None:
        text = QUESTION if i % 2 else f"Question number {i} about boiling water for tea?"
        body = {"model": "m", "messages": [{"role": "user", "content": text}]}
        r = await client.post(urls[i % len(urls)] + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {ACME}"})  # fmt: skip
        results.append((r.status_code, r.headers.get("x-tierlane-cache", "")))

    await through_an_outage(valkey, send, before_s=1.0, down_s=1.5)
    return results


def test_a_store_outage_mid_traffic_fails_no_request_and_hits_resume(bg, make_gateway, tmp_path, valkey):
    (a, b), _ = _replicas(bg, make_gateway, tmp_path, valkey, op_timeout_ms=200)
    results = asyncio.run(_traffic_through_an_outage([a.url, b.url], valkey))
    statuses = [status for status, _ in results]
    print(f"{len(results)} requests through the outage, {sum(c == 'hit' for _, c in results)} hits")
    assert statuses and set(statuses) == {200}, statuses
    errors = [bg.call(gw.app[SERVICES].cache.stats())["errors"] for gw in (a, b)]
    assert sum(errors) >= 1, errors
    # The store came back empty: a new answer through B is served by A again.
    question = "What temperature does water boil at on Everest?"
    time.sleep(0.6)  # past the back-off of the last failure
    assert chat(b, question).headers["x-tierlane-cache"] == "miss"
    assert wait_for_hit(a, question, within=3.0) < 3.0
    assert wait_for_hit(a, "at what temperature does water boil on everest", within=3.0) < 3.0
    # A purge the store cannot carry out says so (nothing was purged) instead of pretending.
    valkey.kill()
    r = httpx.delete(a.url + "/v1/cache", params={"tenant": "acme"}, headers={"Authorization": f"Bearer {OPS}"}, timeout=30)
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
    assert chat(a, question).status_code == 200  # and requests are still answered
