"""The router's training data from `../shared/data/router/`, and an on-disk cache of its embeddings."""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from policies.cache.scope import embedding_text

WEAK_COLUMN = "mistralai/Mixtral-8x7B-Instruct-v0.1"
STRONG_COLUMN = "gpt-4-1106-preview"
EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def shared_data_dir(override: str | Path | None = None) -> Path:
    """`--data` if given, else $TIERLANE_SHARED_DATA, else `<repo>/../shared/data`."""
    if override is not None:
        return Path(override)
    env = os.environ.get("TIERLANE_SHARED_DATA")
    return Path(env) if env else repo_root().parent / "shared" / "data"


def default_cache_dir() -> Path:
    return repo_root() / ".tierlane" / "cache" / "router"


@dataclass(slots=True)
class MMLUData:
    """MMLU prompts with the weak and strong models' correctness and the subject of each."""

    prompts: list[str]
    subjects: np.ndarray
    weak: np.ndarray
    strong: np.ndarray

    @property
    def label(self) -> np.ndarray:
        """1 where the strong model is needed: the weak one is wrong and the strong one right."""
        return np.asarray((self.weak == 0) & (self.strong == 1), dtype=np.int64)

    def take(self, idx: np.ndarray) -> MMLUData:
        return MMLUData([self.prompts[i] for i in idx], self.subjects[idx], self.weak[idx], self.strong[idx])


# AlpacaEval: per-model preferences of GPT-4-turbo between a model's answer and the reference
# answer of gpt4_1106_preview (1.0 = reference clearly better, 2.0 = model clearly better).
ALPACA_FILE = "alpaca_eval_805_per_model_preferences.jsonl"
ALPACA_REFERENCE = "gpt4_1106_preview"
# The routing pair on AlpacaEval: a 1B model, the size of an edge model, against the reference.
ALPACA_WEAK = "FuseChat-Llama-3.2-1B-Instruct"
# "Strong needed": the judge prefers the reference with probability >= 0.75 (pref <= 1.25).
ALPACA_CLEAR_LOSS = 1.25
# Small and mid-sized models whose averaged preference is the "panel" training target.
ALPACA_PANEL = (
    "FuseChat-Llama-3.2-1B-Instruct",
    "FuseChat-Llama-3.2-3B-Instruct",
    "Mixtral-8x7B-Instruct-v0.1_concise",
    "gemma-7b-it",
    "gpt-3.5-turbo-1106",
    "OpenHermes-2.5-Mistral-7B",
)


@dataclass(slots=True)
class AlpacaData:
    """AlpacaEval instructions, their source data set, and the judge's preferences per model.

    The routing view mirrors MMLU's: `weak` is the weak model's quality on a prompt, the judge's
    probability that its answer beats the reference (pref - 1); `strong` is the reference's own,
    0.5 (a tie with itself). Their means are AlpacaEval win rates, so PGR and APGR read as
    "share of the win-rate gap recovered".
    """

    prompts: list[str]
    subjects: np.ndarray  # the source data set (selfinstruct, oasst, koala, helpful_base, vicuna)
    prefs: dict[str, np.ndarray]

    @property
    def weak(self) -> np.ndarray:
        return np.asarray(self.prefs[ALPACA_WEAK] - 1.0, dtype=np.float64)

    @property
    def strong(self) -> np.ndarray:
        return np.full(len(self.prompts), 0.5)

    @property
    def label(self) -> np.ndarray:
        """1 where the strong model is needed: the weak model clearly loses to the reference."""
        return np.asarray(self.prefs[ALPACA_WEAK] <= ALPACA_CLEAR_LOSS, dtype=np.int64)

    def target(self, kind: str) -> np.ndarray:
        """A training target in [0, 1]: "weak" (P(reference better)), "panel" (its mean over ALPACA_PANEL), "binary"."""
        if kind == "weak":
            return np.asarray(2.0 - self.prefs[ALPACA_WEAK], dtype=np.float64)
        if kind == "panel":
            return np.asarray(np.mean([2.0 - self.prefs[m] for m in ALPACA_PANEL], axis=0), dtype=np.float64)
        if kind == "binary":
            return self.label.astype(np.float64)
        raise ValueError(f"unknown AlpacaEval target {kind!r}; expected weak, panel or binary")

    def take(self, idx: np.ndarray) -> AlpacaData:
        return AlpacaData([self.prompts[i] for i in idx], self.subjects[idx], {k: v[idx] for k, v in self.prefs.items()})


def load_alpaca(data_dir: Path) -> AlpacaData:
    """The 805 AlpacaEval instructions with every model's preference against the reference."""
    prompts: list[str] = []
    sources: list[str] = []
    rows: list[dict[str, float]] = []
    with (data_dir / "router" / ALPACA_FILE).open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                prompts.append(row["instruction"])
                sources.append(row["dataset"])
                rows.append(row["pref_vs_gpt4_1106_preview"])
    needed = {ALPACA_WEAK, *ALPACA_PANEL}
    missing = sorted(m for m in needed if any(m not in r for r in rows))
    if missing:
        raise ValueError(f"{ALPACA_FILE}: rows without a preference for {', '.join(missing)}")
    models = sorted(set.intersection(*(set(r) for r in rows))) if rows else []
    prefs = {m: np.asarray([float(r[m]) for r in rows]) for m in models}
    return AlpacaData(prompts, np.asarray(sources), prefs)


def _bool(value: str, where: str) -> int:
    v = value.strip().lower()
    if v in ("true", "1"):
        return 1
    if v in ("false", "0"):
        return 0
    raise ValueError(f"{where}: expected True/False, got {value!r}")


def load_mmlu(data_dir: Path) -> MMLUData:
    """All `routellm_mmlu_responses/mmlu_*.csv`, subject taken from the file name."""
    folder = data_dir / "router" / "routellm_mmlu_responses"
    files = sorted(folder.glob("mmlu_*.csv"))
    if not files:
        raise FileNotFoundError(f"no mmlu_*.csv under {folder}")
    prompts: list[str] = []
    subjects: list[str] = []
    weak: list[int] = []
    strong: list[int] = []
    for path in files:
        subject = path.stem.removeprefix("mmlu_")
        with path.open(encoding="utf-8", newline="") as fh:
            for i, row in enumerate(csv.DictReader(fh)):
                where = f"{path.name} row {i + 2}"
                prompts.append(row["prompt"])
                subjects.append(subject)
                weak.append(_bool(row[WEAK_COLUMN], where))
                strong.append(_bool(row[STRONG_COLUMN], where))
    return MMLUData(prompts, np.asarray(subjects), np.asarray(weak), np.asarray(strong))


def load_math(data_dir: Path) -> tuple[list[str], np.ndarray]:
    """MATH problems and their difficulty level (1..5)."""
    problems: list[str] = []
    levels: list[int] = []
    with (data_dir / "router" / "math_levels.jsonl").open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            level = str(row.get("level", "")).removeprefix("Level ").strip()
            if not level.isdigit():
                continue  # a few MATH rows carry "Level ?"
            problems.append(row["problem"])
            levels.append(int(level))
    return problems, np.asarray(levels)


def load_everyday(data_dir: Path) -> list[str]:
    """Unlabelled first prompts from real users (OpenAssistant)."""
    out: list[str] = []
    for name in ("oasst_en_100_text.jsonl", "oasst_prompt_lottery_en_250_text.jsonl"):
        with (data_dir / "router" / name).open(encoding="utf-8") as fh:
            out.extend(json.loads(line) for line in fh if line.strip())
    return out


Encoder = Callable[[list[str]], np.ndarray]


# What the gateway embeds: policies.cache.scope.embedding_text of the request (the last user
# turn, normalised, cut at 4000 chars) with the gateway's default ONNX backend (RuntimeEncoder).
# It reproduces sentence-transformers' vectors to cosine > 0.99999 (checked at export and in
# tests/unit/cache/test_onnx_encoder.py), so artifacts trained here serve either backend, and
# cached vectors from either are the same to 2e-5.
RUNTIME_MAX_SEQ_LENGTH = 256


def runtime_text(prompt: str) -> str:
    """The exact text the gateway embeds for a one-turn chat request carrying `prompt`."""
    return embedding_text({"messages": [{"role": "user", "content": prompt}]}) or ""


class RuntimeEncoder:
    """The gateway's embedding backend (policies.embedding.embedder.load_encoder: the exported ONNX graph,
    torch when it cannot run), loaded on first use, with onnxruntime's default intra-op threads.

    NOTE: the same graph the gateway serves, so training and evaluation read the served vectors;
    on 2 cores it embeds the held-out MMLU rows ~2x faster than sentence-transformers on one torch
    thread (torch's spinning worker threads made more than one ~30x slower on a shared machine;
    onnxruntime's sleep between ops, policies.embedding.onnx_encoder.cpu_session).
    """

    def __init__(self) -> None:
        self._encoder: Any = None

    def __call__(self, texts: list[str]) -> np.ndarray:
        if self._encoder is None:
            from policies.embedding.embedder import bundled_model_path, load_encoder
            from policies.embedding.onnx_encoder import max_seq_length

            reads = max_seq_length(bundled_model_path())
            if reads != RUNTIME_MAX_SEQ_LENGTH:
                raise ValueError(
                    f"the embedding model reads {reads} word pieces, the router expects "
                    f"{RUNTIME_MAX_SEQ_LENGTH}; retrain the router for this model"
                )
            self._encoder = load_encoder("onnx", threads=None)
            if self._encoder.backend == "torch":  # the fallback: one thread, as before (spinning workers)
                import torch

                torch.set_num_threads(1)
        return np.asarray(self._encoder.encode(list(texts)), dtype=np.float32)


def grouped_embeddings(
    texts: Sequence[str],
    groups: np.ndarray,
    wanted: Sequence[str],
    encoder: Encoder,
    cache_dir: Path,
    label: str,
    batch_size: int = 256,
) -> np.ndarray:
    """Embeddings of the rows whose group is in `wanted`, in row order, cached one file per group.

    Per-group files let an evaluation embed only its held-out subjects on a cold cache, while
    training (all subjects) fills and reuses the same files. Missing groups are embedded in one
    length-sorted pass with a single progress bar.
    """
    rows = np.flatnonzero(np.isin(groups, list(wanted)))
    paths: dict[str, Path] = {}
    for group in sorted(set(groups[rows].tolist())):
        idx = np.flatnonzero(groups == group)
        digest = hashlib.sha256(f"{EMBEDDING_MODEL_NAME}\0{RUNTIME_MAX_SEQ_LENGTH}".encode())
        for i in idx.tolist():
            digest.update(texts[i].encode("utf-8", "surrogatepass") + b"\0")
        paths[group] = cache_dir / f"{label}-{group}-{digest.hexdigest()[:16]}.npy"
    missing = [g for g, p in paths.items() if not p.is_file()]
    if missing:
        todo = np.flatnonzero(np.isin(groups, missing))
        order = todo[np.argsort([len(texts[i]) for i in todo.tolist()], kind="stable")]
        vectors: dict[int, np.ndarray] = {}
        with tqdm(total=len(order), desc=f"embed {label} ({len(missing)} groups)", unit="row") as bar:
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                for i, v in zip(chunk.tolist(), encoder([texts[i] for i in chunk])):
                    vectors[i] = v
                bar.update(len(chunk))
        cache_dir.mkdir(parents=True, exist_ok=True)
        for group in missing:
            idx = np.flatnonzero(groups == group)
            tmp = paths[group].with_suffix(".tmp.npy")
            np.save(tmp, np.stack([vectors[i] for i in idx.tolist()]).astype(np.float32))
            tmp.replace(paths[group])
    by_group = {g: np.load(p) for g, p in paths.items()}
    dim = next(iter(by_group.values())).shape[1] if by_group else 0
    out = np.empty((len(rows), dim), dtype=np.float32)
    position = {g: 0 for g in by_group}
    for k, i in enumerate(rows.tolist()):
        g = str(groups[i])
        out[k] = by_group[g][position[g]]
        position[g] += 1
    return out


# MMLU rows per subject used in training and evaluation, and their sampling seed. None = every row:
# the runtime-way embedding pass over all 14,042 rows takes ~5-11 min on one core; set a cap (rows
# per subject, seeded) only if that ever stops fitting.
PER_SUBJECT: int | None = None
SUBJECT_SEED = 11
EMBED_TAG = f"mmlu-rt{RUNTIME_MAX_SEQ_LENGTH}"


def subject_sample(mmlu: MMLUData, per_subject: int | None = PER_SUBJECT, seed: int = SUBJECT_SEED) -> MMLUData:
    """At most `per_subject` seeded rows of every subject (all rows when None), in file order."""
    if per_subject is None:
        return mmlu
    rng = np.random.RandomState(seed)
    keep: list[int] = []
    for subject in np.unique(mmlu.subjects):
        idx = np.flatnonzero(mmlu.subjects == subject)
        keep.extend(np.sort(rng.permutation(idx)[:per_subject]).tolist())
    return mmlu.take(np.asarray(keep))


def mmlu_embeddings(
    mmlu: MMLUData, cache_dir: Path, subjects: list[str] | None = None, encoder: Encoder | None = None
) -> np.ndarray:
    """Embeddings of the rows of `subjects` (default: all), computed exactly as the gateway does.

    Text: policies.cache.scope.embedding_text of a one-turn chat request; model: policies.embedding.embedder
    at its own settings (256 word pieces). Cached per subject, so an evaluation embeds only its own.
    """
    texts = [runtime_text(p) for p in mmlu.prompts]
    wanted = sorted(set(mmlu.subjects.tolist())) if subjects is None else subjects
    return grouped_embeddings(texts, mmlu.subjects, wanted, encoder or RuntimeEncoder(), cache_dir, EMBED_TAG)


def embed_all(texts: list[str], encoder: Encoder, cache_dir: Path, label: str) -> np.ndarray:
    """`texts` as one-turn requests, embedded the gateway's way (cached under `label`)."""
    runtime = [runtime_text(t) for t in texts]
    return grouped_embeddings(runtime, np.full(len(runtime), "all"), ["all"], encoder, cache_dir, label)


def alpaca_embeddings(alpaca: AlpacaData, cache_dir: Path, encoder: Encoder | None = None) -> np.ndarray:
    """AlpacaEval instructions embedded the gateway's way (cached)."""
    return embed_all(alpaca.prompts, encoder or RuntimeEncoder(), cache_dir, f"alpaca-rt{RUNTIME_MAX_SEQ_LENGTH}")
