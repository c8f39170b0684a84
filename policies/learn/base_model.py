"""The edge model's GGUF as a torch model to train on (llama architecture), read with the `gguf` package.

Needs the `learn` extra (torch, transformers, gguf); imported by the trainer only, never by the gateway.

Why not `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`: it gives the same weights, but
parses the file twice and rebuilds gguf's tensor-name map once per tensor: 17-22 s for the bundled
135M model on two cores, against about 4 s here (one parse, dequantised with gguf's own numpy code).

llama.cpp's converter stores attn_q and attn_k with their rows permuted (interleaved rotary pairs,
`permute` below); the torch model wants Hugging Face's order (rotary halves), so those two are
un-permuted on load, and an adapter's lora_b for them is permuted back when it is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM

# Hugging Face module name -> GGUF tensor name, per block
BLOCK_TENSORS: dict[str, str] = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GLOBAL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


class BaseModelError(RuntimeError):
    """The GGUF cannot be trained on here (another architecture, a missing tensor)."""


@dataclass(frozen=True, slots=True)
class BaseShape:
    """What the adapter writer needs to know of the base: its architecture and attention heads."""

    architecture: str
    n_layers: int
    n_head: int
    n_head_kv: int


def permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's row order of a q/k projection (or its lora_b) -> llama.cpp's (as convert_hf_to_gguf.py)."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order of attn_q/attn_k -> Hugging Face's (the inverse of `permute`)."""
    return rows.reshape(n_head, rows.shape[0] // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise BaseModelError(f"the GGUF has no {key} in its metadata")
        return default
    return field.contents()


def load_base(path: Path) -> tuple[LlamaForCausalLM, BaseShape]:
    """The GGUF's weights, dequantised to float32, in a transformers Llama model (train mode off)."""
    import gguf
    import torch
    from gguf.quants import dequantize
    from transformers import LlamaConfig, LlamaForCausalLM

    reader = gguf.GGUFReader(path)
    arch = str(_field(reader, "general.architecture"))
    if arch != "llama":
        raise BaseModelError(f"{path.name}: architecture {arch!r}; learning supports llama-architecture models only")
    n_head, n_head_kv = int(_field(reader, "llama.attention.head_count")), int(_field(reader, "llama.attention.head_count_kv"))
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors["token_embd.weight"]
    n_layers = int(_field(reader, "llama.block_count"))
    config = LlamaConfig(
        vocab_size=int(embd.shape[1]),
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=n_layers,
        num_attention_heads=n_head,
        num_key_value_heads=n_head_kv,
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0))},
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        attention_bias=False,
        mlp_bias=False,
    )
    names = {f"{hf}.weight": f"{g}.weight" for hf, g in _GLOBAL_TENSORS.items()}
    for i in range(n_layers):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in BLOCK_TENSORS.items()})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for hf_name, gguf_name in names.items():
        tensor = tensors.get(gguf_name)
        if tensor is None:
            if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            raise BaseModelError(f"{path.name}: no tensor {gguf_name}")
        data = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        data = data.reshape([int(d) for d in reversed(tensor.shape)])
        if gguf_name.endswith("attn_q.weight"):
            data = unpermute(data, n_head)
        elif gguf_name.endswith("attn_k.weight"):
            data = unpermute(data, n_head_kv)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(data))
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    # the rotary inverse frequencies are a buffer computed at construction: rebuild them off the meta device
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise BaseModelError(f"{path.name}: weights missing after loading: {missing[:3]}")
    model.train(False)
    return model, BaseShape(architecture=arch, n_layers=n_layers, n_head=n_head, n_head_kv=n_head_kv)
