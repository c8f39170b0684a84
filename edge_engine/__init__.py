"""Embedded llama.cpp engine with continuous batching: the gateway's local edge lane."""

from edge_engine.engine import EdgeEngine, Generation
from edge_engine.events import GenerationEvent
from edge_engine.sampling import Priority, SamplingParams
from edge_engine.settings import EdgeSettings, bundled_model_path

__all__ = [
    "EdgeEngine",
    "EdgeSettings",
    "Generation",
    "GenerationEvent",
    "Priority",
    "SamplingParams",
    "bundled_model_path",
]
