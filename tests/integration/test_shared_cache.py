"""The semantic cache shared by two gateway replicas through a real Valkey server
(`state.backend: redis`): an answer admitted through one is served by the other (exact and
paraphrase), a purge on one reaches both, tenants stay apart, and a store outage fails no
request (misses), with hits again once the store is back.

Real embedder and faiss on each replica. The upstream is a fixed-answer stub (tests/support/faults.py,
mode "ok"), not llama.cpp: what is checked is the gateway's and the store's own state (what is
cached, shared, purged and served from the cache), and a fixed answer and the stub's hit count
make "served from the cache" checkable; no claim here is about an upstream's answers.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from gateway.auth import hash_key
from gateway.keys import SERVICES
from policies.cache.scope import CacheKey
from policies.cache.shared import SharedCache, open_shared_cache
from policies.embedding.embedder import DIMENSION
from policies.policy import Policy
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app
from tests.support.valkey import ValkeyServer, through_an_outage

pytestmark = pytest.mark.slow  # the embedder loads a real model on every replica

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


def _replicas(
    bg: BackgroundLoop, make_gateway: Any, tmp_path: Path, valkey: ValkeyServer, **state: Any
) -> tuple[list[Any], Recorder]:
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text=ANSWER))
    return [_replica(make_gateway, tmp_path, valkey, up.url, i, **state) for i in range(2)], rec


def _replica(make_gateway: Any, tmp_path: Path, valkey: ValkeyServer, upstream_url: str, i: int, **state: Any) -> Any:
    base = {
        **PASS_THROUGH,
        "embedder": {"enabled": True},
        "policy": {**PASS_THROUGH["policy"], "cache": {"enabled": True, "verify": {"min_probability": LENIENT}}},
    }
    return make_gateway(
        base=base,
        state_dir=str(tmp_path / f"replica{i}"),
        auth={"mode": "keys", "keys": KEYS},
        upstreams=[upstream_cfg("up", upstream_url + "/v1", models=["m"], retries=0)],
        state={"backend": "redis", "url": valkey.url, **state},
    )


def chat(gw: Any, text: str, key: str = ACME, *, store: bool = True) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({} if store else {"Cache-Control": "no-store"})}
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def wait_for_hit(gw: Any, text: str, key: str = ACME, within: float = 60.0) -> None:
    """Poll until `text` is a hit on `gw` (asked with no-store, so asking stores nothing); `within` is
    a bound only a hit that never comes reaches."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        r = chat(gw, text, key, store=False)
        assert r.status_code == 200, r.text
        if r.headers["x-tierlane-cache"] == "hit":
            assert r.json()["choices"][0]["message"]["content"] == ANSWER
            return
        time.sleep(0.02)
    raise AssertionError(f"{text!r} never became a hit on {gw.url}")


def assert_hit(gw: Any, text: str) -> None:
    """`text` is a hit on `gw` the first time it is asked (a miss would also reach the upstream)."""
    r = chat(gw, text, store=False)
    assert r.status_code == 200 and r.headers["x-tierlane-cache"] == "hit", (r.status_code, r.headers, r.text)
    assert r.json()["choices"][0]["message"]["content"] == ANSWER


def caught_up(bg: Any, gw: Any) -> None:
    """`gw` has read the cache's stream as far as it went now (its snapshot taken): every entry stored
    so far is in its index. The cache's own wait, where "within a second" was a guess at its speed."""
    bg.call(gw.app[SERVICES].cache.catch_up(60.0))


def test_entries_hits_purges_and_tenants_are_shared_by_replicas(bg, valkey, make_gateway, tmp_path):
    (a, b), rec = _replicas(bg, make_gateway, tmp_path, valkey)
    first = chat(a, QUESTION)
    assert first.status_code == 200 and first.headers["x-tierlane-cache"] == "miss"
    wait_for_hit(a, QUESTION)  # admitted (after the answer was sent)
    assert_hit(b, QUESTION)  # the exact key, from the store
    caught_up(bg, b)
    assert_hit(b, PARAPHRASE)  # the vector, from the stream
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
    # B reads the purge event from the stream: its index soon holds no vector of acme
    deadline = time.monotonic() + 60
    while (stats := bg.call(b.app[SERVICES].cache.stats()))["vectors"] != 0:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert stats["backend"] == "redis" and stats["errors"] == 0, stats


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


def test_a_store_outage_mid_traffic_fails_no_request_and_hits_resume(bg, valkey, make_gateway, tmp_path):
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
    wait_for_hit(a, question)
    wait_for_hit(a, "at what temperature does water boil on everest")
    # A purge the store cannot carry out says so (nothing was purged) instead of pretending.
    valkey.kill()
    r = httpx.delete(a.url + "/v1/cache", params={"tenant": "acme"}, headers={"Authorization": f"Bearer {OPS}"}, timeout=30)
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
    assert chat(a, question).status_code == 200  # and requests are still answered


OTHER_QUESTIONS = ["What is the capital city of Australia?", "How do I reverse a list in Python?"]


def test_a_replica_started_after_the_stream_was_trimmed_still_knows_every_live_entry(bg, valkey, make_gateway, tmp_path):
    """The stream keeps only the latest events: a replica that starts after older `add`s were
    trimmed away loads the vectors of the live entries from the store itself (the snapshot)."""
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text=ANSWER))
    a = _replica(make_gateway, tmp_path, valkey, up.url, 0)
    for text in (QUESTION, *OTHER_QUESTIONS):
        assert chat(a, text).headers["x-tierlane-cache"] == "miss"
        wait_for_hit(a, text)  # admitted
    assert_hit(a, PARAPHRASE)  # its own entries are in its index at once
    store = redis.Redis.from_url(valkey.url)
    try:
        stream = "tierlane:cache:stream"
        assert store.xlen(stream) == 3
        # An entry whose expiry has passed (its key's ttl not yet): never loaded.
        live = store.hgetall(next(iter(store.scan_iter(match="tierlane:{acme}:cache:e:*"))))
        store.hset("tierlane:{acme}:cache:e:" + "0" * 64, mapping={**live, b"id": b"7", b"exp": repr(time.time() - 1)})
        store.xtrim(stream, maxlen=0, approximate=False)
        assert store.xlen(stream) == 0
    finally:
        store.close()

    b = _replica(make_gateway, tmp_path, valkey, up.url, 1)
    caught_up(bg, b)  # its snapshot taken (until then it serves exact matches only)
    assert_hit(b, PARAPHRASE)  # the vector, from the snapshot (no event left)
    para = chat(b, PARAPHRASE, store=False)
    assert 0.8 < float(para.headers["x-tierlane-cache-similarity"]) < 1.0
    stats = bg.call(b.app[SERVICES].cache.stats())
    assert stats["snapshots"] == 1 and stats["snapshot_entries"] == 3, stats
    assert stats["entries_known"] == 3 and stats["vectors"] == 3 and stats["errors"] == 0, stats
    assert rec.hits == 3  # one upstream call per question, none for B


async def test_a_follower_that_resumes_after_the_stream_was_trimmed_past_it_takes_a_new_snapshot(valkey):
    """The shared cache alone (no gateway): B's follower fails while A stores; a snapshot again
    only when the stream was trimmed past B's position meanwhile."""
    policy = Policy.load(extra={"cache": {"enabled": True}})
    # A prefix with glob metacharacters: the snapshot's SCAN matches it literally.
    a, b = [
        await open_shared_cache(
            policy, valkey.url, key_prefix="t[1]*:", connect_timeout_s=1.0, op_timeout_s=1.0, stream_max_len=1000
        )
        for _ in range(2)
    ]
    config = a.config_for(tenant="acme", app="web", model="m", route=None)
    rng = np.random.default_rng(7)

    async def put(i: int) -> None:
        vector = rng.standard_normal(DIMENSION).astype(np.float32)
        key = CacheKey(scope="s" * 64, exact=f"{i:064x}", text=f"question {i}", tenant="acme", model="m")
        assert await a.store(key, vector / np.linalg.norm(vector), {"choices": []}, None, config) > 0

    async def known(cache: SharedCache, entries: int, snapshots: int = 1) -> dict[str, Any]:
        # NOTE: a snapshot indexes entries as it reads them and counts itself once done: wait for both
        deadline = asyncio.get_running_loop().time() + 60
        while asyncio.get_running_loop().time() < deadline:
            stats = await cache.stats()
            if stats["entries_known"] == entries and stats["snapshots"] >= snapshots:
                return stats
            await asyncio.sleep(0.05)
        raise AssertionError(stats)

    down, failed = asyncio.Event(), asyncio.Event()
    xread = b._follower.xread

    async def flaky_xread(*args: Any, **kwargs: Any) -> Any:
        if down.is_set():
            failed.set()
            await asyncio.sleep(0.05)
            raise redis.ConnectionError("down for the test")
        return await xread(*args, **kwargs)

    async def follower_down() -> None:
        failed.clear()
        down.set()
        await asyncio.wait_for(failed.wait(), 60.0)  # the XREAD blocked when it went down has returned (<= 1 s)

    b._follower.xread = flaky_xread  # type: ignore[method-assign]
    try:
        # Not an entry: a hits counter a touch left after its entry went (no id, no exp).
        await a.client.call("HSET", "t[1]*:{acme}:cache:e:" + "f" * 64, "hits", 1)
        await put(1)
        stats = await known(b, 1)  # from the stream (B's snapshot at start may or may not have seen it)
        assert stats["snapshots"] == 1 and stats["vectors"] == 1, stats

        await follower_down()  # A's entry reaches B through the stream once it is back
        await put(2)
        down.clear()
        stats = await known(b, 2)
        assert stats["snapshots"] == 1 and stats["vectors"] == 2, stats

        await follower_down()  # and now the stream is trimmed past B's position meanwhile: a snapshot again
        await put(3)
        await a.client.call("XTRIM", "t[1]*:cache:stream", "MAXLEN", 0)
        down.clear()
        stats = await known(b, 3, snapshots=2)
        assert stats["snapshots"] == 2 and stats["snapshot_entries"] >= 3 and stats["vectors"] == 3, stats
    finally:
        await a.close()
        await b.close()


async def test_a_store_where_nothing_was_ever_cached_is_not_snapshotted_again_and_again(valkey):
    """No stream yet (nothing stored, or a store that came back empty): the periodic trim check
    must not take a snapshot, a SCAN of the whole keyspace, every time it runs."""
    policy = Policy.load(extra={"cache": {"enabled": True}})
    cache = await open_shared_cache(policy, valkey.url, key_prefix="t:", connect_timeout_s=1.0, op_timeout_s=1.0,
                                    stream_max_len=1000)  # fmt: skip
    try:
        await cache.catch_up(5.0)
        assert (await cache.stats())["snapshots"] == 1
        assert await cache._trimmed_past("0-0") is False
        assert await cache._trimmed_past("1700000000000-0") is True  # had read events: the store lost them
    finally:
        await cache.close()
