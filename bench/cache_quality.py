"""Precision and recall of "would serve from cache" per data source, on held-out splits, at the shipped policy.

Every pair goes through policies.cache.matcher.decide with both vectors, exactly as a lookup
does (cosine threshold, rule vetoes, learned verifier at `cache.verify.min_probability`).

Data (../shared/data/cache or $TIERLANE_SHARED_DATA/cache) and splits: policies/cache/verifier_data.py.
- qqp: Quora question pairs, label as given.
- stsb: STS-B dev, same request = score >= 4.0; everything below (the 2.5-4.0 middle too) counts
  as a different request.
- gptcache: the paraphrase pairs; negatives built per split (random other item, nearest other
  item by cosine skipping near-duplicate questions, meaning-changing edits).
Each source is split by connected text components into train / selection / test. The verifier
was fitted on train; its calibration and the policy's min_probability were chosen on selection;
**test is the figure to quote** and was never used to choose anything.

Baselines on the same pairs: raw cosine >= 0.90, and the previous rule-only policy (cosine 0.82
+ the rule vetoes, no learned verifier).

Writes bench/results/cache_quality.json. Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/cache_quality.py
(texts are embedded once and kept in /tmp/tierlane_verifier/emb.npz; --embeddings to move it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._verdicts import verdicts  # noqa: E402
from policies.cache.config import CacheConfig  # noqa: E402
from policies.cache.matcher import decide  # noqa: E402
from policies.cache.verifier import PairText, load_verifier  # noqa: E402
from policies.cache.verifier_data import SPLITS, STSB_POSITIVE_MIN, EmbeddingCache, load_all, shared_data  # noqa: E402
from policies.cache.verifier_train import figures  # noqa: E402
from policies.policy import Policy  # noqa: E402

SOURCES = ("qqp", "stsb", "gptcache")
TARGET_PRECISION = 0.97
DEFAULT_EMBEDDINGS = Path("/tmp/tierlane_verifier/emb.npz")


def by_split(hit: np.ndarray, y: np.ndarray, source: np.ndarray, split: np.ndarray) -> dict[str, dict[str, Any]]:
    return {s: {src: figures(hit[(split == s) & (source == src)], y[(split == s) & (source == src)]) for src in SOURCES}
            for s in SPLITS}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embeddings", type=Path, default=DEFAULT_EMBEDDINGS)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cache_quality.json")
    args = parser.parse_args()
    if not (shared_data() / "cache").is_dir():
        print(f"../shared/data absent: {shared_data() / 'cache'} not found (set TIERLANE_SHARED_DATA)", file=sys.stderr)
        return 2
    config = CacheConfig.from_section(Policy.load().resolve("cache"))
    checks = config.verify
    embed = EmbeddingCache(args.embeddings)
    pairs = load_all(embed)
    u, v = embed([p.a for p in pairs]), embed([p.b for p in pairs])
    y = np.asarray([p.label for p in pairs])
    source = np.asarray([p.source for p in pairs])
    split = np.asarray([p.split for p in pairs])
    kind = np.asarray([p.kind for p in pairs])
    cosine = np.einsum("ij,ij->i", u, v)

    started = time.perf_counter()
    texts: dict[str, PairText] = {}
    hit, rules_only, probability = [], [], []
    no_model = dataclasses.replace(checks, verifier=None)
    for i, p in enumerate(tqdm(pairs, desc="decide", unit="pair", mininterval=2.0)):
        query = texts.get(p.a) or texts.setdefault(p.a, PairText(p.a, checks))
        d = decide(float(cosine[i]), query, p.b, threshold=config.threshold, checks=checks, query_vector=u[i], candidate_vector=v[i])
        hit.append(d.hit)
        probability.append(np.nan if d.probability is None else d.probability)
        rules_only.append(decide(float(cosine[i]), query, p.b, threshold=config.threshold, checks=no_model).hit)
    seconds = time.perf_counter() - started
    served = np.asarray(hit)
    policy = by_split(served, y, source, split)

    # The verifier's probability for every pair (not only those past the threshold and vetoes), for the curve.
    model = load_verifier(checks.verifier) if checks.verifier else None
    curve = []
    if model is not None:
        gate = np.asarray([d is not None and not np.isnan(d) for d in probability])
        prob = np.where(gate, np.asarray(probability, dtype=np.float64), 0.0)
        for t in [0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99]:
            curve.append({"min_probability": t, **{s: {src: figures((prob >= t)[(split == s) & (source == src)],
                          y[(split == s) & (source == src)]) for src in SOURCES} for s in ("selection", "test")}})  # fmt: skip

    test = policy["test"]
    meets = all(test[src]["precision"] is not None and test[src]["precision"] >= TARGET_PRECISION for src in SOURCES)
    false_hits_by_kind = {
        s: {k: int((served & (y == 0) & (kind == k) & (split == s)).sum()) for k in sorted(set(kind[y == 0].tolist()))}
        for s in SPLITS
    }
    result = {
        "benchmark": "cache_quality",
        "model": "all-MiniLM-L6-v2 + learned verifier (policies/cache/artifacts/verifier.npz)",
        "policy": {"threshold": config.threshold, "verifier": checks.verifier, "min_probability": checks.min_probability,
                   "vetoes": {k: getattr(checks, k) for k in ("numbers", "entities", "negation", "direction", "opposites")}},  # fmt: skip
        "labels": {
            "qqp": "Quora is_duplicate as given",
            "stsb": f"score >= {STSB_POSITIVE_MIN} same request; every pair below it a different one",
            "gptcache": "pairs are paraphrases; negatives per split: random other item, nearest other item, meaning-changing edits",
        },
        "splits": "connected text components per source, seeded hash; qqp 70/15/15, stsb and gptcache 40/30/30 "
                  "(train / selection / test). Fitted on train; calibration and min_probability chosen on selection; "
                  "test never used to choose anything.",  # fmt: skip
        "quote": "test",
        "target": {"precision_on_every_source": TARGET_PRECISION},
        "meets_target_on_test": meets,
        "at_policy_default": policy,
        "baselines": {
            "cosine_0.90": by_split(cosine >= 0.90, y, source, split),
            "rules_only_cosine_0.82": by_split(np.asarray(rules_only), y, source, split),
        },
        "false_hits_by_kind": false_hits_by_kind,
        "pairs": {f"{s}/{src}": int(((split == s) & (source == src)).sum()) for s in SPLITS for src in SOURCES},
        "pairs_by_kind": dict(sorted(Counter(kind.tolist()).items())),
        "verifier_curve": curve,
        "decide_us_per_pair": round(seconds / len(pairs) * 1e6, 1),
        "verifier_meta": {k: v for k, v in (model.meta if model else {}).items() if k in ("hidden", "alpha", "trained_on", "calibrated_on", "selection")},
    }
    result["verdicts"] = verdicts("cache_quality", result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for s in ("selection", "test"):
        print(s, "  ".join(f"{src}: precision {policy[s][src]['precision']} recall {policy[s][src]['recall']}" for src in SOURCES))
    print(f"meets precision >= {TARGET_PRECISION} on every source's test split: {meets}; wrote {args.out}")
    return 0 if meets else 1


if __name__ == "__main__":
    sys.exit(main())
