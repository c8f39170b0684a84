"""Precision and recall of "would serve from cache" per data source, on held-out splits, at the shipped policy.

The shipped decision is policies.cache.matcher's: cosine gate (`cache.threshold`), the rule
vetoes, then the cross-encoder's probability >= `cache.verify.min_probability`. The cross-encoder
scores every selection and test pair past the gate in batches (the same `CrossEncoder` object a
lookup calls); a sample of pairs is also sent through `matcher.decide` itself and must agree.

Data (../shared/data/cache or $TIERLANE_SHARED_DATA/cache) and splits: policies/cache/verifier_data.py.
- qqp: Quora question pairs, label as given.
- stsb: STS-B dev, same request = score >= 4.0; everything below (the 2.5-4.0 middle too) counts
  as a different request.
- gptcache: the paraphrase pairs; negatives built per split (random other item, nearest other
  item by cosine skipping near-duplicate questions, meaning-changing edits).
Each source is split by connected text components into train / selection / test. The
cross-encoder was fine-tuned on train; its gate, vetoes and min_probability were chosen on
selection; **test is the figure to quote** and was never used to choose anything.

Baselines on the same pairs: raw cosine >= 0.90 and >= 0.95, the rule-only policy (cosine 0.82 +
the rule vetoes), and the previous learned verifier (MLP over embeddings and lexical features,
policies/cache/verifier.py, at its policy: cosine 0.82, vetoes, probability >= 0.96).

Writes bench/results/cache_quality.json. Run: HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python bench/cache_quality.py
(texts are embedded once and kept in /tmp/tierlane_verifier/emb.npz; --embeddings to move it).
"""

from __future__ import annotations

import argparse
import json
import random
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
from policies.cache.cross_encoder import BUNDLED_CROSS_ENCODER, load_cross_encoder  # noqa: E402
from policies.cache.cross_encoder_train import average_precision, figures  # noqa: E402
from policies.cache.matcher import decide, is_cross_encoder  # noqa: E402
from policies.cache.verifier import BUNDLED as PREVIOUS_VERIFIER  # noqa: E402
from policies.cache.verifier import PREVIOUS_MIN_PROBABILITY, PairText, load_verifier, pair_vector  # noqa: E402
from policies.cache.verifier_data import STSB_POSITIVE_MIN, EmbeddingCache, load_all, shared_data  # noqa: E402
from policies.cache.verify import VerifyConfig, features, mismatch  # noqa: E402
from policies.policy import Policy  # noqa: E402

SOURCES = ("qqp", "stsb", "gptcache")
REPORTED = ("selection", "test")
# What the shipped default must reach on each source's test split.
TARGETS = {"qqp": {"precision": 0.95, "recall": 0.20}, "gptcache": {"precision": 0.98, "recall": 0.60}, "stsb": {"precision": 0.95}}
DEFAULT_EMBEDDINGS = Path("/tmp/tierlane_verifier/emb.npz")
PREVIOUS_THRESHOLD = 0.82
CHECKED_THROUGH_DECIDE = 400


def by_split(hit: np.ndarray, y: np.ndarray, source: np.ndarray, split: np.ndarray) -> dict[str, dict[str, Any]]:
    return {s: {src: figures(hit[(split == s) & (source == src)], y[(split == s) & (source == src)]) for src in SOURCES}
            for s in REPORTED}  # fmt: skip


def source_verdicts(test: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for src, target in TARGETS.items():
        got = test[src]
        met = all(got[k] is not None and got[k] >= v for k, v in target.items())
        out[src] = {"target": target, "precision": got["precision"], "recall": got["recall"], "served": got["served"],
                    "positives": got["positives"], "pairs": got["pairs"], "met": met}  # fmt: skip
    return out


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
    if checks.verifier is None:
        print("the policy has no verifier (cache.verify.verifier: off)", file=sys.stderr)
        return 2
    embed = EmbeddingCache(args.embeddings)
    pairs = [p for p in load_all(embed) if p.split in REPORTED]
    u, v = embed([p.a for p in pairs]), embed([p.b for p in pairs])
    y = np.asarray([p.label for p in pairs])
    source = np.asarray([p.source for p in pairs])
    split = np.asarray([p.split for p in pairs])
    kind = np.asarray([p.kind for p in pairs])
    cosine = np.einsum("ij,ij->i", u, v)

    # Rule vetoes as the policy sets them, and with every check on (the previous verifier's policy).
    every_check = VerifyConfig.from_policy({})
    feats: dict[tuple[str, bool], Any] = {}

    def feat(text: str, full: bool) -> Any:
        key = (text, full)
        if key not in feats:
            feats[key] = features(text, every_check if full else checks)
        return feats[key]

    vetoed = np.asarray([mismatch(feat(p.a, False), feat(p.b, False), checks) is not None for p in pairs])
    vetoed_all = np.asarray([mismatch(feat(p.a, True), feat(p.b, True), every_check) is not None for p in pairs])

    # The previous verifier at its own policy.
    previous = load_verifier(str(PREVIOUS_VERIFIER))
    prev_rows = np.flatnonzero((cosine >= PREVIOUS_THRESHOLD) & ~vetoed_all)
    # Also every pair the cross-encoder scores: its blend reads this verifier's probability.
    gate_min = min(float(load_cross_encoder(str(BUNDLED_CROSS_ENCODER)).meta["selection"]["chosen"]["gate"]),
                   config.threshold if is_cross_encoder(checks.verifier or "") else 1.0)  # fmt: skip
    scored_rows = np.union1d(prev_rows, np.flatnonzero(cosine >= gate_min))
    texts: dict[str, PairText] = {}

    def pair_text(t: str) -> PairText:
        return texts.get(t) or texts.setdefault(t, PairText(t, every_check))

    prev_prob = np.zeros(len(pairs))
    if len(scored_rows):
        x = np.stack([pair_vector(u[i], v[i], pair_text(pairs[i].a), pair_text(pairs[i].b), every_check) for i in scored_rows])
        prev_prob[scored_rows] = previous.probabilities(x)
    # The cross-encoder on every pair past the loosest gate it was selected with (vetoed ones too, for the curve), batched.
    encoder = load_cross_encoder(str(BUNDLED_CROSS_ENCODER))
    chosen = encoder.meta["selection"]["chosen"]
    prob = np.zeros(len(pairs))
    order = sorted(np.flatnonzero(cosine >= gate_min).tolist(), key=lambda i: len(pairs[i].a) + len(pairs[i].b))
    started = time.perf_counter()
    for start in tqdm(range(0, len(order), 32), desc="cross-encoder", unit="batch", mininterval=5.0):
        rows = order[start : start + 32]
        prob[rows] = encoder.probabilities([(pairs[i].a, pairs[i].b) for i in rows], cosine[rows], prev_prob[rows])
    seconds = time.perf_counter() - started
    ce_gate = cosine >= float(chosen["gate"])
    ce_vetoed = vetoed_all if chosen["vetoes"] else np.zeros(len(pairs), bool)
    ce_served = ce_gate & ~ce_vetoed & (prob >= float(chosen["min_probability"]))

    previous_served = np.zeros(len(pairs), bool)
    previous_served[prev_rows] = prev_prob[prev_rows] >= PREVIOUS_MIN_PROBABILITY

    # The shipped policy: whichever verifier `cache.verify.verifier` names, at the policy's gate and threshold.
    past_gate = cosine >= config.threshold
    if is_cross_encoder(checks.verifier or ""):
        served = past_gate & ~vetoed & (prob >= checks.min_probability)
    else:
        shipped_prob = prev_prob if checks.verifier == str(PREVIOUS_VERIFIER) else None
        assert shipped_prob is not None, "the bench knows the two bundled verifiers"
        served = past_gate & ~vetoed & (shipped_prob >= checks.min_probability)

    # The same decision through matcher.decide, on a seeded sample: the bench measures what a lookup does.
    rng = random.Random(0)
    disagreements = 0
    for i in rng.sample(range(len(pairs)), min(CHECKED_THROUGH_DECIDE, len(pairs))):
        d = decide(float(cosine[i]), pairs[i].a, pairs[i].b, threshold=config.threshold, checks=checks,
                   query_vector=u[i], candidate_vector=v[i])  # fmt: skip
        disagreements += d.hit != bool(served[i])

    policy = by_split(served, y, source, split)
    cross_encoder = by_split(ce_served, y, source, split)
    curve = []
    for t in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995):
        hit = ce_gate & ~ce_vetoed & (prob >= t)
        curve.append({"min_probability": t, **by_split(hit, y, source, split)})
    ap = {s: {src: average_precision(np.where(ce_gate, prob, -1.0)[(split == s) & (source == src)],
                                     y[(split == s) & (source == src)]) for src in SOURCES} for s in REPORTED}  # fmt: skip
    ap_cosine = {s: {src: average_precision(cosine[(split == s) & (source == src)], y[(split == s) & (source == src)])
                     for src in SOURCES} for s in REPORTED}  # fmt: skip
    test_verdicts = source_verdicts(policy["test"])
    ce_verdicts = source_verdicts(cross_encoder["test"])
    false_hits_by_kind = {
        s: {k: int((served & (y == 0) & (kind == k) & (split == s)).sum()) for k in sorted(set(kind[y == 0].tolist()))}
        for s in REPORTED
    }
    meta = encoder.meta
    result = {
        "benchmark": "cache_quality",
        "model": "all-MiniLM-L6-v2 cosine gate, rule vetoes, then the policy's verifier (policies/cache/artifacts/)",
        "policy": {"threshold": config.threshold, "verifier": Path(checks.verifier).name, "min_probability": checks.min_probability,
                   "vetoes": {k: getattr(checks, k) for k in ("numbers", "entities", "negation", "direction", "opposites")}},  # fmt: skip
        "cross_encoder_setting": {"gate": chosen["gate"], "vetoes": chosen["vetoes"], "min_probability": chosen["min_probability"],
                                  "quantisation": meta.get("quantisation"), "chosen_on": "selection split"},  # fmt: skip
        "labels": {
            "qqp": "Quora is_duplicate as given",
            "stsb": f"score >= {STSB_POSITIVE_MIN} same request; every pair below it a different one",
            "gptcache": "pairs are paraphrases; negatives per split: random other item, nearest other item, meaning-changing edits",
        },
        "splits": "connected text components per source, seeded hash; qqp 70/15/15, stsb and gptcache 40/30/30 "
                  "(train / selection / test). Fine-tuned on train; gate, vetoes and min_probability chosen on selection; "
                  "test never used to choose anything.",  # fmt: skip
        "quote": "test",
        "targets": TARGETS,
        "verdicts_on_test": test_verdicts,
        "meets_targets_on_test": all(v["met"] for v in test_verdicts.values()),
        "at_policy_default": policy,
        "cross_encoder_verdicts_on_test": ce_verdicts,
        "cross_encoder_at_selection_choice": cross_encoder,
        "baselines": {
            "cosine_0.90": by_split(cosine >= 0.90, y, source, split),
            "cosine_0.95": by_split(cosine >= 0.95, y, source, split),
            "rules_only_cosine_0.82": by_split((cosine >= 0.82) & ~vetoed_all, y, source, split),
            "previous_verifier": by_split(previous_served, y, source, split),
        },
        "average_precision": {"cross_encoder_past_its_gate": ap, "cosine": ap_cosine},
        "false_hits_by_kind": false_hits_by_kind,
        "pairs": {f"{s}/{src}": int(((split == s) & (source == src)).sum()) for s in REPORTED for src in SOURCES},
        "pairs_by_kind": dict(sorted(Counter(kind.tolist()).items())),
        "verifier_curve": curve,
        "scored_pairs": len(order),
        "cross_encoder_ms_per_pair_batched": round(seconds / max(1, len(order)) * 1000, 3),
        "checked_through_decide": {"pairs": min(CHECKED_THROUGH_DECIDE, len(pairs)), "disagreements": disagreements},
        "verifier_meta": {k: meta.get(k) for k in ("quantisation", "trained_on", "training", "build_seconds")}
        | {"selection": (meta.get("selection") or {}).get("chosen")},
    }
    result["verdicts"] = verdicts("cache_quality", result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for s in REPORTED:
        print(s, "  ".join(f"{src}: precision {policy[s][src]['precision']} recall {policy[s][src]['recall']} "
                           f"({policy[s][src]['served']} served)" for src in SOURCES))  # fmt: skip
    print("shipped", json.dumps(test_verdicts))
    print("cross-encoder", json.dumps(ce_verdicts))
    print(f"decide agreed on {CHECKED_THROUGH_DECIDE - disagreements}/{CHECKED_THROUGH_DECIDE}; wrote {args.out}")
    return 0 if result["meets_targets_on_test"] and not disagreements else 1


if __name__ == "__main__":
    sys.exit(main())
