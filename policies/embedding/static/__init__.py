"""A static sentence embedding distilled from the bundled all-MiniLM-L6-v2: a table lookup and a mean.

Each word piece of MiniLM's vocabulary has one vector (model2vec's distillation: the transformer's
output for the token alone, reduced by PCA and weighted down for frequent tokens). A text's
embedding is the L2-normalised mean of its tokens' vectors: no transformer forward, no torch, a
few microseconds per request. It approximates MiniLM, it does not reproduce it (cosines between
the two spaces are meaningless; the dimension differs). bench/static_embedding.py measures, per
reader (cache candidate search, router, edge prior), whether it can stand in for the transformer.

Serving needs numpy and tokenizers only; `python -m policies.embedding.static.distill` (model2vec,
torch: the `distill` extra) rebuilds the artifact from the bundled weights, offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from policies.artifact_dir import read_artifact_dir

ARTIFACT_DIR = Path(__file__).resolve().parent / "artifacts"
VECTORS_FILE = "vectors.npz"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = 1
# Tokens read per text: as the distilled model's own encode (model2vec's default), far more than
# the 4000 characters the gateway embeds at most.
MAX_TOKENS = 512


class StaticEmbeddingError(RuntimeError):
    """The static embedding artifact is missing, damaged or of another format."""


REBUILD = "rebuild it with `make static-embedding`"


def _check(manifest: dict[str, Any]) -> None:
    if manifest.get("format") != FORMAT:
        raise StaticEmbeddingError(f"static embedding artifact format {manifest.get('format')!r}, expected {FORMAT}; {REBUILD}")


class StaticEmbedding:
    """Texts in, L2-normalised float32 rows out (the `SentenceEncoder` shape: `backend`, `encode`).

    The table is int8 with one float scale per token: mean of (int8 row x scale), then normalised.
    Thread-safe: encode reads the table and a tokenizer whose batch encode holds no state.
    """

    backend = "static"

    def __init__(self, table: np.ndarray, scales: np.ndarray, tokenizer: Any, manifest: dict[str, Any]) -> None:
        if table.ndim != 2 or scales.shape != (table.shape[0],):
            raise StaticEmbeddingError(f"static embedding table {table.shape} and scales {scales.shape} do not fit")
        # Dequantised once at load: float32 rows make the per-text mean one fancy-index and a sum.
        self._vectors = np.ascontiguousarray(table.astype(np.float32) * scales[:, None].astype(np.float32))
        self._tokenizer = tokenizer
        self._unk = tokenizer.token_to_id("[UNK]")
        self.manifest = manifest

    @classmethod
    def load(cls, path: str | Path | None = None) -> StaticEmbedding:
        """The artifact at `path` (default: the shipped one), its hash checked against the manifest."""
        from tokenizers import Tokenizer

        manifest, directory, vectors_path = read_artifact_dir(
            path or ARTIFACT_DIR, what="static embedding", default_model_file=VECTORS_FILE,
            error=StaticEmbeddingError, rebuild=REBUILD, check=_check,
        )  # fmt: skip
        tokenizer_path = directory / str(manifest.get("tokenizer_file", TOKENIZER_FILE))
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
            with np.load(vectors_path, allow_pickle=False) as data:
                table, scales = data["table"], data["scales"]
        except Exception as exc:  # re-raised: any unreadable file is the same error for the caller
            raise StaticEmbeddingError(f"cannot read the static embedding artifact in {directory}: {exc}") from exc
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=MAX_TOKENS)
        return cls(table, scales, tokenizer, manifest)

    @property
    def dimension(self) -> int:
        return int(self._vectors.shape[1])

    @property
    def vocabulary(self) -> int:
        return int(self._vectors.shape[0])

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Word-piece ids of each text, no special tokens, unknown pieces dropped (as model2vec encodes)."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [[i for i in e.ids if i != self._unk] for e in encodings]

    def encode(self, texts: list[str]) -> np.ndarray:
        """One L2-normalised float32 row per text; a text without known tokens gets a zero row."""
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        if not texts:
            return out
        for row, ids in enumerate(self.token_ids(texts)):
            if ids:
                mean = self._vectors[ids].sum(axis=0)
                norm = float(np.linalg.norm(mean))
                if norm > 0:
                    out[row] = mean / norm
        return out


def load_static_embedding(path: str | Path | None = None) -> StaticEmbedding:
    """The shipped static embedding (or the artifact at `path`)."""
    return StaticEmbedding.load(path)


def manifest_of(path: str | Path | None = None) -> dict[str, Any]:
    """The artifact's manifest without loading the table."""
    directory = Path(path or ARTIFACT_DIR)
    return dict(json.loads((directory / "manifest.json").read_text(encoding="utf-8")))
