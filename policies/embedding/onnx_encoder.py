"""all-MiniLM-L6-v2 on onnxruntime: the sentence-transformers vectors at about a third of the CPU time.

The ONNX graph is exported once from the bundled weights (no download) with torch's exporter,
checked against sentence-transformers on probe texts, and kept in a cache directory under a key
made of the weights' digest and the export recipe. Later starts load it without importing torch.
Measured on one core: 3.7 ms per 15-token sentence against 12.3 ms for torch eager (MKL packs
the weights again on every small matmul; onnxruntime's MLAS packs them once at load).

`int8` precision: the same graph with every MatMul by a weight done in int8 (`quantize_graph`:
weights per output column, activations per token; embeddings, layer norms, attention and
softmax stay float32). About half the CPU of float32 on a machine with VNNI
(bench/embedding_precision.py); its vectors differ from float32's by a cosine of ~0.003, and
what reads them was checked on held-out data against the float32 figures (the same bench).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from policies.embedding.sentence_model import DIMENSION

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
# An int8 graph must stay this close to the float32 one on every probe (cosine; measured 0.993 at
# worst over 300 STS-B sentences, 0.997 median).
MIN_INT8_PROBE_COSINE = 0.98
# Bump when the quantisation recipe changes.
INT8_RECIPE = "int8-per-token-activations-per-column-weights-v1"
# Texts of similar length are encoded together: padding a 5-token text to 200 wastes the work.
SUB_BATCH = 16


# Where a model directory without its weights names the digest of the weights its graphs were made
# from (the image's: graphs made at build time, weights left out, `strip_weights`).
WEIGHTS_DIGEST_FILE = "tierlane-weights-digest"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _model_digest(model_dir: Path) -> str:
    recorded = model_dir / WEIGHTS_DIGEST_FILE
    if not (model_dir / "model.safetensors").exists() and recorded.exists():
        return recorded.read_text().strip()
    digest = hashlib.sha256(f"tierlane-onnx-export-v{EXPORT_VERSION}-opset{OPSET}".encode())
    for name in ("config.json", "sentence_bert_config.json", "tokenizer.json", "model.safetensors"):
        path = model_dir / name
        digest.update(name.encode() + b"\0")
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def strip_weights(model_dir: Path) -> str:
    """Record the weights' digest in `model_dir` and delete the weights: what is left (configuration,
    tokenizer) serves the graphs already made from them, and nothing can export again."""
    digest = _model_digest(model_dir)
    (model_dir / WEIGHTS_DIGEST_FILE).write_text(digest + "\n")
    for name in WEIGHT_FILES:
        (model_dir / name).unlink(missing_ok=True)
    return digest


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
    raise ValueError(f"unknown embedding precision {precision!r}: expected fp32 or int8")


@contextlib.contextmanager
def _replacing(out_path: Path) -> Iterator[Path]:
    """A temporary file beside `out_path`, renamed into place when the block ends without an error
    (and removed when it raises), so a crash, a failed check or a concurrent writer never leaves
    a half-written or wrong graph where a gateway would load it."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=out_path.name, suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        # mkstemp makes it 0600: readable by every user, as another user may run the gateway than
        # the one that exported (an image exports as root at build time).
        tmp.chmod(0o644)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)


def export(model_dir: Path, out_path: Path) -> Path:
    """Export the sentence-transformers model (transformer, mean pooling, L2 norm) to ONNX and check it.

    Written to a temporary file beside `out_path` and renamed into place only after the probes
    match, so a crash or a concurrent export never leaves a half-written or wrong model behind.
    Needs the train extra (torch, sentence-transformers, onnx).
    """
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sentence_transformers") is None:
        raise RuntimeError(f"no embedding graph at {out_path}, and making one needs torch and sentence-transformers "
                           "(pip install 'tierlane[train]'), or a graph made elsewhere in embedder.cache_dir")
    if not (model_dir / "model.safetensors").exists():
        raise RuntimeError(f"no embedding graph at {out_path}, and the weights to make it from are not in {model_dir}")
    import torch

    from policies.embedding.sentence_model import encode, load_sentence_model

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
    with _replacing(out_path) as tmp:
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
    log.info("exported the embedding model to %s (probe cosine >= %.6f)", out_path, float(cosines.min()))
    return out_path


def quantize_graph(fp32_path: Path, out_path: Path) -> int:
    """Rewrite every MatMul by a constant weight into int8 arithmetic; returns how many were rewritten.

    Weights: symmetric int8 per output column. Activations: symmetric int8 per token (each row's
    own scale, max |x| / 127, taken when it runs), carried as uint8 around a zero point of 128 so
    that onnxruntime's u8 x s8 kernels (VNNI) do the product; the int32 result is scaled back
    by the row's and the column's scales. Per-token scales make a text's vector independent of
    the texts batched beside it, which onnxruntime's dynamic quantisation (one scale per batch
    tensor) does not: there a vector moved by a cosine of up to 0.02 with its batch.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(fp32_path))
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    added = [numpy_helper.from_array(np.asarray(v, dtype=dt), name) for name, v, dt in (
        ("q8_127", 127.0, np.float32), ("q8_eps", 1e-12, np.float32), ("q8_lo", -127.0, np.float32),
        ("q8_hi", 127.0, np.float32), ("q8_128", 128.0, np.float32), ("q8_zp", 128, np.uint8))]  # fmt: skip
    nodes, rewritten = [], 0
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is None or len(weight.dims) != 2:
            nodes.append(node)
            continue
        w = numpy_helper.to_array(weight).astype(np.float32)
        w_scale = (np.maximum(np.abs(w).max(axis=0), 1e-12) / 127.0).astype(np.float32)
        p = f"q8_{rewritten}_"
        rewritten += 1
        added += [numpy_helper.from_array(np.clip(np.round(w / w_scale), -127, 127).astype(np.int8), p + "w"),
                  numpy_helper.from_array(w_scale, p + "ws")]  # fmt: skip
        x, y = node.input[0], node.output[0]
        nodes += [
            helper.make_node("Abs", [x], [p + "abs"]),
            helper.make_node("ReduceMax", [p + "abs"], [p + "max"], axes=[-1], keepdims=1),
            helper.make_node("Max", [p + "max", "q8_eps"], [p + "range"]),
            helper.make_node("Div", [p + "range", "q8_127"], [p + "xs"]),  # the row's scale
            helper.make_node("Div", ["q8_127", p + "range"], [p + "inv"]),
            helper.make_node("Mul", [x, p + "inv"], [p + "scaled"]),
            helper.make_node("Round", [p + "scaled"], [p + "rounded"]),
            helper.make_node("Clip", [p + "rounded", "q8_lo", "q8_hi"], [p + "clipped"]),
            helper.make_node("Add", [p + "clipped", "q8_128"], [p + "shifted"]),
            helper.make_node("Cast", [p + "shifted"], [p + "xq"], to=TensorProto.UINT8),
            helper.make_node("MatMulInteger", [p + "xq", p + "w", "q8_zp"], [p + "acc"]),
            helper.make_node("Cast", [p + "acc"], [p + "accf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [p + "accf", p + "xs"], [p + "rows"]),
            helper.make_node("Mul", [p + "rows", p + "ws"], [y]),
        ]
    used = {name for n in nodes for name in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + added)
    onnx.save(model, str(out_path))
    return rewritten


def quantize(model_dir: Path, fp32_path: Path, out_path: Path) -> Path:
    """The int8 graph of a float32 export, checked against it on the probes and renamed into place."""
    with _replacing(out_path) as tmp:
        if quantize_graph(fp32_path, tmp) == 0:
            raise RuntimeError("no MatMul by a constant weight in the embedding graph: nothing to quantise")
        want = OnnxEncoder(model_dir, fp32_path, threads=1).encode(list(PROBES))
        got = OnnxEncoder(model_dir, tmp, threads=1).encode(list(PROBES))
        cosines = (got * want).sum(1)
        if float(cosines.min()) < MIN_INT8_PROBE_COSINE:
            raise RuntimeError(f"int8 embedder strays from float32: probe cosines {cosines.round(4)}")
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


def _load(model_dir: Path, path: Path, threads: int | None, precision: str) -> OnnxEncoder | None:
    """The graph cached at `path`, or None when there is none or it does not load (then it is removed)."""
    if not path.exists():
        return None
    try:
        return OnnxEncoder(model_dir, path, threads=threads, precision=precision)
    except Exception as exc:  # noqa: BLE001 - a damaged file is replaced, not trusted
        log.warning("cached embedding graph %s does not load (%s); making it again", path, exc)
        path.unlink(missing_ok=True)
        return None


def load_onnx_encoder(model_dir: Path, cache_dir: Path, threads: int | None = 1, precision: str = "fp32") -> OnnxEncoder:
    """The cached graph for these weights and this precision, exporting (and quantising) it first when there is none."""
    path = onnx_path_for(model_dir, cache_dir, precision)
    if (cached := _load(model_dir, path, threads, precision)) is not None:
        return cached  # NOTE: an int8 start opens no float32 session
    fp32_path = onnx_path_for(model_dir, cache_dir)
    if precision == "fp32" or _load(model_dir, fp32_path, 1, "fp32") is None:
        export(model_dir, fp32_path)
    if precision != "fp32":
        quantize(model_dir, fp32_path, path)
    return OnnxEncoder(model_dir, path, threads=threads, precision=precision)
