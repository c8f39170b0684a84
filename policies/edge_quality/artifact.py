"""The calibration artifact on disk: `edge_quality.npz` (weights) beside a `manifest.json` that vouches for it.

The npz is written with fixed zip timestamps, so the same fit gives the same bytes (and hash).
No pickle: loading reads plain arrays.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import zipfile
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from policies.edge_quality.features import ANSWER_FEATURES, FEATURE_VERSION, PROMPT_FEATURES

ARTIFACT_FORMAT = 1
MODEL_FILE = "edge_quality.npz"
MANIFEST_FILE = "manifest.json"
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


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


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
    directory = default_artifact_dir() if path is None else Path(path)
    if directory.is_file():
        directory = directory.parent
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise EdgeCalibrationError(f"no edge calibration manifest at {manifest_path}; {REBUILD}")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EdgeCalibrationError(f"cannot read {manifest_path}: {exc}") from exc
    if not isinstance(manifest, dict):
        raise EdgeCalibrationError(f"{manifest_path} is not a JSON object")
    check_manifest(manifest)
    model_path = directory / str(manifest.get("model_file", MODEL_FILE))
    if not model_path.is_file():
        raise EdgeCalibrationError(f"edge calibration weights {model_path} are missing")
    if manifest.get("model_sha256") != sha256_file(model_path):
        raise EdgeCalibrationError(f"edge calibration weights {model_path} do not match the manifest's hash")
    try:
        with np.load(model_path, allow_pickle=False) as npz:
            params = {name: np.asarray(npz[name]) for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise EdgeCalibrationError(f"cannot read {model_path}: {exc}") from exc
    return params, manifest, directory
