"""Calibration end to end on a tiny probe subset, with the real engine and embedder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policies.edge_quality.artifact import MANIFEST_FILE
from policies.edge_quality.calibrate import CalibrationConfig, calibrate
from policies.edge_quality.model import EdgeCalibration

pytestmark = pytest.mark.slow


def test_calibrate_tiny_subset_writes_a_loadable_artifact(tmp_path: Path) -> None:
    from edge_engine import bundled_model_path

    calls: list[int] = []
    out = tmp_path / "artifact"
    manifest = calibrate(CalibrationConfig(out=out, limit=7, cache=tmp_path / "records.jsonl"), progress=calls.append)
    assert sum(calls) == 14
    assert manifest["probe_set"]["calibration"] == 7 and manifest["probe_set"]["held_out"] == 7
    assert manifest["gguf"]["file"] == bundled_model_path().name
    stored = json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))
    assert stored["metrics"]["held_out"]["items"] == 7
    cal = EdgeCalibration.load(out)
    assert cal.matches(bundled_model_path())
    for stage in ("prior", "confidence"):
        assert cal.threshold(stage, "max_escalation_share", 0.0) == 0.0  # escalate nothing: keep all
    # a rerun reads every answer from the cache and fits the same model
    calls.clear()
    calibrate(CalibrationConfig(out=tmp_path / "again", limit=7, cache=tmp_path / "records.jsonl"), progress=calls.append)
    assert sum(calls) == 14
    assert (tmp_path / "again" / "edge_quality.npz").read_bytes() == (out / "edge_quality.npz").read_bytes()
