"""The router's training data from `../shared/data/router/`, and an on-disk cache of its embeddings."""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

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
        return ((self.weak == 0) & (self.strong == 1)).astype(np.int64)

    def take(self, idx: np.ndarray) -> MMLUData:
        return MMLUData([self.prompts[i] for i in idx], self.subjects[idx], self.weak[idx], self.strong[idx])


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


def cached_embeddings(
    texts: Sequence[str], encoder: Encoder, cache_dir: Path, label: str, batch_size: int = 256
) -> np.ndarray:
    """Embed `texts` once; later calls with the same texts read `<cache_dir>/<label>-<hash>.npy`."""
    digest = hashlib.sha256(EMBEDDING_MODEL_NAME.encode())
    for t in texts:
        digest.update(t.encode("utf-8", "surrogatepass") + b"\0")
    path = cache_dir / f"{label}-{digest.hexdigest()[:16]}.npy"
    if path.is_file():
        return np.load(path)
    # Similar lengths in one batch waste less padding; the order is restored afterwards.
    order = np.argsort([len(t) for t in texts], kind="stable")
    chunks = []
    for start in tqdm(range(0, len(texts), batch_size), desc=f"embed {label}", unit="batch"):
        chunks.append(encoder([texts[i] for i in order[start : start + batch_size]]))
    vectors = np.empty((len(texts), chunks[0].shape[1]), dtype=np.float32)
    vectors[order] = np.vstack(chunks)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, vectors)
    tmp.replace(path)
    return vectors
