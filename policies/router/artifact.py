"""Reading and writing a router artifact: `router.joblib` beside a `manifest.json` that vouches for it."""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import sklearn

from policies.router.data import EMBEDDING_MODEL_NAME, RUNTIME_MAX_SEQ_LENGTH
from policies.router.features import FEATURE_NAMES, FEATURE_VERSION

ARTIFACT_FORMAT = 1
MODEL_FILE = "router.joblib"
MANIFEST_FILE = "manifest.json"


class RouterArtifactError(RuntimeError):
    """The router artifact is missing, damaged, or built for other code or libraries."""


@dataclass(slots=True)
class Artifact:
    """A loaded artifact: the fitted parameters and the manifest that describes them."""

    params: dict[str, Any]
    manifest: dict[str, Any]
    directory: Path


def default_artifact_dir() -> Path:
    """The artifact shipped inside the package."""
    return Path(str(resources.files("policies.router") / "artifacts"))


def library_versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scikit-learn": sklearn.__version__,
        "joblib": joblib.__version__,
    }


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_artifact(directory: str | Path, params: dict[str, Any], manifest: dict[str, Any]) -> Path:
    """Write both files; the manifest records the model file's hash, formats and versions."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model_path = out / MODEL_FILE
    joblib.dump(params, model_path, compress=3)
    full = {
        "format": ARTIFACT_FORMAT,
        "feature_version": FEATURE_VERSION,
        "feature_names": list(FEATURE_NAMES),
        "libraries": library_versions(),
        **manifest,
        "model_file": MODEL_FILE,
        "model_sha256": _sha256(model_path),
    }
    (out / MANIFEST_FILE).write_text(json.dumps(full, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return out


def check_manifest(manifest: dict[str, Any]) -> None:
    """Raise RouterArtifactError when this code or these libraries cannot use the artifact."""
    rebuild = "rebuild it with `make router-model` (or `tierlane router train --out DIR`)"
    if manifest.get("format") != ARTIFACT_FORMAT:
        raise RouterArtifactError(
            f"router artifact format {manifest.get('format')!r} is not the supported {ARTIFACT_FORMAT}; {rebuild}"
        )
    if manifest.get("feature_version") != FEATURE_VERSION:
        raise RouterArtifactError(
            f"router artifact was trained on text features v{manifest.get('feature_version')!r} but this code "
            f"computes v{FEATURE_VERSION}; {rebuild}"
        )
    if list(manifest.get("feature_names") or []) != list(FEATURE_NAMES):
        raise RouterArtifactError(f"router artifact lists other text features than this code; {rebuild}")
    embedding = manifest.get("embedding") or {}
    if embedding.get("model") != EMBEDDING_MODEL_NAME:
        raise RouterArtifactError(
            f"router artifact was trained on {embedding.get('model')!r} embeddings, the gateway computes "
            f"{EMBEDDING_MODEL_NAME!r}; {rebuild}"
        )
    if embedding.get("train_max_seq_length", RUNTIME_MAX_SEQ_LENGTH) != RUNTIME_MAX_SEQ_LENGTH:
        raise RouterArtifactError(
            f"router artifact was trained on embeddings of {embedding.get('train_max_seq_length')} word pieces, "
            f"the gateway embeds {RUNTIME_MAX_SEQ_LENGTH}; {rebuild}"
        )
    built = str((manifest.get("libraries") or {}).get("scikit-learn", "unknown"))
    if _minor(built) != _minor(sklearn.__version__):
        raise RouterArtifactError(
            f"router artifact was built with scikit-learn {built} but {sklearn.__version__} is installed; "
            f"install scikit-learn=={built} or {rebuild}"
        )


def load_artifact(path: str | Path | None = None) -> Artifact:
    """Load and verify an artifact directory (or its manifest.json); None means the shipped default."""
    directory = default_artifact_dir() if path is None else Path(path)
    if directory.is_file():
        directory = directory.parent
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise RouterArtifactError(f"no router manifest at {manifest_path}; train one with `tierlane router train`")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RouterArtifactError(f"cannot read router manifest {manifest_path}: {exc}") from exc
    if not isinstance(manifest, dict):
        raise RouterArtifactError(f"router manifest {manifest_path} is not a JSON object")
    check_manifest(manifest)
    model_path = directory / str(manifest.get("model_file", MODEL_FILE))
    if not model_path.is_file():
        raise RouterArtifactError(f"router model file {model_path} is missing")
    if manifest.get("model_sha256") != _sha256(model_path):
        raise RouterArtifactError(f"router model file {model_path} does not match its manifest's hash")
    try:
        params = joblib.load(model_path)
    except Exception as exc:  # unpickling can fail in many ways; all mean "unusable"
        raise RouterArtifactError(f"cannot load router model {model_path}: {exc}") from exc
    return Artifact(params=params, manifest=manifest, directory=directory)
