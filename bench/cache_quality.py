"""Precision/recall of "would serve from cache" on labelled pairs, across similarity thresholds.

Data (read from ../shared/data/cache, or $TIERLANE_SHARED_DATA/cache):
- STS-B dev: score >= 4.0 is a paraphrase (should hit), <= 2.5 is not (should miss); pairs in
  between are ambiguous and left out of precision/recall (their hit rate is reported apart).
- GPTCache mock pairs: every pair is a paraphrase. Negatives are generated: each item paired
  with a random other item, plus edits of each item that change its meaning (another number,
  an added/removed negation, swapped direction, a word swapped for its opposite). The nearest
  other item is not used: the set answers many questions twice, so it is often a paraphrase.

Writes bench/results/cache_quality.json. Run: .venv/bin/python bench/cache_quality.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from policies.cache.config import CacheConfig  # noqa: E402
from policies.cache.verify import _NUMBER_WORDS, STOPWORDS, verify  # noqa: E402
from policies.embedder import load_encoder  # noqa: E402
from policies.policy import Policy  # noqa: E402

POSITIVE_MIN = 4.0
NEGATIVE_MAX = 2.5
TARGET_PRECISION = 0.97
TARGET_RECALL = 0.5


@dataclass(slots=True)
class Pair:
    a: str
    b: str
    label: bool | None  # None: ambiguous, not counted
    source: str  # stsb | gptcache
    kind: str  # paraphrase | unrelated | middle | other_item | number | negation | direction | opposite


def shared_data() -> Path:
    root = os.environ.get("TIERLANE_SHARED_DATA")
    return Path(root) if root else REPO.parent / "shared" / "data"


def load_stsb(path: Path) -> list[Pair]:
    pairs = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            cols = line.rstrip("\n").split("\t")
            if len(cols) < 7:
                continue
            score = float(cols[4])
            if score >= POSITIVE_MIN:
                pairs.append(Pair(cols[5], cols[6], True, "stsb", "paraphrase"))
            elif score <= NEGATIVE_MAX:
                pairs.append(Pair(cols[5], cols[6], False, "stsb", "unrelated"))
            else:
                pairs.append(Pair(cols[5], cols[6], None, "stsb", "middle"))
    return pairs


_NUM = re.compile(r"(?<![\w.])(\d+)(?![\w.])")
_AUX = re.compile(r"\b(is|are|was|were|can|will|should|does|do|did|has|have|could|would)\b(?! not)")
_NEG = re.compile(r"\b(is|are|was|were|can|will|should|does|do|did|has|have|could|would) not\b")
_SWAP = re.compile(r"\bfrom ([\w-]+) (?:to|into) ([\w-]+)\b|\b([\w-]+) (than|into) ([\w-]+)\b")
_OPPOSITES = [("increase", "decrease"), ("before", "after"), ("enable", "disable"), ("add", "remove"),
              ("upload", "download"), ("input", "output"), ("first", "last"), ("import", "export"),
              ("encode", "decode"), ("start", "stop"), ("more", "less"), ("true", "false"),
              ("minimum", "maximum"), ("push", "pull"), ("open", "close"), ("positive", "negative")]


def perturb(text: str, rng: random.Random) -> list[tuple[str, str]]:
    """Edits of `text` that change what it asks for, each tagged with its kind."""
    out = []
    if m := _NUM.search(text):
        n = int(m.group(1))
        out.append(("number", text[: m.start(1)] + str(n + rng.randint(1, 9)) + text[m.end(1) :]))
    if m := _NEG.search(text):
        out.append(("negation", text[: m.end(1)] + text[m.end() :]))
    elif m := _AUX.search(text):
        out.append(("negation", text[: m.end(1)] + " not" + text[m.end(1) :]))
    for m in _SWAP.finditer(text):
        if m.group(1):
            x, y = m.group(1), m.group(2)
            edited = text[: m.start()] + f"from {y} to {x}" + text[m.end() :]
        else:
            x, y = m.group(3), m.group(5)
            if any(w.lower() in STOPWORDS or len(w) < 3 or not w.isalpha() or w.lower() in _NUMBER_WORDS for w in (x, y)):
                continue
            edited = text[: m.start()] + f"{y} {m.group(4)} {x}" + text[m.end() :]
        out.append(("direction", edited))
        break
    lower = text.lower()
    for one, other in _OPPOSITES:
        for w, v in ((one, other), (other, one)):
            if m := re.search(rf"\b{w}\b", lower):
                if not re.search(rf"\b{v}\b", lower):
                    out.append(("opposite", text[: m.start()] + v + text[m.end() :]))
                    break
        else:
            continue
        break
    return out


def load_gptcache(path: Path, rng: random.Random) -> list[Pair]:
    items = json.loads(path.read_text("utf-8"))
    origins = [it["origin"] for it in items]
    similars = [it["similar"] for it in items]
    pairs = [Pair(o, s, True, "gptcache", "paraphrase") for o, s in zip(origins, similars)]
    for i in range(len(items)):
        j = rng.randrange(len(items) - 1)
        j = j + 1 if j >= i else j
        # The set holds some items twice; a pair of the same text is not a negative.
        if origins[i].strip().lower() != origins[j].strip().lower():
            pairs.append(Pair(origins[i], similars[j], False, "gptcache", "other_item"))
    for text in origins:
        for kind, edited in perturb(text, rng):
            if edited != text:
                pairs.append(Pair(text, edited, False, "gptcache", kind))
    return pairs


def metrics(served: np.ndarray, labels: np.ndarray) -> dict[str, float | int]:
    tp = int(np.sum(served & labels))
    fp = int(np.sum(served & ~labels))
    fn = int(np.sum(~served & labels))
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": round(precision, 4), "recall": round(recall, 4), "f1": round(f1, 4),
            "tp": tp, "fp": fp, "fn": fn}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cache_quality.json")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    data = shared_data() / "cache"
    if not data.is_dir():
        print(f"../shared/data absent: {data} not found (set TIERLANE_SHARED_DATA)", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    cfg = CacheConfig.from_section(Policy.load().section("cache"))
    encoder = load_encoder()  # the gateway's default backend
    pairs = load_stsb(data / "stsb_sts-dev.tsv") + load_gptcache(data / "gptcache_mock_pairs.json", rng)

    started = time.perf_counter()
    va = np.concatenate([encoder.encode([p.a for p in pairs[i : i + 256]]) for i in tqdm(range(0, len(pairs), 256), desc="embed a")])
    vb = np.concatenate([encoder.encode([p.b for p in pairs[i : i + 256]]) for i in tqdm(range(0, len(pairs), 256), desc="embed b")])
    sims = np.sum(va * vb, axis=1)
    verified = np.array([verify(p.a, p.b, cfg.verify) is None for p in tqdm(pairs, desc="verify")])
    elapsed = time.perf_counter() - started

    counted = np.array([p.label is not None for p in pairs])
    labels = np.array([bool(p.label) for p in pairs])
    sources = np.array([p.source for p in pairs])
    kinds = np.array([p.kind for p in pairs])

    thresholds = [round(t, 2) for t in np.arange(0.70, 0.99, 0.01)]
    table = []
    for t in thresholds:
        near = sims >= t
        served = near & verified
        row: dict[str, object] = {"threshold": t}
        row["similarity_only"] = metrics(near[counted], labels[counted])
        row["verified"] = metrics(served[counted], labels[counted])
        for source in ("stsb", "gptcache"):
            mask = counted & (sources == source)
            row[f"verified_{source}"] = metrics(served[mask], labels[mask])
        row["served_rate_by_kind"] = {
            k: round(float(served[kinds == k].mean()), 4) for k in sorted(set(kinds.tolist()))
        }
        table.append(row)

    def safe(row: dict) -> bool:
        return all(row[k]["precision"] >= TARGET_PRECISION for k in ("verified", "verified_stsb", "verified_gptcache"))

    # The lowest threshold from which precision holds on every source at every higher threshold.
    best = None
    for row in reversed(table):
        if not safe(row):
            break
        best = row
    default_row = next((r for r in table if abs(r["threshold"] - cfg.threshold) < 1e-9), None)
    count = {k: int(np.sum(kinds == k)) for k in sorted(set(kinds.tolist()))}
    result = {
        "benchmark": "cache_quality",
        "model": "all-MiniLM-L6-v2",
        "embedding_backend": encoder.backend,
        "labels": {
            "stsb": f"score >= {POSITIVE_MIN} paraphrase, <= {NEGATIVE_MAX} not; the middle is excluded",
            "gptcache": "pairs are paraphrases; negatives: most similar other item + meaning-changing edits",
        },
        "pairs_by_kind": count,
        "pairs_counted": int(counted.sum()),
        "positives": int(labels[counted].sum()),
        "target": {"precision": TARGET_PRECISION, "recall": TARGET_RECALL},
        "policy_default_threshold": cfg.threshold,
        "at_policy_default": default_row,
        "lowest_threshold_meeting_precision_on_every_source": best["threshold"] if best else None,
        "default_meets_target": bool(
            default_row
            and default_row["verified"]["precision"] >= TARGET_PRECISION
            and default_row["verified"]["recall"] >= TARGET_RECALL
        ),
        "seconds": round(elapsed, 2),
        "table": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    d = default_row["verified"] if default_row else {}
    print(f"default threshold {cfg.threshold}: precision {d.get('precision')} recall {d.get('recall')} "
          f"f1 {d.get('f1')}; lowest safe threshold {result['lowest_threshold_meeting_precision_on_every_source']}")
    print(f"wrote {args.out}")
    return 0 if result["default_meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
