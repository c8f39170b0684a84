"""Learned adapters for tests: a real GGUF LoRA over the bundled edge model and its manifest, as `tierlane edge learn`
writes them, without training (small random or zero weights on the attention's q and v projections)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

import numpy as np

from policies.artifact_dir import sha256_file
from policies.learn.base_model import BaseShape
from policies.trim.tokenizer import bundled_edge_model

SMOLLM2 = BaseShape(architecture="llama", n_layers=30, n_head=9, n_head_kv=3)
_HIDDEN, _KV = 576, 192


def write_learned(directory: Path, *, tenant: str, app: str, template: str, version: str,
                  labels: Sequence[str] | None = None, confidences: Sequence[tuple[float, bool]] = ((0.0, True),),
                  scale: float = 0.0, seed: int = 0, created_at: str | None = None,
                  base_sha256: str | None = None) -> Path:  # fmt: skip
    """Write `<dir>/<tenant>/<app>/<template>/<sha>.gguf` and its manifest; the manifest's path.

    `scale` 0 writes an adapter whose product is zero: the base model's answers exactly.
    `confidences` are the held-out answers' (confidence, agrees) the threshold is chosen from.
    """
    from policies.learn.adapter import write_adapter

    rng = np.random.default_rng(seed)
    weights = {
        f"model.layers.{i}.self_attn.{m}": (rng.normal(scale=0.05, size=(2, _HIDDEN)).astype(np.float32),
                                           (rng.normal(size=(out, 2)) * scale).astype(np.float32))
        for i in range(SMOLLM2.n_layers) for m, out in (("q_proj", _HIDDEN), ("v_proj", _KV))
    }  # fmt: skip
    folder = directory / quote(tenant, safe="") / quote(app, safe="") / template
    base = bundled_edge_model()
    path, sha = write_adapter(weights, SMOLLM2, 4.0, folder, name=f"{template} (test)")
    manifest = {
        "format": 1, "artifact": path.name, "sha256": sha, "bytes": path.stat().st_size,
        "created_at": created_at or datetime.now(UTC).isoformat(timespec="seconds"),
        "tenant": tenant, "app": app, "template": template, "template_version": version,
        "base_model": {"path": str(base), "sha256": base_sha256 or sha256_file(base), "architecture": "llama"},
        "pairs": {"train": 8, "held_out": len(confidences), "held_out_evaluated": len(confidences), "left_out_too_long": 0},
        "training": {"method": "lora", "seconds": 0.0},
        "evaluation": {"kind": "labels" if labels else "exact_match", "agreement": 1.0},
        "confidence": {"kind": "label_probability" if labels else "mean_token_logprob", "labels": list(labels) if labels else None,
                       "answer_tokens_max": 12,
                       "held_out": [{"pair_id": f"p{i}", "confidence": c, "agrees": a} for i, (c, a) in enumerate(confidences)]},
    }  # fmt: skip
    target = folder / f"{sha}.json"
    target.write_text(json.dumps(manifest), encoding="utf-8")
    return target
