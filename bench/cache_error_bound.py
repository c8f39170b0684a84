"""Replay: does `cache.max_error_rate` hold the served error of semantic hits under its bound, and at what hit rate?

Workload: the **test split** of ../shared/data/cache (policies/cache/verifier_data.py): QQP test
pairs (labelled duplicates and labelled *non*-duplicates) and the GPTCache paraphrase pairs with
their built negatives (nearest other item, random item, meaning-changing edits). Every pair's
first text is asked first (a miss: its answer is stored), then the second texts come in a seeded
random order; a query the cache misses is stored too (the upstream answered it), so later queries
may hit it. Some of those queries are paraphrases of a stored question, some are not the same
question at all.

Judgement (the upstream's, simulated by the labels): a served semantic hit is right when the
query and the stored question are in one component of the label-1 ("same question") edges of
their source, wrong when a label-0 pair joins their two components, and unjudged when no label
says (counted apart, left out of the error and of what the estimator is fed: GPTCache asks some
questions twice as separate items, so "no label" is not "different"). Exact repeats are not
judged (never wrong). The shadow stage's
re-ask is simulated by feeding every judged semantic hit (`--sample-rate`, default 1.0) back to
the cache's estimator at once, through `SemanticCache.observe`, as the shadow hook does; so is a
miss's best candidate that the bound alone refused (the shadow stage compares it with the
upstream's answer to the miss, at no extra call; here the labels judge it).

Runs through the real `SemanticCache` (embedded backend, real faiss index, `matcher.decide_many`
with the shipped verifier and vetoes), texts embedded once with the gateway's encoder (cached in
/tmp/tierlane_verifier/emb.npz like bench/cache_quality.py):
- `bound`: the shipped policy with `max_error_rate` (default 0.02);
- `static_*`: the same replay with no bound and one fixed threshold each (the verifier's min
  probability, or the cosine gate when the verifier is off), from the shipped value down.
The figure: the bound's measured served error (Wilson 95 % interval) <= max_error_rate, and its
hit rate beside the best static threshold's whose measured error is no higher.

Writes bench/results/cache_error_bound.json. Run (about 3 minutes on 2 cores with the embeddings cached):
    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python bench/cache_error_bound.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._harness import write  # noqa: E402
from bench._verdicts import verdicts, wilson  # noqa: E402
from policies.cache.config import CacheConfig  # noqa: E402
from policies.cache.error_bound import wilson_upper  # noqa: E402
from policies.cache.scope import build_key  # noqa: E402
from policies.cache.service import CacheHit, SemanticCache  # noqa: E402
from policies.cache.verifier_data import EmbeddingCache, Pair, load_gptcache, load_qqp  # noqa: E402
from policies.policy import Policy  # noqa: E402

DEFAULT_EMBEDDINGS = Path("/tmp/tierlane_verifier/emb.npz")
SEED = 20261201
SCOPE = "bench/replay"


class Components:
    """Union-find over (source, text): the label-1 edges make one component per question."""

    def __init__(self) -> None:
        self.parent: dict[tuple[str, str], tuple[str, str]] = {}
        self.different: set[frozenset[tuple[str, str]]] = set()  # label-0 edges between components

    def judge(self, x: tuple[str, str], y: tuple[str, str]) -> bool | None:
        """True: the same question; False: labelled different; None: no label says (not judged)."""
        rx, ry = self.find(x), self.find(y)
        if rx == ry:
            return True
        return False if frozenset((rx, ry)) in self.different else None

    def find(self, x: tuple[str, str]) -> tuple[str, str]:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, x: tuple[str, str], y: tuple[str, str]) -> None:
        rx, ry = self.find(x), self.find(y)
        if rx != ry:
            self.parent[max(rx, ry)] = min(rx, ry)


def workload(pairs: list[Pair], limit: int | None) -> tuple[list[tuple[str, str]], list[tuple[str, str]], Components]:
    """(seed texts, queries, components): each a (source, text); queries in a seeded order."""
    rng = random.Random(SEED)
    pairs = sorted(pairs, key=lambda p: (p.source, p.a, p.b))
    rng.shuffle(pairs)
    if limit:
        pairs = pairs[:limit]
    same = Components()
    for p in pairs:
        same.find((p.source, p.a))
        same.find((p.source, p.b))
        if p.label:
            same.union((p.source, p.a), (p.source, p.b))
    for p in pairs:
        if not p.label:
            same.different.add(frozenset((same.find((p.source, p.a)), same.find((p.source, p.b)))))
    seeds = list(dict.fromkeys((p.source, p.a) for p in pairs))
    queries = [(p.source, p.b) for p in pairs]
    return seeds, queries, same


def body(text: str) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": text}]}


def answer(text: str) -> dict[str, Any]:
    return {"object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}  # fmt: skip


async def replay(
    name: str, policy: Policy, seeds: list[tuple[str, str]], queries: list[tuple[str, str]], same: Components,
    vectors: dict[str, np.ndarray], sample_rate: float, debug: bool = False, vector_space: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    config = CacheConfig.from_section(policy.resolve("cache"))
    rng = random.Random(SEED + 1)
    with tempfile.TemporaryDirectory(prefix="tierlane-bound-") as tmp:
        cache = SemanticCache(Path(tmp), policy, vector_space=vector_space)
        await cache.start()
        asked: dict[str, tuple[str, str]] = {}  # stored answer (its question's text) -> (source, text)
        try:

            async def store(source: str, text: str) -> None:
                key, _ = build_key(body(text), tenant="bench", model="auto", route=None, rules=config.rules)
                assert key is not None
                await cache.store(key, vectors[text], answer(text), None, config)
                asked[text] = (source, text)

            for source, text in seeds:
                await store(source, text)
            served = wrong = exact = unjudged = judged_refused = 0
            lookups = 0
            trace: list[tuple[int, int]] = []  # (served, wrong) after each query: the error over time
            for source, text in tqdm(queries, desc=name, unit="query", leave=False):
                key, _ = build_key(body(text), tenant="bench", model="auto", route=None, rules=config.rules)
                assert key is not None
                lookups += 1
                refused: list[CacheHit] = []
                hit = await cache.lookup(key, vectors[text], config, bound_scope=SCOPE, refused=refused)
                if config.bound is not None:
                    cache.bounds.count_lookup(SCOPE, config.bound, hit=hit is not None, exact=hit is not None and hit.exact)
                if hit is None:
                    # the upstream answers the miss; the candidate the bound alone refused is judged
                    # against that answer (here: the labels), as the shadow stage does, no extra call
                    if refused and config.bound is not None and refused[0].score is not None and rng.random() < sample_rate:
                        candidate = refused[0].response["choices"][0]["message"]["content"]
                        verdict = same.judge((source, text), asked[candidate])
                        if verdict is not None:
                            judged_refused += 1
                            await cache.observe(SCOPE, config.bound, refused[0].entry_id, refused[0].score, wrong=not verdict)
                    await store(source, text)
                elif hit.exact:
                    exact += 1
                else:
                    stored = hit.response["choices"][0]["message"]["content"]
                    verdict = same.judge((source, text), asked[stored])
                    if verdict is None:
                        unjudged += 1
                        if debug:
                            print(f"UNJUDGED {hit.score:.3f} {text!r} <- {stored!r}")
                        continue
                    bad = not verdict
                    served += 1
                    wrong += bad
                    if config.bound is not None and hit.score is not None and rng.random() < sample_rate:
                        await cache.observe(SCOPE, config.bound, hit.entry_id, hit.score, wrong=bad)
                trace.append((served, wrong))
            stats = cache.bounds.stats()
        finally:
            await cache.close()
    out: dict[str, Any] = {
        "lookups": lookups, "semantic_hits": served, "wrong": wrong, "exact_hits": exact,
        "unjudged_semantic_hits": unjudged, "judged_refused_candidates": judged_refused,
        "served_error": round(wrong / served, 4) if served else None, "served_error_interval_95": wilson(wrong, served),
        # the test the bound applies: one-sided Wilson upper bound at its confidence
        "served_error_upper_one_sided": round(wilson_upper(wrong, served, config.bound.confidence if config.bound else 0.95), 4),
        "semantic_hit_rate": round(served / lookups, 4), "hit_rate": round((served + exact) / lookups, 4),
        # the served error over the second half of the replay (after the bound had observations)
        "served_error_second_half": _second_half(trace),
    }  # fmt: skip
    if stats:
        st = stats[0]
        out["bound_state"] = {"threshold": round(st.threshold, 4), "estimated_error": None if st.error is None else round(st.error, 4),
                              "upper_bound": round(st.upper, 4), "counted": st.counted, "observed": st.observed,
                              "tightened": st.tightened, "loosened": st.loosened,
                              "entries_with_threshold": st.entries_with_threshold}  # fmt: skip
    return out


def _second_half(trace: list[tuple[int, int]]) -> float | None:
    if not trace:
        return None
    mid = trace[len(trace) // 2]
    served, wrong = trace[-1][0] - mid[0], trace[-1][1] - mid[1]
    return round(wrong / served, 4) if served else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-error-rate", type=float, default=0.02)
    parser.add_argument("--sample-rate", type=float, default=1.0, help="share of semantic hits judged (the shadow's re-asks)")
    parser.add_argument("--pairs", type=int, default=0, help="use only this many test pairs (0: all)")
    parser.add_argument("--embeddings", type=Path, default=DEFAULT_EMBEDDINGS)
    parser.add_argument("--statics", default="", help="comma-separated static thresholds (default: a grid from the shipped value down)")
    args = parser.parse_args()

    started = time.monotonic()
    embed = EmbeddingCache(args.embeddings)
    pairs = [p for p in load_qqp() + load_gptcache(embed) if p.split == "test"]
    seeds, queries, same = workload(pairs, args.pairs or None)
    texts = list(dict.fromkeys([t for _, t in seeds] + [t for _, t in queries]))
    vectors = dict(zip(texts, embed(texts)))
    base = Policy.load()
    shipped = CacheConfig.from_section(base.resolve("cache"))
    kind = "probability" if shipped.verify.verifier is not None else "cosine"
    start = shipped.verify.min_probability if kind == "probability" else shipped.threshold
    if args.statics:
        grid = [float(x) for x in args.statics.split(",")]
    elif kind == "probability":
        grid = sorted({min(0.99, start + 0.02), min(0.99, start + 0.01), start, 0.9}, reverse=True)
    else:
        grid = [start, start - 0.02, start - 0.04, start - 0.06]
    print(f"{len(pairs)} test pairs ({sum(p.label for p in pairs)} same question); {len(seeds)} stored first, "
          f"{len(queries)} queries; verifier {shipped.verify.verifier or 'off'} ({kind} threshold {start})")  # fmt: skip

    runs: dict[str, Any] = {}
    policy = Policy.load(extra={"cache": {"max_error_rate": args.max_error_rate}})
    runs["bound"] = asyncio.run(replay("bound", policy, seeds, queries, same, vectors, args.sample_rate))
    for t in tqdm(grid, desc="static thresholds"):
        section = {"verify": {"min_probability": t}} if kind == "probability" else {"threshold": t}
        runs[f"static_{t:g}"] = asyncio.run(replay(f"static {t:g}", Policy.load(extra={"cache": section}), seeds, queries, same, vectors, 0.0))
        runs[f"static_{t:g}"]["threshold"] = t

    bound = runs["bound"]
    fair = [(name, r) for name, r in runs.items() if name.startswith("static_") and r["served_error"] is not None
            and r["served_error"] <= (bound["served_error"] or 0.0)]  # fmt: skip
    best = max(fair, key=lambda nr: nr[1]["semantic_hit_rate"], default=None)
    within = [(name, r) for name, r in runs.items() if name.startswith("static_") and r["served_error"] is not None
              and r["served_error"] <= args.max_error_rate]  # fmt: skip
    best_within = max(within, key=lambda nr: nr[1]["semantic_hit_rate"], default=None)
    data = {
        "workload": {"pairs": len(pairs), "same_question_pairs": sum(p.label for p in pairs), "stored_first": len(seeds),
                     "queries": len(queries), "sources": sorted({p.source for p in pairs}), "split": "test",
                     "judgement": "label-1 components of each source: the upstream's agreement simulated by the labels"},
        "policy": {"verifier": shipped.verify.verifier, "kind": kind, "shipped_threshold": start,
                   "max_error_rate": args.max_error_rate, "confidence": policy.resolve("cache").get("error_confidence", 0.95),
                   "sample_rate": args.sample_rate},
        "runs": runs,
        "static_at_same_error": None if best is None else {"run": best[0], **{k: best[1][k] for k in
                                ("threshold", "served_error", "semantic_hit_rate", "hit_rate")}},
        # the best static threshold in hindsight whose measured error is within the bound (not only as low as the bound's)
        "static_within_bound": None if best_within is None else {"run": best_within[0], **{k: best_within[1][k] for k in
                               ("threshold", "served_error", "semantic_hit_rate", "hit_rate")}},
        "seconds": round(time.monotonic() - started, 1),
    }  # fmt: skip
    data["verdicts"] = verdicts("cache_error_bound", data)
    path = write("cache_error_bound", data)
    b = runs["bound"]
    print(f"bound {args.max_error_rate}: served error {b['served_error']} {b['served_error_interval_95']} over "
          f"{b['semantic_hits']} semantic hits; semantic hit rate {b['semantic_hit_rate']}; state {b.get('bound_state')}")
    for name, r in runs.items():
        if name != "bound":
            print(f"{name}: served error {r['served_error']} over {r['semantic_hits']}; semantic hit rate {r['semantic_hit_rate']}")
    print(f"static at the same error: {data['static_at_same_error']}; within the bound: {data['static_within_bound']}\nwrote {path} in {data['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
