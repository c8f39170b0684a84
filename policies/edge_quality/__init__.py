"""What the edge lane answers correctly: a checkable probe set, its calibration, and the learned decisions.

`EdgeCalibration.load()` reads the shipped artifact; `prior()` scores a prompt before generation
(router), `confidence()` an answer after it (cascade), `threshold()` turns a policy target into a
score threshold. See MODEL_CARD.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies.edge_quality.artifact import EdgeCalibrationError
    from policies.edge_quality.model import Curve, DefaultThresholds, EdgeCalibration, load_for_model

# NOTE: resolved on first use, so importing the package loads neither numpy code paths nor sklearn.
_EXPORTS = {
    "EdgeCalibration": "policies.edge_quality.model",
    "Curve": "policies.edge_quality.model",
    "DefaultThresholds": "policies.edge_quality.model",
    "load_for_model": "policies.edge_quality.model",
    "EdgeCalibrationError": "policies.edge_quality.artifact",
}

__all__ = ["Curve", "DefaultThresholds", "EdgeCalibration", "EdgeCalibrationError", "load_for_model"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'policies.edge_quality' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
