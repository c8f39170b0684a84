"""Cache lookup latency: miss path (embed + search + verify) at concurrency 1 and 32, hits, and verification.

The lookup is measured through the real Embedder and SemanticCache (SQLite + faiss); the
end-to-end hits go through a real gateway process (cache on, router and edge off) in front
of the fixed-answer upstream, measured by a client over loopback.
Verification (`verify_per_lookup`): paraphrased queries whose candidates all pass the cosine
threshold, so every candidate (up to `cache.candidates`) is verified; the time of the
service's verification loop (query features once, then rule checks and the learned verifier
per candidate) with the shipped verifier and with `verify.verifier: off` (rules only); the
difference is what the learned verifier adds to a lookup. The same through `cache.lookup`.
Writes bench/results/cache_latency.json. Run: .venv/bin/python bench/cache_latency.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._harness import free_port, gateway_cmd, start, stop, summary_ms  # noqa: E402
from bench._verdicts import verdicts  # noqa: E402
from policies.cache.config import CacheConfig  # noqa: E402
from policies.cache.matcher import decide  # noqa: E402
from policies.cache.scope import build_key, normalise  # noqa: E402
from policies.cache.service import SemanticCache  # noqa: E402
from policies.cache.verifier import PairText  # noqa: E402
from policies.embedder import Embedder  # noqa: E402
from policies.policy import Policy  # noqa: E402

TOPICS = ["python", "tax law", "gardening", "jazz", "rust", "cooking", "astronomy", "chess", "sql", "cycling"]


def question(i: int) -> str:
    return f"Question {i}: what should a beginner know about {TOPICS[i % len(TOPICS)]} in week {i // 10}?"


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 3)


async def run(entries: int, requests: int) -> dict[str, object]:
    policy = Policy.load()
    with tempfile.TemporaryDirectory() as tmp:
        embedder = Embedder()
        await embedder.start()
        cache = SemanticCache(Path(tmp), policy)
        await cache.start()
        config = cache.config_for(tenant="bench", app="bench", model="auto", route=None)

        def key(text: str):
            k, _ = build_key({"messages": [{"role": "user", "content": text}]}, tenant="bench", model="auto",
                             route=None, rules=config.rules)
            return k

        for i in tqdm(range(entries), desc="fill"):
            text = question(i)
            await cache.store(key(text), await embedder.embed(normalise(text)), {"choices": [
                {"index": 0, "message": {"role": "assistant", "content": "answer"}, "finish_reason": "stop"}]},
                {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}, config)

        async def one(text: str) -> tuple[float, bool]:
            started = time.perf_counter()
            vector = await embedder.embed(normalise(text))
            hit = await cache.lookup(key(text), vector, config)
            return (time.perf_counter() - started) * 1000.0, hit is not None

        results: dict[str, object] = {"entries": entries}
        misses = [f"How do I repair a {TOPICS[i % 10]} problem number {i} quickly?" for i in range(requests)]
        for concurrency in (1, 32):
            latencies: list[float] = []
            hits = 0
            bar = tqdm(total=requests, desc=f"miss c={concurrency}")
            for start in range(0, requests, concurrency):
                batch = misses[start : start + concurrency]
                for ms, hit in await asyncio.gather(*(one(t) for t in batch)):
                    latencies.append(ms)
                    hits += hit
                bar.update(len(batch))
            bar.close()
            results[f"miss_c{concurrency}"] = {"n": len(latencies), "p50_ms": pct(latencies, 50),
                                               "p99_ms": pct(latencies, 99), "mean_ms": round(statistics.mean(latencies), 3),
                                               "unexpected_hits": hits}
        # The part after the embedding: scope key, faiss search, SQLite fetch and verification.
        vectors = [await embedder.embed(normalise(t)) for t in misses]
        latencies = []
        for text, vector in tqdm(list(zip(misses, vectors)), desc="search+verify"):
            started = time.perf_counter()
            await cache.lookup(key(text), vector, config)
            latencies.append((time.perf_counter() - started) * 1000.0)
        results["miss_search_verify_only_c1"] = {"n": len(latencies), "p50_ms": pct(latencies, 50), "p99_ms": pct(latencies, 99)}
        latencies = []
        for i in tqdm(range(requests), desc="exact hit"):
            ms, hit = await one(question(i % entries))
            assert hit
            latencies.append(ms)
        results["hit_embed_and_lookup_c1"] = {"n": len(latencies), "p50_ms": pct(latencies, 50), "p99_ms": pct(latencies, 99)}
        results.update(await verification(cache, embedder, config, key, requests))
        results["embed_backend"] = embedder.backend_name
        results["embed_batches"] = embedder.batches
        results["embed_texts"] = embedder.texts
        await cache.close()
        await embedder.close()
    return results


async def verification(cache: SemanticCache, embedder: Embedder, config: CacheConfig, key: Any, requests: int) -> dict[str, object]:
    """Verification time per lookup, learned verifier on and off, on paraphrases that reach it."""
    rules_only = CacheConfig.from_section({**cache.policy.resolve("cache"), "verify": {"verifier": "off"}})
    texts = [paraphrase(i) for i in range(requests)]
    vectors = [await embedder.embed(normalise(t)) for t in texts]
    index, store = cache._index, cache._store  # the service's own; the loop below is its _lookup's
    assert index is not None and store is not None
    loop_ms: dict[str, list[float]] = {"learned": [], "rules_only": []}
    candidates, served = [], 0
    for text, vector in tqdm(list(zip(texts, vectors)), desc="verify per lookup"):
        k = key(text)
        neighbours = [n for n in index.search(k.scope, vector, config.candidates) if n.similarity >= config.threshold]
        entries = store.get_many(n.id for n in neighbours)
        candidates.append(len(neighbours))
        for name, cfg in (("learned", config), ("rules_only", rules_only)):
            started = time.perf_counter()
            query = PairText(k.text, cfg.verify)
            for n in neighbours:
                d = decide(n.similarity, query, entries[n.id].text, threshold=cfg.threshold, checks=cfg.verify,
                           query_vector=vector, candidate_vector=n.vector)
                if d.hit:
                    served += name == "learned"
                    break
            loop_ms[name].append((time.perf_counter() - started) * 1000.0)
    lookup_ms: dict[str, list[float]] = {"learned": [], "rules_only": []}
    for _ in range(2):  # interleaved, so load changes on the machine hit both alike
        for text, vector in tqdm(list(zip(texts, vectors)), desc="lookup on/off"):
            for name, cfg in (("learned", config), ("rules_only", rules_only)):
                started = time.perf_counter()
                await cache.lookup(key(text), vector, cfg, exact=False)
                lookup_ms[name].append((time.perf_counter() - started) * 1000.0)
    added = [a - b for a, b in zip(loop_ms["learned"], loop_ms["rules_only"])]
    return {
        "verify_per_lookup": {
            "n": len(texts), "candidates_mean": round(float(np.mean(candidates)), 2),
            "served_rate_learned": round(served / len(texts), 3),
            "learned_p50_ms": pct(loop_ms["learned"], 50), "learned_p99_ms": pct(loop_ms["learned"], 99),
            "rules_only_p50_ms": pct(loop_ms["rules_only"], 50), "rules_only_p99_ms": pct(loop_ms["rules_only"], 99),
            "added_by_learned_p50_ms": pct(added, 50), "added_by_learned_p99_ms": pct(added, 99),
        },
        "lookup_semantic_c1": {
            "learned_p50_ms": pct(lookup_ms["learned"], 50), "learned_p99_ms": pct(lookup_ms["learned"], 99),
            "rules_only_p50_ms": pct(lookup_ms["rules_only"], 50), "rules_only_p99_ms": pct(lookup_ms["rules_only"], 99),
        },
    }  # fmt: skip


def paraphrase(i: int) -> str:
    return f"Question {i}: what does a beginner need to know about {TOPICS[i % len(TOPICS)]} in week {i // 10}?"


async def end_to_end(requests: int) -> dict[str, object]:
    """Exact and paraphrased hits through a running gateway, measured by the client."""
    import aiohttp

    tmp = Path(tempfile.mkdtemp(prefix="tierlane-cache-bench-"))
    up_port, gw_port = free_port(), free_port()
    upstream = start([sys.executable, str(REPO / "bench" / "fast_upstream.py"), "--port", str(up_port)],
                     f"http://127.0.0.1:{up_port}/v1/models", tmp / "upstream.log")
    config = {
        "state_dir": str(tmp / "state"),
        "edge": {"enabled": False},
        "telemetry": {"tracing": False, "metrics": False},
        "policy": {"router": {"enabled": False}, "budgets": {"enabled": False}},
        "upstreams": [{"name": "fast", "base_url": f"http://127.0.0.1:{up_port}/v1", "models": ["fast-model"]}],
    }
    gateway = start(gateway_cmd(config, tmp / "gateway.yaml", gw_port), f"http://127.0.0.1:{gw_port}/healthz",
                    tmp / "gateway.log")
    url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
    out: dict[str, object] = {}
    try:
        async with aiohttp.ClientSession() as session:
            async def ask(text: str) -> tuple[float, str, float]:
                body = {"model": "fast-model", "messages": [{"role": "user", "content": text}]}
                started = time.perf_counter()
                async with session.post(url, json=body) as resp:
                    await resp.read()
                    return (time.perf_counter() - started, resp.headers.get("x-tierlane-cache", ""),
                            float(resp.headers.get("x-tierlane-overhead-ms", "nan")))

            for i in tqdm(range(requests), desc="e2e fill (misses)"):
                await ask(question(i))
            await asyncio.sleep(1.0)  # admission runs after each answer; let the last ones land
            for name, make in (("exact", question), ("paraphrase", paraphrase)):
                latencies, overheads, hits = [], [], 0
                for i in tqdm(range(requests), desc=f"e2e {name} hit"):
                    seconds, status, overhead = await ask(make(i))
                    if status == "hit":
                        hits += 1
                        latencies.append(seconds)
                        overheads.append(overhead / 1000)
                out[f"hit_e2e_{name}_c1"] = {**summary_ms(latencies), "hit_rate": round(hits / requests, 3),
                                            "gateway_self_reported": summary_ms(overheads)}
    finally:
        stop(gateway)
        stop(upstream)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cache_latency.json")
    args = parser.parse_args()
    results = asyncio.run(run(args.entries, args.requests))
    results.update(asyncio.run(end_to_end(min(args.requests, 200))))
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    results.update({"benchmark": "cache_latency",
                    "targets": {"miss_c1_p50_ms": 5.0, "hit_e2e_p50_ms": 10.0, "verify_added_by_learned_p50_ms": 0.5},
                    "load_average": load})
    results["verdicts"] = verdicts("cache_latency", results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
