"""The calibration artifact on disk: `edge_quality.npz` (weights) beside a `manifest.json` that vouches for it.

The npz is written with fixed zip timestamps, so the same fit gives the same bytes (and hash).
No pickle: loading reads plain arrays.
"""

from __future__ import annotations

import io
import json
import platform
import zipfile
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from policies.artifact_dir import MANIFEST_FILE, read_artifact_dir, sha256_file
from policies.edge_quality.features import ANSWER_FEATURES, FEATURE_VERSION, PROMPT_FEATURES

ARTIFACT_FORMAT = 1
MODEL_FILE = "edge_quality.npz"
REBUILD = "rebuild it with `make edge-calibration` (or `tierlane edge calibrate --out DIR`)"


class EdgeCalibrationError(RuntimeError):
    """The calibration artifact is missing, damaged, or made for other code."""


def default_artifact_dir() -> Path:
    """The artifact shipped inside the package."""
    return Path(str(resources.files("policies.edge_quality") / "artifacts"))


def library_versions() -> dict[str, str]:
    import llama_cpp
    import sklearn

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scikit-learn": sklearn.__version__,
        "llama-cpp-python": str(llama_cpp.__version__),
    }


def _write_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def save_artifact(directory: str | Path, params: Mapping[str, np.ndarray], manifest: Mapping[str, Any]) -> Path:
    """Write both files; the manifest records the weights file's hash and the feature layout."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model_path = out / MODEL_FILE
    _write_npz(model_path, params)
    full = {
        "format": ARTIFACT_FORMAT,
        "feature_version": FEATURE_VERSION,
        "prompt_features": list(PROMPT_FEATURES),
        "answer_features": list(ANSWER_FEATURES),
        **manifest,
        "model_file": MODEL_FILE,
        "model_sha256": sha256_file(model_path),
    }
    (out / MANIFEST_FILE).write_text(json.dumps(full, indent=1) + "\n", encoding="utf-8")
    return out


def check_manifest(manifest: Mapping[str, Any]) -> None:
    if manifest.get("format") != ARTIFACT_FORMAT:
        raise EdgeCalibrationError(f"edge calibration format {manifest.get('format')!r} is not {ARTIFACT_FORMAT}; {REBUILD}")
    if manifest.get("feature_version") != FEATURE_VERSION:
        raise EdgeCalibrationError(
            f"edge calibration uses features v{manifest.get('feature_version')!r}, this code computes v{FEATURE_VERSION}; {REBUILD}"
        )
    if list(manifest.get("prompt_features") or []) != list(PROMPT_FEATURES) or list(
        manifest.get("answer_features") or []
    ) != list(ANSWER_FEATURES):
        raise EdgeCalibrationError(f"edge calibration lists other features than this code; {REBUILD}")


def load_artifact(path: str | Path | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any], Path]:
    """Weights, manifest and directory of an artifact (None: the shipped one); verified against the hash."""
    manifest, directory, model_path = read_artifact_dir(
        default_artifact_dir() if path is None else path, what="edge calibration", default_model_file=MODEL_FILE,
        error=EdgeCalibrationError, rebuild=REBUILD, check=check_manifest,
    )
    try:
        with np.load(model_path, allow_pickle=False) as npz:
            params = {name: np.asarray(npz[name]) for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise EdgeCalibrationError(f"cannot read {model_path}: {exc}") from exc
    return params, manifest, directory
