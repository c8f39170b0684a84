"""The cache's cross-encoder verifier at serve time: onnxruntime and `tokenizers`, no torch.

A cross-encoder reads both request texts together ("[CLS] query [SEP] candidate [SEP]") and gives
one logit that they ask the same thing. The probability the policy compares with
`cache.verify.min_probability` is a logistic blend (`blend` in the artifact's meta, fitted on the
selection split) of that logit, the bi-encoder cosine the lookup already has and, when the meta
names it, the logit of the embedding-feature verifier's probability (`verifier.npz`): the three
err in different places, and together they rank pairs better than any one of them. Without a
blend the logit's sigmoid is the probability. Fine-tuned from the bundled all-MiniLM-L6-v2 weights by
policies/cache/cross_encoder_train.py, exported to ONNX and quantised to int8 there; the
artifact (`artifacts/cross_encoder.onnx`, with `cross_encoder.json` beside it) is read here, with
the bundled model's own tokenizer (the vocabulary the fine-tuning kept).

Pairs are scored together in one call (padded to the longest). A pair longer than `max_length`
tokens is not truncated into a guess: its probability is 0 (a miss), since the part cut off may be
where the two requests differ.
"""

from __future__ import annotations

import json
import logging
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
BUNDLED_CROSS_ENCODER = ARTIFACTS / "cross_encoder.onnx"  # NOTE: the same path as verify.BUNDLED_CROSS_ENCODER
FORMAT = 1
MAX_LENGTH = 128  # tokens of the pair with its three special tokens; longer pairs are misses


def meta_path(onnx_path: Path) -> Path:
    return onnx_path.with_suffix(".json")


def pair_tokenizer(model_dir: Path, max_length: int) -> Any:
    """The bundled model's WordPiece tokenizer, for pairs: no truncation (length is checked), padding to the longest."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tokenizer.no_truncation()
    pad_id = tokenizer.token_to_id("[PAD]")
    tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token="[PAD]")
    return tokenizer


def encode_pairs(tokenizer: Any, pairs: list[tuple[str, str]]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The graph's inputs for `pairs` and each pair's length in tokens (unpadded)."""
    encodings = tokenizer.encode_batch(pairs)
    lengths = np.asarray([sum(e.attention_mask) for e in encodings], dtype=np.int64)
    feed = {
        "input_ids": np.asarray([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.asarray([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.asarray([e.type_ids for e in encodings], dtype=np.int64),
    }
    return feed, lengths


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 / (1.0 + np.exp(-np.clip(x, -60.0, 60.0))), dtype=np.float64)


class CrossEncoder:
    """Probabilities that two request texts ask the same thing, from an exported cross-encoder."""

    def __init__(self, onnx_path: Path, model_dir: Path | None = None, threads: int | None = 1) -> None:
        from policies.embedding.onnx_encoder import cpu_session
        from policies.embedding.sentence_model import bundled_model_path

        self.path = Path(onnx_path)
        meta_file = meta_path(self.path)
        self.meta: dict[str, Any] = json.loads(meta_file.read_text("utf-8")) if meta_file.is_file() else {}
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{self.path}: cross-encoder meta {meta_file} has format {self.meta.get('format')!r}, expected {FORMAT}")
        self.max_length = int(self.meta.get("max_length", MAX_LENGTH))
        self._session = cpu_session(self.path, threads)
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._tokenizer = pair_tokenizer(model_dir or bundled_model_path(), self.max_length)
        self.calls = 0  # batched calls made (each scores one lookup's candidates together)
        self.pairs = 0

    def logits(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        """One logit per pair; -inf for a pair longer than `max_length` tokens (never scored)."""
        out = np.full(len(pairs), -math.inf, dtype=np.float64)
        if not pairs:
            return out
        feed, lengths = encode_pairs(self._tokenizer, pairs)
        fits = np.flatnonzero(lengths <= self.max_length)
        if len(fits) == 0:
            return out
        width = int(lengths[fits].max())
        feed = {name: array[fits, :width] for name, array in feed.items() if name in self._inputs}
        (logits,) = self._session.run(None, feed)
        out[fits] = np.asarray(logits, dtype=np.float64).reshape(-1)
        self.calls += 1
        self.pairs += len(fits)
        return out

    @property
    def blend(self) -> dict[str, Any] | None:
        blend = self.meta.get("blend")
        return blend if isinstance(blend, dict) else None

    def blend_for(self, space: str | None) -> dict[str, Any] | None:
        """The blend fitted on the cosines and verifier probabilities of vectors from `space`
        (`blends` in the meta, policies/cache/blend_refit.py), else the one fitted with the artifact."""
        blends = self.meta.get("blends")
        found = blends.get(space) if isinstance(blends, dict) and space is not None else None
        return found if isinstance(found, dict) else self.blend

    @property
    def previous_verifier(self) -> Path | None:
        """The embedding-feature verifier the blend also reads (beside this artifact), if any."""
        return self.previous_verifier_for(None)

    def previous_verifier_for(self, space: str | None) -> Path | None:
        """The embedding-feature verifier the blend for vectors of `space` reads, if any."""
        name = (self.blend_for(space) or {}).get("previous_verifier")
        return self.path.parent / str(name) if name else None

    def previous_verifiers(self) -> list[Path]:
        """Every embedding-feature verifier a blend of this artifact reads."""
        blends = self.meta.get("blends")
        spaces = [None, *blends] if isinstance(blends, dict) else [None]
        return sorted({p for space in spaces if (p := self.previous_verifier_for(space)) is not None})

    def probabilities(
        self,
        pairs: list[tuple[str, str]],
        cosine: np.ndarray | list[float] | None = None,
        previous: np.ndarray | list[float] | None = None,
        space: str | None = None,
    ) -> np.ndarray:
        """Each pair's probability (0 for a pair too long to score). A blend reads the pairs'
        bi-encoder cosines (of vectors from `space`) and, when it names a previous verifier, that
        verifier's probabilities."""
        return self.calibrate(self.logits(pairs), cosine, previous, space)

    def calibrate(
        self,
        logits: np.ndarray,
        cosine: np.ndarray | list[float] | None = None,
        previous: np.ndarray | list[float] | None = None,
        space: str | None = None,
    ) -> np.ndarray:
        """Probabilities from logits (with cosines and the previous verifier's probabilities for a
        blend, the one fitted for vectors of `space`); a pair with a -inf logit (too long) gets 0."""
        blend = self.blend_for(space)
        finite = np.isfinite(logits)
        z = np.where(finite, logits, 0.0)
        if blend:
            if cosine is None:
                raise ValueError(f"{self.path}: this cross-encoder blends its logit with the pair's cosine; pass cosine")
            z = float(blend["logit"]) * z + float(blend["cosine"]) * np.asarray(cosine, dtype=np.float64) + float(blend["bias"])
            if "previous" in blend:
                if previous is None:
                    raise ValueError(f"{self.path}: this cross-encoder blends in {blend.get('previous_verifier')}; pass previous")
                z = z + float(blend["previous"]) * logit(np.asarray(previous, dtype=np.float64))
        return np.where(finite, sigmoid(z), 0.0)


def logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(p, 1e-6, 1.0 - 1e-6)
    return np.asarray(np.log(q / (1.0 - q)), dtype=np.float64)


@lru_cache(maxsize=4)
def load_cross_encoder(path: str) -> CrossEncoder:
    """The cross-encoder at `path` (memoised per path; one session serves every thread)."""
    return CrossEncoder(Path(path))
