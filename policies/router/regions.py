"""Regions of prompt space: where the routing quality bound (policies/router/route_bound.py) learns.

A region is a cluster of the router's embedding (the gateway's MiniLM vector of the last user
turn): k-means centroids fitted once, on CPU with a fixed seed, over prompts of the router's
*training* families only (MMLU training subjects, AlpacaEval training sources, everyday
OpenAssistant prompts). MATH, the held-out MMLU subjects and the held-out AlpacaEval sources
were never seen: traffic of a family the router never trained on lands in the nearest region,
and the bound learns there what the cost tier gets wrong.

A request's region is the centroid with the highest dot product (the vectors are L2-normalised):
one 384 x k product, microseconds. Every replica ships the same centroids, so a region names the
same part of prompt space everywhere (what lets replicas share one learned state).

    python -m policies.router.regions fit [--data ../shared/data] [--regions 12]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

FILE = "regions.npz"
CARD = "regions.json"
SEED = 5
PER_SUBJECT = 40  # MMLU rows per training subject in the fit (seeded)


def default_dir() -> Path:
    return Path(str(resources.files("policies.router") / "regions"))


@dataclass(slots=True, frozen=True)
class Regions:
    """k centroids (k x d, unit length) and a short label per region (its biggest training families)."""

    centroids: np.ndarray
    labels: tuple[str, ...]

    @property
    def digest(self) -> str:
        """Names these centroids: judgements made under other regions are not applied to these."""
        return hashlib.sha256(np.ascontiguousarray(self.centroids, dtype=np.float32).tobytes()).hexdigest()[:16]

    @classmethod
    def load(cls, directory: Path | None = None) -> Regions:
        where = directory or default_dir()
        with np.load(where / FILE) as data:
            centroids = np.asarray(data["centroids"], dtype=np.float32)
        card = json.loads((where / CARD).read_text(encoding="utf-8"))
        labels = tuple(str(label) for label in card["labels"])
        if len(labels) != len(centroids):
            raise ValueError(f"{where / CARD} labels {len(labels)} regions, {where / FILE} has {len(centroids)}")
        return cls(centroids, labels)

    def __len__(self) -> int:
        return len(self.centroids)

    def of(self, embedding: np.ndarray) -> int:
        """The region of one embedding (its nearest centroid)."""
        vector = np.asarray(embedding, dtype=np.float32).reshape(-1)
        if vector.shape[0] != self.centroids.shape[1]:
            raise ValueError(f"an embedding of {vector.shape[0]} dimensions; the regions have {self.centroids.shape[1]}")
        return int(np.argmax(self.centroids @ vector))

    def label(self, region: int) -> str:
        return self.labels[region] if 0 <= region < len(self.labels) else f"region {region}"


def _training_texts(data_dir: Path) -> tuple[list[str], list[str]]:
    """(texts, family of each) from the router's training families only."""
    from policies.router.data import load_alpaca, load_everyday, load_mmlu, subject_sample
    from policies.router.train import ALPACA_TEST_SOURCES

    manifest = json.loads((Path(str(resources.files("policies.router") / "artifacts")) / "manifest.json").read_text())
    held_out = set(manifest["split"]["test_subjects"])
    mmlu = subject_sample(load_mmlu(data_dir), per_subject=PER_SUBJECT, seed=SEED)
    texts: list[str] = []
    families: list[str] = []
    for prompt, subject in zip(mmlu.prompts, mmlu.subjects.tolist()):
        if subject not in held_out:
            texts.append(prompt)
            families.append(f"mmlu:{subject}")
    alpaca = load_alpaca(data_dir)
    for prompt, source in zip(alpaca.prompts, alpaca.subjects.tolist()):
        if source not in ALPACA_TEST_SOURCES:
            texts.append(prompt)
            families.append(f"alpaca:{source}")
    everyday = load_everyday(data_dir)
    texts.extend(everyday)
    families.extend(["everyday"] * len(everyday))
    return texts, families


def fit(data_dir: Path, k: int, out: Path, cache_dir: Path) -> dict[str, Any]:
    """Fit k regions on the training families and write them to `out`; returns the card."""
    from sklearn.cluster import KMeans

    from policies.router.data import RuntimeEncoder, embed_all

    texts, families = _training_texts(data_dir)
    vectors = embed_all(texts, RuntimeEncoder(), cache_dir, f"regions-s{SEED}-p{PER_SUBJECT}")
    km = KMeans(n_clusters=k, random_state=SEED, n_init=8).fit(vectors)
    centroids = km.cluster_centers_ / np.linalg.norm(km.cluster_centers_, axis=1, keepdims=True)
    assigned = np.argmax(vectors @ centroids.T, axis=1)
    labels, sizes, tops = [], [], []
    for region in range(k):
        members = [families[i] for i in np.flatnonzero(assigned == region).tolist()]
        counts: dict[str, int] = {}
        for family in members:
            counts[family] = counts.get(family, 0) + 1
        top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        labels.append(", ".join(name for name, _ in top) or f"region {region}")
        sizes.append(len(members))
        tops.append({name: n for name, n in top})
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / FILE, centroids=centroids.astype(np.float32))
    card = {
        "method": "k-means (scikit-learn) over the gateway's MiniLM embedding of the last user turn; nearest centroid",
        "regions": k,
        "seed": SEED,
        "fitted_on": f"MMLU training subjects (at most {PER_SUBJECT} rows each), AlpacaEval training sources, everyday prompts",
        "never_seen": "MATH, the router's held-out MMLU subjects, AlpacaEval koala and vicuna",
        "rows": len(texts),
        "labels": labels,
        "sizes": sizes,
        "top_families": tops,
    }
    (out / CARD).write_text(json.dumps(card, indent=1) + "\n", encoding="utf-8")
    return card


def main(argv: list[str] | None = None) -> int:
    from policies.router.data import default_cache_dir, shared_data_dir

    parser = argparse.ArgumentParser(prog="python -m policies.router.regions", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("fit", help="fit the regions from ../shared/data and write them into the package")
    cmd.add_argument("--data", default=None, help="the shared data directory (default ../shared/data)")
    cmd.add_argument("--regions", type=int, default=12)
    cmd.add_argument("--out", default=str(default_dir()))
    args = parser.parse_args(argv)
    card = fit(shared_data_dir(args.data), args.regions, Path(args.out), default_cache_dir())
    for label, size in zip(card["labels"], card["sizes"]):
        print(f"{size:6d}  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
