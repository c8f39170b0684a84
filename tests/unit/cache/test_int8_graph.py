"""quantize_graph: MatMuls by a constant weight become int8 arithmetic, per token and per column."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from policies.embedding.onnx_encoder import quantize_graph


def _graph(path: Path, w: np.ndarray) -> None:
    """y = (x @ W) @ z: one MatMul by a weight, one by another input."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", w.shape[0]])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [w.shape[1], 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "t", 2])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("MatMul", ["h", "z"], ["y"])]
    graph = helper.make_graph(nodes, "g", [x, z], [y], initializer=[numpy_helper.from_array(w, "W")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    w_scale = np.abs(w).max(axis=0) / 127.0
    wq = np.clip(np.round(w / w_scale), -127, 127)
    x_scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True), 1e-12) / 127.0
    xq = np.clip(np.round(x * (1.0 / x_scale)), -127, 127)
    return (xq @ wq) * x_scale * w_scale


def test_matches_the_per_token_per_column_reference_and_leaves_other_matmuls(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    _graph(tmp_path / "f.onnx", w)
    assert quantize_graph(tmp_path / "f.onnx", tmp_path / "q.onnx") == 1
    ops = [n.op_type for n in onnx.load(str(tmp_path / "q.onnx")).graph.node]
    assert ops.count("MatMulInteger") == 1 and ops.count("MatMul") == 1  # the product with `z` stays float
    # rows of very different magnitude: each keeps its own scale
    x = (rng.standard_normal((2, 3, 16)) * np.array([1e-3, 1.0, 50.0])[None, :, None]).astype(np.float32)
    z = rng.standard_normal((8, 2)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"x": x, "z": z})
    want = _reference(x.astype(np.float64), w.astype(np.float64)) @ z
    assert np.allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
    exact = x @ w @ z
    assert np.abs(got - exact).max() < 0.05 * np.abs(exact).max()
    # a row quantised alone equals the same row in a batch
    (alone,) = session.run(None, {"x": x[:1, :1], "z": z})
    assert np.allclose(alone[0, 0], got[0, 0], rtol=1e-6, atol=1e-9)
