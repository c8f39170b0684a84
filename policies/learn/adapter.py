"""A trained adapter as llama.cpp loads it: a GGUF LoRA file (`llama_adapter_lora_init`, `Llama(lora_path=...)`).

Laid out as llama.cpp's convert_lora_to_gguf.py writes one: general.type `adapter`, adapter.type
`lora`, adapter.lora.alpha, general.architecture the base's; per adapted weight `blk.{i}.attn_q.weight`
two tensors, `.lora_a` of numpy shape [rank, in] and `.lora_b` of [out, rank] (ggml's ne is the
reverse: a is ne [in, rank], b ne [rank, out], as llama.cpp checks against the base weight's
ne [in, out]); float32. The q and k matrices' lora_b rows are permuted as the converter permutes
those base weights (base_model.permute); lora_a is not (it reads the input, whose order is the same).
llama.cpp scales the product by alpha / rank, as peft does.

The file is named by its sha256, written beside under a temporary name first, so a reader never
sees half a file and the same adapter is never written twice.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import numpy as np

from policies.learn.base_model import BLOCK_TENSORS, BaseShape, permute

_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.\w+|mlp\.\w+)$")


def tensor_names(module: str) -> str:
    """`model.layers.3.self_attn.q_proj` -> `blk.3.attn_q.weight`."""
    m = _MODULE.match(module)
    if m is None or m.group(2) not in BLOCK_TENSORS:
        raise ValueError(f"no llama.cpp tensor for the module {module!r}")
    return f"blk.{m.group(1)}.{BLOCK_TENSORS[m.group(2)]}.weight"


def gguf_tensors(weights: dict[str, tuple[np.ndarray, np.ndarray]], base: BaseShape) -> list[tuple[str, np.ndarray]]:
    """The adapter's tensors by llama.cpp name and layout, in a fixed order."""
    out: list[tuple[str, np.ndarray]] = []
    for module in sorted(weights, key=lambda m: (int(m.split(".")[2]), m)):
        a, b = weights[module]
        name = tensor_names(module)
        if name.endswith("attn_q.weight"):
            b = permute(b, base.n_head)
        elif name.endswith("attn_k.weight"):
            b = permute(b, base.n_head_kv)
        out.append((f"{name}.lora_a", np.ascontiguousarray(a, dtype=np.float32)))
        out.append((f"{name}.lora_b", np.ascontiguousarray(b, dtype=np.float32)))
    return out


def write_adapter(weights: dict[str, tuple[np.ndarray, np.ndarray]], base: BaseShape, alpha: float, directory: Path,
                  *, name: str) -> tuple[Path, str]:  # fmt: skip
    """Write the GGUF adapter into `directory` as `<sha256>.gguf`; its path and sha256."""
    import gguf

    directory.mkdir(parents=True, exist_ok=True)
    part = directory / f".{os.getpid()}.gguf.part"
    writer = gguf.GGUFWriter(str(part), arch=base.architecture)
    try:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        writer.add_name(name)
        for tensor_name, data in gguf_tensors(weights, base):
            writer.add_tensor(tensor_name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    digest = hashlib.sha256()
    with part.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    sha = digest.hexdigest()
    path = directory / f"{sha}.gguf"
    os.replace(part, path)
    return path, sha
