"""Reading and writing a router artifact: `router.joblib` beside a `manifest.json` that vouches for it."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import sklearn

from policies.artifact_dir import MANIFEST_FILE, read_artifact_dir, sha256_file
from policies.router.data import EMBEDDING_MODEL_NAME, RUNTIME_MAX_SEQ_LENGTH
from policies.router.features import FEATURE_NAMES, FEATURE_VERSION

ARTIFACT_FORMAT = 1
MODEL_FILE = "router.joblib"


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
        "model_sha256": sha256_file(model_path),
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
    manifest, directory, model_path = read_artifact_dir(
        default_artifact_dir() if path is None else path, what="router", default_model_file=MODEL_FILE,
        error=RouterArtifactError, rebuild="train one with `tierlane router train`", check=check_manifest,
    )
    try:
        params = joblib.load(model_path)
    except Exception as exc:  # unpickling can fail in many ways; all mean "unusable"
        raise RouterArtifactError(f"cannot load router model {model_path}: {exc}") from exc
    return Artifact(params=params, manifest=manifest, directory=directory)
