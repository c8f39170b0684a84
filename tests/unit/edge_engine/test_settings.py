"""Edge settings: how the attention kernel and the KV cell type are resolved and checked (no model)."""

from __future__ import annotations

import pytest

from edge_engine import EdgeSettings


def test_flash_attention_defaults_to_a_q8_0_cache_and_plain_attention_to_f16() -> None:
    assert EdgeSettings().kv_cache_type == "q8_0"
    assert EdgeSettings(flash_attn=False).kv_cache_type == "f16"


def test_a_quantized_cache_needs_flash_attention() -> None:
    with pytest.raises(ValueError, match="needs flash_attn"):
        EdgeSettings(flash_attn=False, kv_cache_type="q8_0")


def test_batch_invariance_refuses_flash_attention_over_an_f16_cache_on_cpu() -> None:
    with pytest.raises(ValueError, match="quantized kv_cache_type"):
        EdgeSettings(kv_cache_type="f16")
    # allowed where exactness is not asked for, or on a GPU build
    assert EdgeSettings(kv_cache_type="f16", batch_invariant=False).flash_attn
    assert EdgeSettings(kv_cache_type="f16", n_gpu_layers=99).kv_cache_type == "f16"


def test_unknown_cache_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="kv_cache_type must be one of"):
        EdgeSettings(kv_cache_type="q5_1")
