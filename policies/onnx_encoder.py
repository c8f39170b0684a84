"""all-MiniLM-L6-v2 on onnxruntime: the sentence-transformers vectors at about a third of the CPU time.

The ONNX graph is exported once from the bundled weights (no download) with torch's exporter,
checked against sentence-transformers on probe texts, and kept in a cache directory under a key
made of the weights' digest and the export recipe. Later starts load it without importing torch.
Measured on one core: 3.7 ms per 15-token sentence against 12.3 ms for torch eager (MKL packs
the weights again on every small matmul; onnxruntime's MLAS packs them once at load).

`int8` precision: the same graph with every MatMul's weights quantised per output channel and
its activations quantised on the fly (onnxruntime's dynamic quantisation; embeddings, layer norms
and attention softmax stay float32). About half the CPU of float32 on a machine with VNNI
(bench/embedding_precision.py); its vectors differ from float32's by a cosine of ~0.99, and what
reads them was checked on held-out data against the float32 figures (the same bench).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from policies.sentence_model import DIMENSION

if TYPE_CHECKING:
    from sentence_transformers.sentence_transformer.modules import Transformer

log = logging.getLogger(__name__)

# Bump when the exported graph changes (wrapper, opset, inputs): old files are then ignored.
EXPORT_VERSION = 1
OPSET = 17
# The exported graph must reproduce sentence-transformers to this cosine on every probe.
MIN_PROBE_COSINE = 0.99999
PROBES = (
    "hi",
    "How do I convert a list of strings to integers in Python?",
    "Convert 5 miles to kilometers",
    "Explain the difference between TCP and UDP, with examples of when each one is the better choice "
    "for a real-time multiplayer game, a file transfer service and a DNS resolver.",
)
# An int8 graph must stay this close to the float32 one on every probe (cosine; measured 0.975 at
# worst over 833 held-out MMLU prompts, 0.9935 median).
MIN_INT8_PROBE_COSINE = 0.97
PRECISIONS = ("fp32", "int8")
# Bump when the quantisation recipe changes.
INT8_RECIPE = "dynamic-qint8-per-channel-matmul-v1"
# Texts of similar length are encoded together: padding a 5-token text to 200 wastes the work.
SUB_BATCH = 16


def _model_digest(model_dir: Path) -> str:
    digest = hashlib.sha256(f"tierlane-onnx-export-v{EXPORT_VERSION}-opset{OPSET}".encode())
    for name in ("config.json", "sentence_bert_config.json", "tokenizer.json", "model.safetensors"):
        path = model_dir / name
        digest.update(name.encode() + b"\0")
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def max_seq_length(model_dir: Path) -> int:
    """How many word pieces the model reads (sentence-transformers' setting; longer text is cut)."""
    config = json.loads((model_dir / "sentence_bert_config.json").read_text())
    return int(config.get("max_seq_length", 256))


def onnx_path_for(model_dir: Path, cache_dir: Path, precision: str = "fp32") -> Path:
    digest = _model_digest(model_dir)
    if precision == "fp32":
        return Path(cache_dir) / f"minilm-{digest}.onnx"
    if precision == "int8":
        recipe = hashlib.sha256(INT8_RECIPE.encode()).hexdigest()[:8]
        return Path(cache_dir) / f"minilm-{digest}-int8-{recipe}.onnx"
    raise ValueError(f"unknown embedding precision {precision!r}: expected one of {', '.join(PRECISIONS)}")


def export(model_dir: Path, out_path: Path) -> Path:
    """Export the sentence-transformers model (transformer, mean pooling, L2 norm) to ONNX and check it.

    Written to a temporary file beside `out_path` and renamed into place only after the probes
    match, so a crash or a concurrent export never leaves a half-written or wrong model behind.
    """
    import torch

    from policies.sentence_model import encode, load_sentence_model

    model = load_sentence_model(model_dir)
    # Indexing the model is typed as a plain torch Module; its first module is the Transformer.
    # NOTE: eval() through torch's Module: transformers' override of it is unannotated.
    transformer: torch.nn.Module = cast("Transformer", model[0]).auto_model
    transformer.eval()

    class _Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    tokenizer = _tokenizer(model_dir)
    example = _feed(tokenizer, ["an example", "a longer example sentence for the trace"])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=out_path.name, suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        # The tracer warns about shape branches it freezes (BERT is never causal here); the probe
        # comparison below is what decides whether the graph is right, so the warnings are muted.
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                _Pooled().eval(),
                (torch.from_numpy(example["input_ids"]), torch.from_numpy(example["attention_mask"])),
                str(tmp),
                input_names=["input_ids", "attention_mask"],
                output_names=["embedding"],
                dynamic_axes={
                    "input_ids": {0: "batch", 1: "tokens"},
                    "attention_mask": {0: "batch", 1: "tokens"},
                    "embedding": {0: "batch"},
                },
                opset_version=OPSET,
                dynamo=False,
            )
        candidate = OnnxEncoder(model_dir, tmp, threads=1)
        want = encode(model, list(PROBES))
        got = np.concatenate([candidate.encode(list(PROBES)), candidate.encode([PROBES[1]])])
        cosines = np.concatenate([(got[: len(PROBES)] * want).sum(1), [float(got[-1] @ want[1])]])
        if float(cosines.min()) < MIN_PROBE_COSINE:
            raise RuntimeError(f"exported embedder disagrees with sentence-transformers: cosines {cosines.round(6)}")
        # mkstemp makes it 0600: readable by every user, as another user may run the gateway than
        # the one that exported (an image exports as root at build time).
        tmp.chmod(0o644)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("exported the embedding model to %s (probe cosine >= %.6f)", out_path, float(cosines.min()))
    return out_path


def quantize(model_dir: Path, fp32_path: Path, out_path: Path) -> Path:
    """The int8 graph of a float32 export, checked against it on the probes and renamed into place."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=out_path.name, suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        # NOTE: per-channel weights on MatMul only. Per-tensor weights lost too much (median
        # cosine to float32 0.951 on held-out prompts, router APGR -0.015); quantising the
        # embedding tables (Gather) saves no time, as they are lookups.
        quantize_dynamic(str(fp32_path), str(tmp), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul"])  # fmt: skip
        want = OnnxEncoder(model_dir, fp32_path, threads=1).encode(list(PROBES))
        got = OnnxEncoder(model_dir, tmp, threads=1).encode(list(PROBES))
        cosines = (got * want).sum(1)
        if float(cosines.min()) < MIN_INT8_PROBE_COSINE:
            raise RuntimeError(f"int8 embedder strays from float32: probe cosines {cosines.round(4)}")
        tmp.chmod(0o644)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("quantised the embedding model to int8 at %s (probe cosine >= %.4f)", out_path, float(cosines.min()))
    return out_path


def _tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=max_seq_length(model_dir))
    pad_id = tokenizer.token_to_id("[PAD]")
    tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token="[PAD]")
    return tokenizer


def _feed(tokenizer: Any, texts: list[str]) -> dict[str, np.ndarray]:
    encodings = tokenizer.encode_batch(texts)
    return {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
    }


def cpu_session(onnx_path: Path, threads: int | None = 1) -> Any:
    """An onnxruntime CPU session as the gateway runs its graphs: all graph optimisations, one
    inter-op thread, `threads` intra-op threads (None: onnxruntime's default), and no spinning
    (spinning worker threads steal the core the event loop needs; they sleep between ops)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.inter_op_num_threads = 1
    if threads is not None:
        options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])


class OnnxEncoder:
    """Sentence embeddings from an exported graph: L2-normalised float32 rows, one per text."""

    backend = "onnx"

    def __init__(self, model_dir: Path, onnx_path: Path, threads: int | None = 1, precision: str = "fp32") -> None:
        self._session = cpu_session(onnx_path, threads)
        self._tokenizer = _tokenizer(Path(model_dir))
        self.path = Path(onnx_path)
        self.precision = precision

    def encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, DIMENSION), dtype=np.float32)
        lengths = [len(t) for t in texts]
        order = sorted(range(len(texts)), key=lengths.__getitem__)
        out = np.empty((len(texts), DIMENSION), dtype=np.float32)
        for start in range(0, len(order), SUB_BATCH):
            rows = order[start : start + SUB_BATCH]
            (vectors,) = self._session.run(None, _feed(self._tokenizer, [texts[i] for i in rows]))
            out[rows] = vectors
        return out


def _load_or_make(model_dir: Path, path: Path, make: Any, threads: int | None, precision: str) -> OnnxEncoder:
    if path.exists():
        try:
            return OnnxEncoder(model_dir, path, threads=threads, precision=precision)
        except Exception as exc:  # noqa: BLE001 - a damaged file is replaced, not trusted
            log.warning("cached embedding graph %s does not load (%s); making it again", path, exc)
            path.unlink(missing_ok=True)
    make(path)
    return OnnxEncoder(model_dir, path, threads=threads, precision=precision)


def load_onnx_encoder(model_dir: Path, cache_dir: Path, threads: int | None = 1, precision: str = "fp32") -> OnnxEncoder:
    """The cached graph for these weights and this precision, exporting (and quantising) it first when there is none."""
    fp32 = _load_or_make(model_dir, onnx_path_for(model_dir, cache_dir), lambda p: export(model_dir, p), threads, "fp32")
    if precision == "fp32":
        return fp32
    return _load_or_make(model_dir, onnx_path_for(model_dir, cache_dir, precision),
                         lambda p: quantize(model_dir, fp32.path, p), threads, precision)  # fmt: skip
