"""Cache memory and per-entry cost: resident memory per entry, and put/lookup time at 1k vs 100k entries.

`rss`: a fresh process fills the vector index alone (`--what index`), the embedded cache (SQLite
and index, `--what cache`) or the shared cache's replica-side index and entry map (`--what shared`,
no store: its worker-thread methods are called directly) with `--entries` random unit vectors over
`--scopes` scopes shaped like a soak's (all but 100 scopes hold one entry; those 100 share the
rest), and reports the growth of its resident memory per entry beside what the cache counts
(`nbytes`, what `cache.max_memory_bytes` bounds).
`ops`: the embedded cache's worker-side put (with `max_entries` at the fill, so every put also
evicts) and lookups (exact probe on the worker, semantic search in a one-entry scope and in a
big scope, a semantic hit with `verify.verifier: off`), each timed directly on one thread (no
event loop, no embedder), at each of `--sizes`.
Run: .venv/bin/python bench/cache_memory.py [rss|ops|all] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from policies.cache.config import CacheConfig  # noqa: E402
from policies.cache.scope import CacheKey  # noqa: E402
from policies.cache.service import SemanticCache  # noqa: E402
from policies.embedding.embedder import DIMENSION  # noqa: E402
from policies.policy import Policy  # noqa: E402

BIG_SCOPES = 100
RESPONSE = {"id": "chatcmpl-x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "an answer " * 40}, "finish_reason": "stop"}]}  # fmt: skip
USAGE = {"prompt_tokens": 40, "completion_tokens": 90, "total_tokens": 130}


def full_collection_ms() -> float:
    """A full collection's time once nothing is left to free (the best of 5: the walk itself)."""
    times = []
    for _ in range(5):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1000.0)
    return round(min(times), 2)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def scope_of(i: int, entries: int, scopes: int) -> str:
    """Entries 0 .. scopes-BIG_SCOPES-1 each alone in a scope; the rest spread over BIG_SCOPES scopes."""
    alone = scopes - BIG_SCOPES
    return f"{i:064x}" if i < alone else f"{(i % BIG_SCOPES) + 10**12:064x}"


def vectors(n: int, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIMENSION)).astype(np.float32)
    unit: np.ndarray = v / np.linalg.norm(v, axis=1, keepdims=True)
    return unit


def key(i: int, scope: str, text: str = "what should a beginner know about this") -> CacheKey:
    return CacheKey(exact=f"{i:064x}", scope=scope, tenant=f"tenant-{int(scope, 16) % 50}", model="m", text=text)


class _NoStore:
    """Stands in for the shared cache's store client: only the replica-side state is measured."""

    def script(self, _source: str) -> None:
        return None


def policy(**cache: Any) -> Policy:
    return Policy.load(extra={"cache": cache})


def measure_rss(what: str, entries: int, scopes: int) -> dict[str, Any]:
    vs = vectors(entries)
    names = [scope_of(i, entries, scopes) for i in range(entries)]
    gc.collect()
    counted = 0
    if what == "index":
        from policies.cache.faiss_index import FaissIndex

        index = FaissIndex(DIMENSION)
        before = rss_bytes()
        for i in range(entries):
            index.add(i + 1, names[i], vs[i])
        counted = getattr(index, "nbytes", 0)
    elif what == "shared":
        from policies.cache import shared

        cache = shared.SharedCache(policy(max_entries=10**7), _NoStore(), None)  # type: ignore[arg-type]
        make = getattr(shared, "_meta", shared._Meta)
        before = rss_bytes()
        for i in range(entries):
            k = key(i, names[i])
            cache._add(i + 1, make("t" + k.tenant, k.exact, k.scope, k.tenant, time.time() + 3600), vs[i])
        counted = cache._local_stats().get("memory_bytes", 0)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            return asyncio.run(_cache_rss(Path(tmp), vs, names))
    gc.collect()
    grown = rss_bytes() - before
    return {"what": what, "entries": entries, "scopes": len(set(names)), "rss_per_entry_bytes": round(grown / entries),
            "counted_per_entry_bytes": round(counted / entries), "gc_tracked_objects": len(gc.get_objects()),
            "gc_full_collection_ms": full_collection_ms()}


async def _cache_rss(directory: Path, vs: np.ndarray, names: list[str]) -> dict[str, Any]:
    cache = SemanticCache(directory, policy(max_entries=10**7, verify={"verifier": "off"}))
    await cache.start()
    config = cache.base
    gc.collect()
    before = rss_bytes()
    for i in range(len(vs)):
        cache._put(key(i, names[i]), vs[i], RESPONSE, USAGE, config)
    gc.collect()
    grown = rss_bytes() - before
    stats = await cache.stats()
    await cache.close()
    return {"what": "cache", "entries": len(vs), "scopes": len(set(names)), "rss_per_entry_bytes": round(grown / len(vs)),
            "counted_per_entry_bytes": round(stats.get("memory_bytes", 0) / len(vs)),
            "file_bytes_per_entry": round(stats["bytes"] / len(vs)), "gc_tracked_objects": len(gc.get_objects()),
            "gc_full_collection_ms": full_collection_ms()}


def _timed(fn: Any, n: int) -> dict[str, float]:
    times = []
    for i in range(n):
        started = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - started) * 1e6)
    return {"p50_us": round(statistics.median(times), 1), "p99_us": round(float(np.percentile(times, 99)), 1),
            "mean_us": round(statistics.mean(times), 1)}  # fmt: skip


async def _ops_at(directory: Path, entries: int, samples: int) -> dict[str, Any]:
    scopes = max(BIG_SCOPES + 1, entries // 3)
    cache = SemanticCache(directory, policy(max_entries=entries, verify={"verifier": "off"}))
    await cache.start()
    config: CacheConfig = cache.base
    vs = vectors(entries + samples, seed=1)
    names = [scope_of(i, entries, scopes) for i in range(entries)]
    for i in range(entries):
        cache._put(key(i, names[i]), vs[i], RESPONSE, USAGE, config)
    rng = np.random.default_rng(2)
    probes = vectors(samples, seed=3)
    alone, big = scopes - BIG_SCOPES, entries - (scopes - BIG_SCOPES)
    # Lookups first (the entries are all there), then puts past max_entries (each evicts one).
    out: dict[str, Any] = {"entries": entries, "scopes": scopes}
    picks = rng.integers(0, alone, samples)
    out["lookup_exact_hit"] = _timed(lambda i: cache._lookup(key(int(picks[i]), names[int(picks[i])]), None, config, None,
                                                                 True, "t"), samples)  # fmt: skip
    out["lookup_miss_one_entry_scope"] = _timed(
        lambda i: cache._lookup(key(10**9 + i, names[int(picks[i])]), probes[i], config, None, True, "t"), samples)
    bigs = alone + rng.integers(0, big, samples)
    out["lookup_miss_big_scope"] = _timed(
        lambda i: cache._lookup(key(10**9 + i, names[int(bigs[i])]), probes[i], config, None, True, "t"), samples)
    out["lookup_semantic_hit"] = _timed(
        lambda i: cache._lookup(key(10**9 + i, names[int(picks[i])]), vs[int(picks[i])], config, None, True, "t"), samples)
    out["put_evicting"] = _timed(lambda i: cache._put(key(entries + i, names[i % entries]), vs[entries + i], RESPONSE,
                                                      USAGE, config), samples)  # fmt: skip
    await cache.close()
    return out


def measure_ops(sizes: list[int], samples: int) -> list[dict[str, Any]]:
    results = []
    for entries in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            results.append(asyncio.run(_ops_at(Path(tmp), entries, samples)))
        print(json.dumps(results[-1]), file=sys.stderr)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["rss", "ops", "all", "one"], nargs="?", default="all")
    parser.add_argument("--what", choices=["index", "cache", "shared"], default="index")
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--scopes", type=int, default=33_592)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.mode == "one":  # one RSS measurement in this (fresh) process
        print(json.dumps(measure_rss(args.what, args.entries, args.scopes)))
        return 0
    results: dict[str, Any] = {"benchmark": "cache_memory"}
    if args.mode in ("rss", "all"):
        results["rss"] = []
        for what in ("index", "shared", "cache"):
            run = subprocess.run([sys.executable, __file__, "one", "--what", what, "--entries", str(args.entries),
                                  "--scopes", str(args.scopes)], capture_output=True, text=True, check=True)  # fmt: skip
            results["rss"].append(json.loads(run.stdout.splitlines()[-1]))
            print(run.stdout.strip(), file=sys.stderr)
    if args.mode in ("ops", "all"):
        results["ops"] = measure_ops(args.sizes, args.samples)
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
