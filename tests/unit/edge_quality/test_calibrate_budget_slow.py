"""Calibration under a time budget, and `tierlane edge calibrate` writing into the per-digest cache.

A budget of 0 s starts no probe: what the run uses is exactly what the probe cache already holds,
so the cut is the same on any machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from policies.edge_quality.artifact import MANIFEST_FILE
from policies.edge_quality.calibrate import CalibrationConfig, CalibrationTooShort, calibrate
from policies.edge_quality.model import EdgeCalibration

pytestmark = pytest.mark.slow  # the edge engine and the embedder load real models


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A probe cache holding the answers to the first 2 probes of each split."""
    cache = tmp_path_factory.mktemp("records") / "records.jsonl"
    calibrate(CalibrationConfig(out=None, limit=2, cache=cache))
    return cache


def test_a_run_cut_short_fits_on_what_was_answered_and_says_so(records: Path, tmp_path: Path) -> None:
    out = tmp_path / "cut"
    manifest = calibrate(CalibrationConfig(out=out, limit=4, cache=records, budget_s=0.0, min_probes=2))
    assert manifest["run"] == {"budget_s": 0.0, "cut_short": True, "probes_used": 4, "probes_planned": 8}
    assert manifest["probe_set"]["calibration"] == 2 and manifest["probe_set"]["held_out"] == 2
    stored = json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))
    assert stored["run"] == manifest["run"]
    assert EdgeCalibration.load(out).gguf_sha256 == manifest["gguf"]["sha256"]
    whole = calibrate(CalibrationConfig(out=None, limit=2, cache=records, budget_s=3600.0))
    assert whole["run"]["cut_short"] is False and whole["run"]["probes_used"] == 4


def test_too_few_answered_probes_write_no_artifact(records: Path, tmp_path: Path) -> None:
    out = tmp_path / "short"
    with pytest.raises(CalibrationTooShort, match=r"only 2 of 4 calibration probes .* at least 3 calibration probes"):
        calibrate(CalibrationConfig(out=out, limit=4, cache=records, budget_s=0.0, min_probes=3))
    assert not out.exists()


def test_the_cli_writes_into_the_digest_cache_by_default(records: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from edge_engine import bundled_model_path
    from policies.edge_quality.lookup import find_calibration, model_digest

    cache = tmp_path / "calibration"
    code = main(["edge", "calibrate", "--limit", "2", "--cache", str(records), "--calibration-cache", str(cache)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "edge probes" in err  # the progress bar
    digest = model_digest(bundled_model_path())
    report = json.loads(out)
    assert report["model_sha256"] == digest and report["out"] == str(cache / digest)
    assert sorted(p.name for p in cache.iterdir()) == [digest]  # no staging directory left behind
    found = find_calibration(bundled_model_path(), named=tmp_path / "nowhere", cache_dir=cache)
    assert found.source == "cache" and found.directory == cache / digest
    # a budget that leaves too few probes: a clear message, exit status 3, the cache entry untouched
    before = (cache / digest / MANIFEST_FILE).read_bytes()
    code = main(["edge", "calibrate", "--limit", "4", "--cache", str(records), "--calibration-cache", str(cache),
                 "--budget-s", "0"])
    err = capsys.readouterr().err
    assert code == 3 and "nothing was written" in err and "--budget-s" in err
    assert (cache / digest / MANIFEST_FILE).read_bytes() == before
    assert sorted(p.name for p in cache.iterdir()) == [digest]
