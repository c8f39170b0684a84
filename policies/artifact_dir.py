"""Reading a model artifact directory: a manifest.json beside a model file whose hash it records.

Shared by the learned components that ship such a directory (the router, the edge calibration):
each checks its own manifest fields; this module finds the files and verifies the hash, raising
the component's own error type with the hint of how to rebuild.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

MANIFEST_FILE = "manifest.json"


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_artifact_dir(
    path: str | Path,
    *,
    what: str,
    default_model_file: str,
    error: type[Exception],
    rebuild: str,
    check: Callable[[dict[str, Any]], None],
) -> tuple[dict[str, Any], Path, Path]:
    """(manifest, directory, model file) of the artifact at `path` (its directory or its manifest).

    Raises `error` naming the file at fault when the manifest is missing, unreadable or fails
    `check`, or when the model file is missing or does not match the manifest's sha256.
    """
    directory = Path(path)
    if directory.is_file():
        directory = directory.parent
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise error(f"no {what} manifest at {manifest_path}; {rebuild}")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise error(f"cannot read {what} manifest {manifest_path}: {exc}") from exc
    if not isinstance(manifest, dict):
        raise error(f"{what} manifest {manifest_path} is not a JSON object")
    check(manifest)
    model_path = directory / str(manifest.get("model_file", default_model_file))
    if not model_path.is_file():
        raise error(f"{what} model file {model_path} is missing")
    if manifest.get("model_sha256") != sha256_file(model_path):
        raise error(f"{what} model file {model_path} does not match its manifest's hash")
    return manifest, directory, model_path
