"""Labelled request pairs for training and checking the cache verifier (development time only).

Reads ../shared/data/cache (or $TIERLANE_SHARED_DATA/cache); the gateway never reads it at run time.

Sources and labels:
- qqp: Quora question pairs (label 1 = same question), as given.
- stsb: STS-B dev; a pair is the same request when its score is >= 4.0 and a different one
  otherwise (the 2.5-4.0 middle counts as *different*: "roughly equivalent, some details differ"
  is not an answer a cache may serve).
- gptcache: the mock pairs are all paraphrases. Negatives, per item: one random other item, the
  nearest other item by cosine (a hard negative; items whose own questions are near-duplicates
  of this one are skipped, the set asks some questions twice), and edits of the item that change
  what it asks (another number, an added or removed negation, swapped direction, an opposite word).

Optional, train only: exact repeats and light edits (case, end punctuation, a contraction) of
train texts, as positives (`augment`; off in the shipped model, see MODEL_CARD.md).

Splits: every source is split by connected components of its texts (two pairs that share a text
are in the same split), with a seeded hash, into train / selection / test. The model is fitted on
train, calibrated and given its threshold on selection; test is only ever reported.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from policies.cache.scope import normalise
from policies.cache.verify import _NUMBER_WORDS, STOPWORDS

SPLITS = ("train", "selection", "test")
# (train, selection) shares per source; the rest is test.
SHARES: dict[str, tuple[float, float]] = {"qqp": (0.70, 0.15), "stsb": (0.40, 0.30), "gptcache": (0.40, 0.30)}
STSB_POSITIVE_MIN = 4.0
SEED = 20261201


@dataclass(slots=True, frozen=True)
class Pair:
    """Two request texts (normalised as the gateway normalises them) and whether one's answer fits the other."""

    a: str
    b: str
    label: int
    source: str  # qqp | stsb | gptcache
    kind: str  # qqp | paraphrase | different | random | nearest | number | negation | direction | opposite | repeat | edit
    split: str  # train | selection | test


def shared_data() -> Path:
    root = os.environ.get("TIERLANE_SHARED_DATA")
    return Path(root) if root else Path(__file__).resolve().parents[3] / "shared" / "data"


class _Components:
    """Union-find over texts: pairs sharing a text end up in one component (hence one split)."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, x: str, y: str) -> None:
        rx, ry = self.find(x), self.find(y)
        if rx != ry:
            self.parent[max(rx, ry)] = min(rx, ry)


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def _split_of(root: str, source: str) -> str:
    train, selection = SHARES[source]
    h = int.from_bytes(hashlib.sha256(f"{SEED}:{source}:{root}".encode()).digest()[:8], "big") / 2**64
    return "train" if h < train else "selection" if h < train + selection else "test"


def _assign(raw: list[tuple[str, str, int, str]], source: str) -> list[Pair]:
    comps = _Components()
    for a, b, _, _ in raw:
        comps.union(_key(a), _key(b))
    return [Pair(a, b, label, source, kind, _split_of(comps.find(_key(a)), source)) for a, b, label, kind in raw]


def load_qqp(path: Path | None = None) -> list[Pair]:
    path = path or shared_data() / "cache" / "qqp_train_pairs.json"
    items = json.loads(path.read_text("utf-8"))
    raw = [(normalise(it["text_a"]), normalise(it["text_b"]), int(it["label"]), "qqp") for it in items]
    return _assign([r for r in raw if r[0] and r[1]], "qqp")


def load_stsb(path: Path | None = None) -> list[Pair]:
    path = path or shared_data() / "cache" / "stsb_sts-dev.tsv"
    raw = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            cols = line.rstrip("\n").split("\t")
            if len(cols) < 7:
                continue
            label = int(float(cols[4]) >= STSB_POSITIVE_MIN)
            raw.append((normalise(cols[5]), normalise(cols[6]), label, "paraphrase" if label else "different"))
    return _assign(raw, "stsb")


_NUM = re.compile(r"(?<![\w.])(\d+)(?![\w.])")
_AUX = re.compile(r"\b(is|are|was|were|can|will|should|does|do|did|has|have|could|would)\b(?! not)")
_NEG = re.compile(r"\b(is|are|was|were|can|will|should|does|do|did|has|have|could|would) not\b")
_SWAP = re.compile(r"\bfrom ([\w-]+) (?:to|into) ([\w-]+)\b|\b([\w-]+) (than|into) ([\w-]+)\b")
_OPPOSITES = [("increase", "decrease"), ("before", "after"), ("enable", "disable"), ("add", "remove"),
              ("upload", "download"), ("input", "output"), ("first", "last"), ("import", "export"),
              ("encode", "decode"), ("start", "stop"), ("more", "less"), ("true", "false"),
              ("minimum", "maximum"), ("push", "pull"), ("open", "close"), ("positive", "negative")]  # fmt: skip


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


Embed = Callable[[list[str]], np.ndarray]


def load_gptcache(embed: Embed, path: Path | None = None, near_duplicate: float = 0.90) -> list[Pair]:
    """Positives as given; negatives built within each split (random, nearest, meaning-changing edits)."""
    path = path or shared_data() / "cache" / "gptcache_mock_pairs.json"
    items = [(normalise(it["origin"]), normalise(it["similar"])) for it in json.loads(path.read_text("utf-8"))]
    items = [(o, s) for o, s in items if o and s]
    positives = _assign([(o, s, 1, "paraphrase") for o, s in items], "gptcache")
    rng = random.Random(SEED)
    origins = embed([o for o, _ in items])
    similars = embed([s for _, s in items])
    out = list(positives)
    for split in SPLITS:
        members = [i for i, p in enumerate(positives) if p.split == split]
        if len(members) < 3:
            continue
        same_question = origins[members] @ origins[members].T  # near-duplicate questions are not negatives
        to_similar = origins[members] @ similars[members].T
        for row, i in enumerate(members):
            o = items[i][0]
            blocked = (same_question[row] >= near_duplicate) | (to_similar[row] >= near_duplicate + 0.05)
            blocked[row] = True
            allowed = np.flatnonzero(~blocked)
            if len(allowed) == 0:
                continue
            j = members[int(allowed[rng.randrange(len(allowed))])]
            out.append(Pair(o, items[j][1], 0, "gptcache", "random", split))
            scores = np.where(blocked, -2.0, to_similar[row])
            k = members[int(np.argmax(scores))]
            out.append(Pair(o, items[k][1], 0, "gptcache", "nearest", split))
            for kind, edited in perturb(o, rng):
                out.append(Pair(o, normalise(edited), 0, "gptcache", kind, split))
    return out


def texts_of(pairs: Iterable[Pair]) -> list[str]:
    seen: dict[str, None] = {}
    for p in pairs:
        seen.setdefault(p.a)
        seen.setdefault(p.b)
    return list(seen)


_SEPARATOR = "\x1f"  # the unit separator: never in a normalised text (NFKC keeps it, but no request has it)


class EmbeddingCache:
    """Each text encoded once, with the gateway's encoder, kept in an .npz under /tmp between runs."""

    def __init__(self, path: Path, batch: int = 128, precision: str = "fp32") -> None:
        self.path = path
        self.batch = batch
        self.precision = precision  # the embedder's (policies/embedding/embedder.py); keep each precision in its own file
        self.vectors: dict[str, np.ndarray] = {}
        if path.exists():
            with np.load(path, allow_pickle=False) as data:
                texts = data["texts"]
                names = str(texts[0]).split(_SEPARATOR) if texts.ndim == 1 and len(texts) == 1 else texts.tolist()
                self.vectors = dict(zip(names, data["vectors"]))
        self._encoder: object | None = None

    @classmethod
    def for_precision(cls, fp32_path: Path, precision: str) -> EmbeddingCache:
        """The cache of `precision`'s vectors: `fp32_path` itself, or a file beside it named for the precision."""
        if precision == "fp32":
            return cls(fp32_path)
        return cls(fp32_path.with_name(f"{fp32_path.stem}-{precision}.npz"), precision=precision)

    def __call__(self, texts: list[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in self.vectors]
        if missing:
            self._encode(missing)
        return np.stack([self.vectors[t] for t in texts]) if texts else np.zeros((0, 384), np.float32)

    def _encode(self, texts: list[str]) -> None:
        from tqdm import tqdm

        from policies.embedding.embedder import load_encoder

        encoder = load_encoder(threads=1, precision=self.precision)
        order = sorted(texts, key=len)  # similar lengths batch with less padding
        for start in tqdm(range(0, len(order), self.batch), desc="embed", unit="batch"):
            chunk = order[start : start + self.batch]
            for text, row in zip(chunk, encoder.encode(chunk)):
                self.vectors[text] = np.asarray(row, dtype=np.float32)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        texts = list(self.vectors)
        tmp = self.path.with_suffix(".tmp.npz")
        # One joined string: an array of strings is as wide as the longest text, hundreds of MB.
        np.savez(tmp, texts=np.asarray([_SEPARATOR.join(texts)]), vectors=np.stack([self.vectors[t] for t in texts]))
        os.replace(tmp, self.path)


_EDITS: tuple[tuple[str, str], ...] = (
    (r"\bwhat is\b", "what's"), (r"\bwhat's\b", "what is"), (r"\bhow do i\b", "how can i"),
    (r"\bhow can i\b", "how do i"), (r"\bis it\b", "is it really"), (r"\bdo not\b", "don't"),
    (r"\bcan you\b", "could you"), (r"\bi am\b", "i'm"),
)  # fmt: skip


def light_edit(text: str, rng: random.Random) -> str:
    """The same request written a little differently: case, end punctuation, a contraction."""
    choice = rng.randrange(4)
    if choice == 0:
        return text.lower() if text != text.lower() else text.capitalize()
    if choice == 1:
        return text.rstrip("?.! ") if text[-1:] in "?.!" else text + "?"
    for pattern, replacement in rng.sample(_EDITS, len(_EDITS)):
        edited = re.sub(pattern, replacement, text, count=1, flags=re.IGNORECASE)
        if edited != text:
            return edited
    return text.rstrip("?.! ") + ("" if choice == 2 else "!")


def augment(pairs: Iterable[Pair], per_source: int = 1500) -> list[Pair]:
    """Train-split positives the sources lack: exact repeats and light edits of their own texts.

    A cache sees repeats all the time, and QQP has no identical pairs: without these the model
    never saw |u-v| = 0 and scored some repeats below paraphrases.
    """
    rng = random.Random(SEED + 1)
    out: list[Pair] = []
    for source in SHARES:
        texts = texts_of(p for p in pairs if p.source == source and p.split == "train" and p.kind not in ("repeat", "edit"))
        for text in rng.sample(texts, min(per_source, len(texts))):
            out.append(Pair(text, text, 1, source, "repeat", "train"))
            edited = normalise(light_edit(text, rng))
            if edited and edited != text:
                out.append(Pair(text, edited, 1, source, "edit", "train"))
    return out


def load_all(embed: EmbeddingCache, *, with_augment: bool = False) -> list[Pair]:
    """Every labelled pair of the three sources, with its split; texts embedded (cached) on the way.

    `with_augment` adds the train-only repeats and light edits (tried; not what ships, see MODEL_CARD.md).
    """
    pairs = load_qqp() + load_stsb()
    embed(texts_of(pairs))
    pairs += load_gptcache(embed)
    if with_augment:
        pairs += augment(pairs)
    embed(texts_of(pairs))
    return pairs
