"""Embedded llama.cpp engine with continuous batching: the gateway's local edge lane."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge_engine.engine import EdgeEngine, Generation
    from edge_engine.events import GenerationEvent, TokenInfo
    from edge_engine.sampling import Priority, SamplingParams
    from edge_engine.settings import EdgeSettings, bundled_model_path

# NOTE: resolved on first use, so reading edge settings (the gateway's config check) does not
# load llama.cpp.
_EXPORTS = {
    "EdgeEngine": "edge_engine.engine",
    "Generation": "edge_engine.engine",
    "GenerationEvent": "edge_engine.events",
    "TokenInfo": "edge_engine.events",
    "Priority": "edge_engine.sampling",
    "SamplingParams": "edge_engine.sampling",
    "EdgeSettings": "edge_engine.settings",
    "bundled_model_path": "edge_engine.settings",
}

__all__ = [
    "EdgeEngine",
    "EdgeSettings",
    "Generation",
    "GenerationEvent",
    "Priority",
    "SamplingParams",
    "TokenInfo",
    "bundled_model_path",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'edge_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
