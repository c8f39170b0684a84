"""Hostile inputs against a running gateway: JSON schemas that once killed or stalled it, and a store outage.

1. Schemas: a gateway process (keys mode, the real edge engine, a fixed-answer upstream) gets
   every hostile schema family below at every size, on `auto` and pinned to the edge, while
   another tenant sends plain edge requests one after another. Counted: process deaths, 5xx,
   statuses; the plain requests' latency during the hostile run beside the same requests with no
   hostile traffic.
2. Outage: two replicas (SharedBudgets, as a gateway runs it) share a limit of 20 requests per
   minute in a real Valkey; 16 requests are spread over both, then the store is paused for 3 s
   (CLIENT PAUSE) while both keep asking. Admitted during the pause beside what was left, per
   outage mode, side by side.
3. Bodies: a gateway process (keys mode, cache, embedder, budgets, a fixed-answer upstream) gets
   the request bodies that once froze it or filled its store, each family within the body limit,
   while another tenant sends plain chat requests one after another: per family, the worst and
   the p99 latency of that tenant's requests while it ran (beside the same requests with no
   hostile traffic), the gateway's peak RSS growth, 5xx answers, and the hostile tenant's stored
   responses against its quota.
4. Route bound stall: the routing quality bound at its maximum (4,096 (tenant/app, region) states,
   1,000 judgements each, every one changed since the last snapshot) is snapshotted by the local
   log (a compaction) and by a shared-log replica (its offer, the store call a no-op) while a task
   on the event loop asks a region's threshold every millisecond, as the route stage does: the
   longest gap between two of its ticks, beside the previous code's way (the whole snapshot built
   under the bound's lock and serialised in one call on a worker thread) on the same states, and
   beside the same ticker's longest gap over 2 s of nothing (the machine's own floor).
   Run alone: --parts route_bound_stall
5. Store overshoot: a gateway process (keys mode, a fixed-answer upstream, a 10 MiB stored-responses
   quota) gets 64 concurrent `/v1/responses` requests of 400 KiB each (distinct inputs) from one
   tenant: the bytes it stored against the quota, and the overshoot in requests (<= 1 wanted).
   Run alone: --parts store_overshoot
6. Judging shares: the review's attack on the shadow stage (the routing bound's re-asks), driven
   through the real hook with a stand-in upstream that answers at once and a clock that moves
   0.1 s a request: tenant `flood` sends 400 auto requests (64 KiB prompts, then short ones) with
   20 of tenant `light`'s interleaved, all sampled, within one minute. Judged per tenant under
   the per-minute cap (re-asks finish at once) and queued per tenant under the queue (none
   finishes), each as a share of an equal share (target >= 0.4).
   Run alone: --parts judging_shares
7. Edge pull: `tierlane edge pull`'s download (edge_engine.model_pull) against a local aiohttp
   server with the hub's layout (tests/support/hub_server.py) that misbehaves: one that drips a
   byte every 0.8 s (at the shipped bounds, and at a 5 s time bound and a 3 s rate window), and one
   that sends a body with no Content-Length far past the file (at a 16 MiB size bound, and with the
   size the hub lists for the pinned digest). Per case: seconds until the pull stopped beside its
   bound, bytes written at most beside the size bound, and whether the partial file was removed.
   Run alone: --parts edge_pull
8. Placement flood (bench/placement_flood.py): one tenant sends a new session per request until the
   table holds 200,000 live sessions while another sends plain requests; the bystander's p50 beside
   a flat run (the same flood naming one session), and the table's cost per placement at 100 and
   200,000 live sessions. Run alone: --parts placement_flood

Writes bench/results/hostile_inputs.json. Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/hostile_inputs.py
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import RESULTS, free_port, gateway_cmd, pct, start, stop, write
from bench._verdicts import verdicts
from bench.placement_flood import placement_flood
from gateway.auth import hash_key

HOSTILE_KEY, PLAIN_KEY = "tl-hostile", "tl-plain"
SIZES = [1, 10, 100, 300, 999, 1000, 1001, 1500, 5000, 10_000, 20_000, 30_000, 10**6, 10**9]
FAMILIES: dict[str, Any] = {
    "maxLength": lambda n: {"type": "string", "maxLength": n},
    "minLength": lambda n: {"type": "string", "minLength": n},
    "maxItems": lambda n: {"type": "array", "items": {"type": "integer"}, "maxItems": n},
    "minItems": lambda n: {"type": "array", "items": {"type": "string"}, "minItems": n},
    "pattern": lambda n: {"type": "string", "pattern": f"^a{{0,{n}}}$"},
    "nested pattern": lambda n: {"type": "string", "pattern": f"^(ab{{0,{min(n, 2000)}}}c){{0,{min(n, 2000)}}}$"},
    "enum": lambda n: {"enum": [f"value-{i}" for i in range(min(n, 50_000))]},
    "anyOf consts": lambda n: {"anyOf": [{"const": i} for i in range(min(n, 5000))]},
    "deep object": lambda n: _deep({"type": "string", "maxLength": min(n, 2000)}, 30),
    "recursive ref": lambda n: {"type": "object", "properties": {"a": {"$ref": "#/definitions/n"}},
                                "definitions": {"n": {"type": "object", "properties": {"next": {"$ref": "#/definitions/n"}}}}},
}


def _deep(schema: dict[str, Any], depth: int) -> dict[str, Any]:
    for i in range(depth):
        schema = {"type": "object", "properties": {f"p{i}": schema}, "required": [f"p{i}"]}
    return schema


def _body(model: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 4,
                            "temperature": 0}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return body


def plain_latencies(url: str, stop_event: threading.Event, out: list[float], failures: list[int]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop_event.is_set():
            t0 = time.perf_counter()
            r = client.post(url + "/v1/chat/completions", json=_body("edge", None), headers={"Authorization": f"Bearer {PLAIN_KEY}"})
            out.append(time.perf_counter() - t0)
            if r.status_code != 200:
                failures.append(r.status_code)


def schemas(work: Path) -> dict[str, Any]:
    up_port, gw_port = free_port(), free_port()
    upstream = start([sys.executable, str(Path(__file__).with_name("fast_upstream.py")), "--port", str(up_port)],
                     f"http://127.0.0.1:{up_port}/v1/models", work / "upstream.log")
    config = {
        "auth": {"mode": "keys", "keys": [{"sha256": hash_key(HOSTILE_KEY), "tenant": "mallory"},
                                          {"sha256": hash_key(PLAIN_KEY), "tenant": "alice"}]},
        "state_dir": str(work / "state"),
        "upstreams": [{"name": "fast", "base_url": f"http://127.0.0.1:{up_port}/v1", "models": ["fast-model"], "retries": 0}],
        "edge": {"slots": 4},
    }
    gateway = start(gateway_cmd(config, work / "gateway.yaml", gw_port), f"http://127.0.0.1:{gw_port}/readyz", work / "gateway.log")
    url = f"http://127.0.0.1:{gw_port}"
    cases = [(model, family, n) for model, (family, n) in itertools.product(("auto", "edge"), itertools.product(FAMILIES, SIZES))]
    try:
        quiet: list[float] = []
        stop_quiet = threading.Event()
        failures: list[int] = []
        t = threading.Thread(target=plain_latencies, args=(url, stop_quiet, quiet, failures))
        t.start()
        time.sleep(15)
        stop_quiet.set()
        t.join()
        during: list[float] = []
        stop_during = threading.Event()
        t = threading.Thread(target=plain_latencies, args=(url, stop_during, during, failures))
        t.start()
        statuses: dict[str, int] = {}
        deaths = 0
        slowest: tuple[float, str] = (0.0, "")
        with httpx.Client(timeout=120) as client:
            for model, family, n in tqdm(cases, desc="hostile schemas", unit="req"):
                t0 = time.perf_counter()
                try:
                    r = client.post(url + "/v1/chat/completions", json=_body(model, FAMILIES[family](n)),
                                    headers={"Authorization": f"Bearer {HOSTILE_KEY}"})
                    key = f"{model} {r.status_code}"
                except httpx.TransportError:
                    key = f"{model} connection lost"
                statuses[key] = statuses.get(key, 0) + 1
                slowest = max(slowest, (time.perf_counter() - t0, f"{model} {family} {n}"))
                if gateway.poll() is not None:
                    deaths += 1
                    break
        stop_during.set()
        t.join()
    finally:
        stop(gateway)
        stop(upstream)
    five_xx = sum(v for k, v in statuses.items() if k.split()[1].startswith("5"))
    p99_during = pct(during, 0.99) * 1000
    return {
        "cases": len(cases),
        "families": list(FAMILIES),
        "sizes": SIZES,
        "statuses": statuses,
        "process_deaths": deaths,
        "responses_5xx": five_xx,
        "slowest_hostile_request": {"seconds": round(slowest[0], 3), "case": slowest[1]},
        "plain_edge_other_tenant": {
            "quiet": {"n": len(quiet), "p50_ms": round(pct(quiet, 0.5) * 1000, 1), "p99_ms": round(pct(quiet, 0.99) * 1000, 1)},
            "during_hostile": {"n": len(during), "p50_ms": round(pct(during, 0.5) * 1000, 1), "p99_ms": round(p99_during, 1)},
            "failures": len(failures),
        },
    }


async def outage_idle(work: Path, idle_s: float = 150.0) -> dict[str, Any]:
    """One replica, 20 requests/min: one request, `idle_s` of nothing, then the store paused while
    100 requests are asked: admitted beside the one window's limit (before the bucket: 69 of 100)."""
    import redis.asyncio as aioredis

    from policies.budgets import Budgets
    from policies.errors import LimitExceeded, StoreUnavailable
    from policies.policy import Policy
    from policies.shared_state.redis_budgets import RedisBudgets
    from policies.shared_state.redis_mux import MuxClient
    from policies.shared_state.shared_budgets import SharedBudgets
    from tests.support.valkey import ValkeyServer

    limit, asked = 20, 100
    directory = work / "valkey-idle"
    directory.mkdir()
    server = ValkeyServer(directory)
    admin = aioredis.Redis.from_url(server.url)
    budgets = Budgets(Policy.load(extra={"budgets": {"enabled": True, "tenant": {"requests_per_minute": limit}}}))
    shared = SharedBudgets(budgets, RedisBudgets(budgets, MuxClient(server.url, connect_timeout_s=0.1, stale_after_s=1.0)),
                           op_timeout_s=0.1, on_outage="local_share", heartbeat_s=0.5)  # type: ignore[arg-type]
    try:
        await shared.beat()
        await shared.admit("first", "acme", "web", 5, 0.0)
        await shared.settle("first", 5, 0.0)
        for _ in tqdm(range(int(idle_s)), desc=f"idle {idle_s:g} s", unit="s"):
            await asyncio.sleep(1.0)
        pause_s = 30.0  # longer than the asking takes (each ask waits op_timeout, 0.1 s): all of it is in the outage
        await admin.execute_command("CLIENT", "PAUSE", int(pause_s * 1000), "ALL")
        paused_at = time.monotonic()
        admitted = 0
        asking_started = time.monotonic()
        for i in range(asked):
            if time.monotonic() - paused_at > pause_s - 1.0:
                raise RuntimeError("the store pause ended before the asking did")
            try:
                await shared.admit(f"i{i}", "acme", "web", 5, 0.0)
                admitted += 1
            except (LimitExceeded, StoreUnavailable):
                pass
        asking_s = time.monotonic() - asking_started
    finally:
        await shared.close()
        await admin.aclose()
        server.stop()
    # what one window allows over the asking: the limit at once, then its rate (each ask waits op_timeout)
    bound = limit * (1 + asking_s / 60.0)
    return {"setup": f"one replica, {limit} requests/min, one request then {idle_s:g} s idle, then the store paused and "
                     f"{asked} asked one after another", "limit_per_minute": limit, "asked": asked, "admitted": admitted,
            "asking_s": round(asking_s, 2), "window_bound": round(bound, 2)}


async def outage(work: Path) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from policies.budgets import Budgets
    from policies.errors import LimitExceeded, StoreUnavailable
    from policies.policy import Policy
    from policies.shared_state.redis_budgets import RedisBudgets
    from policies.shared_state.redis_mux import MuxClient
    from policies.shared_state.shared_budgets import SharedBudgets
    from tests.support.valkey import ValkeyServer

    limit, before, pause_s = 20, 16, 3.0
    rows = {}
    for mode in tqdm(["local_share", "allow", "deny"], desc="outage modes"):
        directory = work / f"valkey-{mode}"
        directory.mkdir()
        server = ValkeyServer(directory)
        admin = aioredis.Redis.from_url(server.url)
        budgets = Budgets(Policy.load(extra={"budgets": {"enabled": True, "tenant": {"requests_per_minute": limit}}}))
        fleet = [SharedBudgets(budgets, RedisBudgets(budgets, MuxClient(server.url, connect_timeout_s=0.1, stale_after_s=1.0)),
                               op_timeout_s=0.1, on_outage=mode, heartbeat_s=0.5) for _ in range(2)]  # type: ignore[arg-type]
        try:
            for shared in fleet * 2:
                await shared.beat()

            async def ask(shared: SharedBudgets, key: str) -> bool:
                try:
                    await shared.admit(key, "acme", "web", 5, 0.0)
                except (LimitExceeded, StoreUnavailable):
                    return False
                await shared.settle(key, 5, 0.0)
                return True

            admitted_before = sum([await ask(fleet[i % 2], f"b{i}") for i in range(before)])
            await admin.execute_command("CLIENT", "PAUSE", int(pause_s * 1000), "ALL")
            started = time.monotonic()
            during = 0
            i = 0
            while time.monotonic() - started < pause_s - 0.3:
                during += await ask(fleet[i % 2], f"d{i}")
                i += 1
            left = limit - admitted_before
            rows[mode] = {"admitted_before": admitted_before, "left_at_pause": left, "asked_during_pause": i,
                          "admitted_during_pause": during, "beyond_limit": max(0, during - left),
                          "beyond_limit_per_replica": round(max(0, during - left) / len(fleet), 2)}
        finally:
            for shared in fleet:
                await shared.close()
            await admin.aclose()
            server.stop()
    return {
        "setup": f"two replicas, {limit} requests/min for one tenant, {before} admitted spread over both, then a "
                 f"{pause_s:g} s CLIENT PAUSE while both keep asking; op_timeout 100 ms",
        "modes": rows,
    }


def _marks(n: int) -> str:
    """N combining acute accents then N combining graves below: CPython's NFKC reordering is O(N^2) on it."""
    return "a" + "\u0301" * n + "\u0316" * n


BODY_FAMILIES: dict[str, tuple[str, Any, int]] = {
    # family: (path, body, times sent)
    "combining marks 156 KB, chat": ("/v1/chat/completions", {"model": "fast-model", "max_tokens": 4,
                                     "messages": [{"role": "user", "content": _marks(39_000)}]}, 2),
    "combining marks 3.9 MB, messages": ("/v1/messages", {"model": "fast-model", "max_tokens": 4,
                                         "messages": [{"role": "user", "content": _marks(990_000)}]}, 1),
    "combining marks 1 MB, responses": ("/v1/responses", {"model": "fast-model", "max_output_tokens": 4, "store": False,
                                        "input": _marks(250_000)}, 1),
    "count_tokens 3.9 MB of punctuation": ("/v1/messages/count_tokens", {"model": "fast-model",
                                           "messages": [{"role": "user", "content": "!?" * 1_950_000}]}, 2),
    "responses 120k items": ("/v1/responses", {"model": "fast-model", "store": False,
                             "input": [{"role": "user", "content": "x"}] * 120_000}, 2),
    "stored responses 1 MB each": ("/v1/responses", {"model": "fast-model", "max_output_tokens": 4,
                                   "input": "y" * 1_000_000}, 24),
}
STORE_QUOTA_BYTES = 16 * 1024 * 1024


def _rss_kb(pid: int, field: str = "VmHWM") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def bodies(work: Path) -> dict[str, Any]:
    up_port, gw_port = free_port(), free_port()
    upstream = start([sys.executable, str(Path(__file__).with_name("fast_upstream.py")), "--port", str(up_port)],
                     f"http://127.0.0.1:{up_port}/v1/models", work / "upstream-bodies.log")
    config = {
        "auth": {"mode": "keys", "keys": [{"sha256": hash_key(HOSTILE_KEY), "tenant": "mallory"},
                                          {"sha256": hash_key(PLAIN_KEY), "tenant": "alice"}]},
        "state_dir": str(work / "state-bodies"),
        "upstreams": [{"name": "fast", "base_url": f"http://127.0.0.1:{up_port}/v1", "models": ["fast-model"], "retries": 0}],
        "edge": {"enabled": False},
        "responses": {"max_bytes_per_tenant": STORE_QUOTA_BYTES},
        "policy": {"budgets": {"enabled": True, "tenant": {"requests_per_minute": 100_000}}},
    }
    gateway = start(gateway_cmd(config, work / "gateway-bodies.yaml", gw_port), f"http://127.0.0.1:{gw_port}/readyz",
                    work / "gateway-bodies.log")
    url = f"http://127.0.0.1:{gw_port}"
    stamps: list[tuple[float, float]] = []  # (start, seconds) of each plain request
    failures: list[int] = []
    stop_event = threading.Event()

    def plain() -> None:
        body = {"model": "fast-model", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
        with httpx.Client(timeout=120) as client:
            while not stop_event.is_set():
                t0 = time.perf_counter()
                r = client.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {PLAIN_KEY}"})
                stamps.append((t0, time.perf_counter() - t0))
                if r.status_code != 200:
                    failures.append(r.status_code)

    def window(lo: float, hi: float) -> list[float]:
        return [sec for start_at, sec in stamps if start_at + sec >= lo and start_at <= hi]

    families: dict[str, Any] = {}
    try:
        thread = threading.Thread(target=plain)
        thread.start()
        time.sleep(5)
        quiet = window(0, time.perf_counter())
        with httpx.Client(timeout=300) as client:
            for family, (path, body, times) in tqdm(BODY_FAMILIES.items(), desc="hostile bodies", unit="family"):
                payload = orjson.dumps(body)
                hwm_before = _rss_kb(gateway.pid)
                statuses: dict[str, int] = {}
                lo = time.perf_counter()
                slowest = 0.0
                for _ in range(times):
                    t0 = time.perf_counter()
                    try:
                        r = client.post(url + path, content=payload, headers={"Authorization": f"Bearer {HOSTILE_KEY}",
                                                                              "Content-Type": "application/json"})
                        key = str(r.status_code)
                    except httpx.TransportError:
                        key = "connection lost"
                    statuses[key] = statuses.get(key, 0) + 1
                    slowest = max(slowest, time.perf_counter() - t0)
                time.sleep(0.3)  # plain requests stuck behind the last one end inside the window
                seen = window(lo, time.perf_counter())
                families[family] = {
                    "body_bytes": len(payload), "sent": times, "statuses": statuses,
                    "slowest_hostile_s": round(slowest, 3),
                    "other_tenant": {"n": len(seen), "p99_ms": round(pct(seen, 0.99) * 1000, 1) if seen else None,
                                     "max_ms": round(max(seen) * 1000, 1) if seen else None},
                    "peak_rss_growth_mb": round((_rss_kb(gateway.pid) - hwm_before) / 1024, 1),
                }
        stop_event.set()
        thread.join()
        store = work / "state-bodies" / "responses.sqlite3"
        import sqlite3

        conn = sqlite3.connect(store)
        try:
            stored = {t: {"records": n, "bytes": b} for t, n, b in conn.execute(
                "SELECT tenant, COUNT(*), SUM(LENGTH(record)) FROM responses GROUP BY tenant")}
        finally:
            conn.close()
    finally:
        stop_event.set()
        stop(gateway)
        stop(upstream)
    return {
        "body_limit_bytes": 4 * 1024 * 1024,
        "store_quota_bytes_per_tenant": STORE_QUOTA_BYTES,
        "other_tenant_quiet": {"n": len(quiet), "p99_ms": round(pct(quiet, 0.99) * 1000, 1),
                               "max_ms": round(max(quiet) * 1000, 1)},
        "other_tenant_failures": len(failures),
        "families": families,
        "stored_by_tenant": stored,
        "responses_5xx": sum(n for f in families.values() for k, n in f["statuses"].items() if k.startswith("5")),
    }


async def _loop_stall(work: Any, bounds: Any, probe: tuple[Any, int, Any]) -> tuple[float, float]:
    """(the longest gap in ms between two ticks of a task asking `probe`'s threshold every ms, seconds `work` took)."""
    stop_event = asyncio.Event()
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop_event.is_set():
            await asyncio.sleep(0.001)
            bounds.threshold(*probe)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    worst = 0.0
    t0 = time.perf_counter()
    await work()
    took = time.perf_counter() - t0
    stop_event.set()
    await ticker
    return round(worst * 1000, 1), round(took, 2)


async def route_bound_stall(work: Path, n_states: int = 4096, window: int = 1000) -> dict[str, Any]:
    import gc
    import json
    import random

    from policies.router.route_bound import QualityBound, RouteBounds, Scope
    from policies.router.route_bound_log import LocalBoundLog, SharedBoundLog

    params = QualityBound(max_quality_loss=0.05, start=0.6, sample_rate=1.0)
    probe = (Scope("tenant-0", "app"), 0, params)

    def loaded() -> RouteBounds:
        rng = random.Random(1)
        bounds = RouteBounds(window=window, max_states=n_states)
        bounds.restore_records([  # every state changed since the last snapshot
            {"tenant": f"tenant-{i}", "app": "app", "region": i % 8, "params": params.as_dict(), "threshold": 0.6,
             "window": [[rng.random(), int(rng.random() < 0.02)] for _ in range(window)], "since_move": 0,
             "observed": window, "disagreed": 0, "tightened": 0, "loosened": 0, "at": [i + 1, 0]}
            for i in range(n_states)], changed=True)  # fmt: skip
        gc.collect()
        return bounds

    old_bounds = loaded()
    idle_gap, _ = await _loop_stall(lambda: asyncio.sleep(2.0), old_bounds, probe)  # this machine's floor

    def old_snapshot() -> dict[str, Any]:  # the previous RouteBounds.snapshot(): every state, under the lock
        with old_bounds._lock:
            return {"window": old_bounds.window, "states": [
                {"scope": f"{scope.tenant}/{scope.app}", "region": region, "params": st.params.as_dict(),
                 "threshold": st.threshold, "window": [[s, int(d)] for s, d in st.window], "since_move": st.since_move,
                 "observed": st.observed, "disagreed": st.disagreed, "tightened": st.tightened, "loosened": st.loosened}
                for (scope, region), st in old_bounds._states.items()]}  # fmt: skip

    async def old_way() -> None:  # the previous compaction: that snapshot, json.dumps'd on a worker thread
        text = await asyncio.to_thread(lambda: json.dumps(old_snapshot(), separators=(",", ":")))
        (work / "old-snapshot.json").write_text(text)

    old_gap, old_s = await _loop_stall(old_way, old_bounds, probe)
    snapshot_mb = round((work / "old-snapshot.json").stat().st_size / 1e6, 1)
    old_bounds = RouteBounds()
    local = LocalBoundLog(work / "route-bound", RouteBounds())
    await local.start()
    local.bounds = loaded()
    local_gap, local_s = await _loop_stall(local.close, local.bounds, probe)

    class _NoStore:
        calls = 0

        async def call(self, *args: Any) -> None:
            self.calls += 1

    store = _NoStore()
    shared = SharedBoundLog(store, None, bounds=loaded())
    shared_gap, shared_s = await _loop_stall(shared._offer_snapshot, shared.bounds, probe)
    return {"states": n_states, "window": window, "snapshot_mb": snapshot_mb, "idle_loop_gap_ms": idle_gap,
            "previous_whole_snapshot": {"worst_loop_gap_ms": old_gap, "took_s": old_s},
            "local_compaction": {"worst_loop_gap_ms": local_gap, "took_s": local_s},
            "shared_offer": {"worst_loop_gap_ms": shared_gap, "took_s": shared_s, "store_calls": store.calls}}


OVERSHOOT_QUOTA = 10 * 1024 * 1024
OVERSHOOT_CONCURRENT = 64
OVERSHOOT_INPUT = 400 * 1024


def _stored(path: Path) -> dict[str, dict[str, int]]:
    """Per tenant: records and bytes on disk (the records, plus each stored input once where the schema keeps them apart)."""
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        out = {t: {"records": n, "bytes": b or 0} for t, n, b in conn.execute(
            "SELECT tenant, COUNT(*), SUM(LENGTH(record)) FROM responses GROUP BY tenant")}
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'inputs'").fetchone():
            for tenant, size in conn.execute("SELECT tenant, SUM(LENGTH(body)) FROM inputs GROUP BY tenant"):
                out.setdefault(tenant, {"records": 0, "bytes": 0})["bytes"] += size or 0
    finally:
        conn.close()
    return out


async def store_overshoot(work: Path) -> dict[str, Any]:
    up_port, gw_port = free_port(), free_port()
    upstream = start([sys.executable, str(Path(__file__).with_name("fast_upstream.py")), "--port", str(up_port)],
                     f"http://127.0.0.1:{up_port}/v1/models", work / "upstream-overshoot.log")
    state = work / "state-overshoot"
    config = {
        "auth": {"mode": "keys", "keys": [{"sha256": hash_key(HOSTILE_KEY), "tenant": "mallory"}]},
        "state_dir": str(state),
        "upstreams": [{"name": "fast", "base_url": f"http://127.0.0.1:{up_port}/v1", "models": ["fast-model"], "retries": 0}],
        "edge": {"enabled": False},
        "responses": {"max_bytes_per_tenant": OVERSHOOT_QUOTA},
    }
    try:
        gateway = start(gateway_cmd(config, work / "gateway-overshoot.yaml", gw_port),
                        f"http://127.0.0.1:{gw_port}/readyz", work / "gateway-overshoot.log")
    except BaseException:
        stop(upstream)
        raise
    bodies = [orjson.dumps({"model": "fast-model", "max_output_tokens": 4,
                            "input": f"{i:06d}" + "x" * (OVERSHOOT_INPUT - 6)}) for i in range(OVERSHOOT_CONCURRENT)]
    headers = {"Authorization": f"Bearer {HOSTILE_KEY}", "Content-Type": "application/json"}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw_port}", timeout=300,
                                     limits=httpx.Limits(max_connections=OVERSHOOT_CONCURRENT)) as client:
            t0 = time.perf_counter()
            answers = await asyncio.gather(*(client.post("/v1/responses", content=body, headers=headers)
                                             for body in bodies), return_exceptions=True)
            seconds = time.perf_counter() - t0
    finally:
        stop(gateway)  # records are written behind: on disk once the gateway has closed its store
        stop(upstream)
    statuses: dict[str, int] = {}
    for answer in answers:
        key = str(answer.status_code) if isinstance(answer, httpx.Response) else type(answer).__name__
        statuses[key] = statuses.get(key, 0) + 1
    stored = _stored(state / "responses.sqlite3").get("mallory", {"records": 0, "bytes": 0})
    request_bytes = len(bodies[0])
    over = max(0, stored["bytes"] - OVERSHOOT_QUOTA)
    return {
        "setup": f"{OVERSHOOT_CONCURRENT} concurrent /v1/responses requests of {OVERSHOOT_INPUT // 1024} KiB "
                 f"(distinct inputs), one tenant, quota {OVERSHOOT_QUOTA // (1024 * 1024)} MiB",
        "quota_bytes": OVERSHOOT_QUOTA, "request_bytes": request_bytes, "statuses": statuses,
        "seconds": round(seconds, 2), "stored_records": stored["records"], "stored_bytes": stored["bytes"],
        "stored_over_quota": round(stored["bytes"] / OVERSHOOT_QUOTA, 4),
        "overshoot_bytes": over, "overshoot_requests": round(over / request_bytes, 4),
    }


async def judging_shares(work: Path) -> dict[str, Any]:
    # NOTE: the production ShadowHook and ShadowConfig; only the upstream and the clock stand in
    # (tests/unit/shadow/test_judging_budgets.py asserts the same run)
    from tests.unit.shadow.test_judging_budgets import FakeClock, FakePool, answered, hook_for, interleaved, tiered

    out: dict[str, Any] = {}
    for prompts in ("short", "64KiB"):
        for limit in ("per_minute", "queue"):
            pool, clock = FakePool(), FakeClock()
            if limit == "queue":
                pool.hold = asyncio.Event()  # no re-ask finishes: the queue (max_pending) is what limits them
            directory = work / f"judging-{prompts}-{limit}"
            directory.mkdir()
            hook = hook_for(directory, pool, clock)
            counted = {"flood": 0, "light": 0}
            for i, tenant in enumerate(interleaved()):
                content = ("x" * 65536) if prompts == "64KiB" and tenant == "flood" else f"Question {i}: 2+{i}?"
                before = len(pool.sent) if limit == "per_minute" else len(hook._tasks)
                await hook.on_complete(tiered(tenant, i, content=content), answered())
                if limit == "per_minute":
                    await hook.drain()
                counted[tenant] += (len(pool.sent) if limit == "per_minute" else len(hook._tasks)) - before
                clock.now += 0.1
            capacity = hook.config.max_per_minute if limit == "per_minute" else hook.config.max_pending
            equal = min(20, capacity / 2)
            if pool.hold is not None:
                pool.hold.set()
            await hook.close()
            out[f"{prompts}_{limit}"] = {
                "flood": counted["flood"], "light": counted["light"], "light_wanted": 20, "capacity": capacity,
                "light_share_of_equal": round(counted["light"] / equal, 4),
                "skipped": dict(hook.skipped)}
    return out


def _pull_case(server_knobs: dict[str, Any], limits: Any, timeout_s: float) -> dict[str, Any]:
    """One pull against a misbehaving hub: how long until it stopped, the most bytes it had written, what it said."""
    import hashlib

    from edge_engine.model_pull import PullError, pull
    from edge_engine.model_source import PART_SUFFIX, parse_hub
    from tests.support.hub_server import HubServer, RunningHub, gguf_bytes

    data = gguf_bytes(3 << 20)
    hub_file = parse_hub("hf://acme/tiny-GGUF@v1/tiny.gguf")
    server = HubServer({"acme/tiny-GGUF/v1/tiny.gguf": data})
    for knob, value in server_knobs.items():
        setattr(server, knob, value)
    running = RunningHub(server)
    written = 0

    def follow(done: int, total: int | None) -> None:
        nonlocal written
        written = max(written, done)

    with tempfile.TemporaryDirectory(prefix="tierlane-pull-") as cache:
        part = hub_file.cache_path(cache).with_name(hub_file.cache_path(cache).name + PART_SUFFIX)
        t0 = time.perf_counter()
        try:
            pull(hub_file, hashlib.sha256(data).hexdigest(), cache, endpoint=running.url, retries=0,
                 timeout_s=timeout_s, limits=limits, progress=follow)
            error = None
        except PullError as exc:
            error = str(exc).replace(running.url, "http://hub")
        finally:
            seconds = time.perf_counter() - t0
            running.close()
        return {"stopped_s": round(seconds, 2), "error": error, "bytes_written_max": written,
                "part_file_bytes": part.stat().st_size if part.exists() else None, "file_bytes": len(data)}


def edge_pull(work: Path) -> dict[str, Any]:
    from edge_engine.model_pull import PullLimits

    drip = {"drip_s": 0.8, "drip_bytes": 100_000}  # a byte every 0.8 s: a day for 100 kB
    timeout_s = 10.0
    shipped = PullLimits()
    cases: dict[str, Any] = {}
    for name, knobs, limits in tqdm([
        ("drip, shipped bounds", drip, shipped),
        ("drip, max_time_s 5", drip, PullLimits(max_time_s=5.0, min_rate_kib=0)),
        ("drip, min_rate 16 KiB/s over 3 s", drip, PullLimits(max_time_s=0, rate_window_s=3.0)),
        ("no Content-Length, 128 MiB past the file, max_bytes 16 MiB", {"chunked": True, "extra": 128 << 20},
         PullLimits(max_bytes=16 << 20)),
        ("no Content-Length, 128 MiB past the file, size listed by the hub", {"chunked": True, "extra": 128 << 20,
                                                                              "linked": True}, shipped),
    ], desc="edge pull", unit="case"):  # fmt: skip
        row = _pull_case(knobs, limits, timeout_s)
        if "drip" in name:
            # checked as each byte arrives: the nearer bound (a drip never meets the rate), plus one wait for the server
            bound = min(b for b in (limits.max_time_s, limits.rate_window_s if limits.min_rate_kib else 0) if b)
            row["bound_s"] = bound + timeout_s
        else:
            row["bound_bytes"] = row["file_bytes"] if knobs.get("linked") else limits.max_bytes
        cases[name] = row
    return {"setup": "edge_engine.model_pull.pull against tests/support/hub_server.py on 127.0.0.1 (a 3 MiB file), "
                     f"retries 0, timeout_s {timeout_s:g} per read; shipped bounds {shipped.max_bytes >> 30} GiB, "
                     f"{shipped.max_time_s:g} s, {shipped.min_rate_kib:g} KiB/s over {shipped.rate_window_s:g} s",
            "previous_code": "no bound: a drip never ended, a body without Content-Length was written until the disk "
                             "filled (1.1-2.0 GB in 5 s and going)",
            "cases": cases}


PARTS = ("schemas", "outage", "outage_idle", "bodies", "route_bound_stall", "store_overshoot", "judging_shares",
         "edge_pull", "placement_flood")


def main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts to run; the result file keeps "
                        "the others' last figures")
    wanted = [p.strip() for p in parser.parse_args().parts.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; parts are {', '.join(PARTS)}")
    previous = RESULTS / "hostile_inputs.json"
    kept = json.loads(previous.read_text()) if previous.exists() else {}
    with tempfile.TemporaryDirectory(prefix="tierlane-hostile-") as tmp:
        work = Path(tmp)
        runs = {"schemas": lambda: schemas(work), "outage": lambda: asyncio.run(outage(work)),
                "outage_idle": lambda: asyncio.run(outage_idle(work)), "bodies": lambda: bodies(work),
                "route_bound_stall": lambda: asyncio.run(route_bound_stall(work)),
                "store_overshoot": lambda: asyncio.run(store_overshoot(work)),
                "judging_shares": lambda: asyncio.run(judging_shares(work)), "edge_pull": lambda: edge_pull(work),
                "placement_flood": lambda: placement_flood(work)}
        result = {part: runs[part]() if part in wanted else kept.get(part, {}) for part in PARTS}
    path = write("hostile_inputs", {**result, "verdicts": verdicts("hostile_inputs", result)})
    print(path.read_text())


if __name__ == "__main__":
    main()
