"""Which calibration artifact belongs to the configured edge model: looked up by the model file's sha256.

A calibration is only valid for the very GGUF file it measured (its manifest records
`gguf.sha256`). Candidates, in order:

1. the artifact directory the configuration names (`edge.calibration`, or the policy's
   `cascade.calibration`), else the artifact shipped in the package (made for the bundled model);
2. the per-digest cache, `<cache_dir>/<sha256>/`, where `tierlane edge calibrate` writes by
   default and the gateway's background calibration (`edge.calibrate_on_start`) writes.

The first whose `gguf.sha256` is the model file's own wins. None matching: the edge model is
uncalibrated, and takes no `auto` traffic (it still answers requests that name it).

The model's digest is hashed once per file version (path, size, mtime_ns) and remembered in the
model cache (edge_engine/model_source.py), so a large model is not hashed at every start.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from edge_engine.model_source import DEFAULT_CACHE_DIR, file_sha256
from policies.edge_quality.artifact import EdgeCalibrationError
from policies.edge_quality.model import EdgeCalibration

log = logging.getLogger(__name__)

_lock = threading.Lock()
_memo: dict[tuple[str, int, int], str] = {}


def default_cache_dir() -> Path:
    """Where calibrations keyed by model digest are kept: ~/.cache/tierlane/calibration."""
    return Path("~/.cache/tierlane/calibration").expanduser()


def cache_root(cache_dir: str | Path | None) -> Path:
    return default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()


def cached_artifact_dir(digest: str, cache_dir: str | Path | None = None) -> Path:
    """The artifact directory of the model whose sha256 is `digest`."""
    return cache_root(cache_dir) / digest


def _file_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def model_digest(model_path: str | Path, model_cache_dir: str | Path = DEFAULT_CACHE_DIR) -> str:
    """The sha256 of a model file, hashed once per file version (path, size, mtime_ns): remembered in
    this process and, by edge_engine.model_source, in the model cache (so not at every start)."""
    path = Path(model_path)
    key = _file_key(path)
    with _lock:
        found = _memo.get(key)
    if found is None:
        found = file_sha256(path, model_cache_dir)
        with _lock:
            _memo[key] = found
    return found


def publish_artifact(built: Path, digest: str, cache_dir: str | Path | None = None) -> Path:
    """Move a finished artifact directory to `<cache_dir>/<digest>/` (replacing an older one)."""
    target = cached_artifact_dir(digest, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        old = target.with_name(f".{digest}.old-{os.getpid()}")
        os.replace(target, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(built, target)
    return target


def staging_dir(digest: str, cache_dir: str | Path | None = None) -> Path:
    """A fresh directory beside the cache entry to write an artifact into before `publish_artifact`."""
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix=f".{digest[:16]}-"))


@dataclass(slots=True)
class Lookup:
    """What was found for one model file."""

    model_path: Path
    model_sha256: str
    calibration: EdgeCalibration | None = None
    source: str | None = None  # "named", "shipped" or "cache"
    directory: Path | None = None
    refused: list[str] = field(default_factory=list)  # why each candidate was not taken

    @property
    def found(self) -> bool:
        return self.calibration is not None


def _candidate(calibration: EdgeCalibration, digest: str, size: int) -> str | None:
    """Why this calibration does not describe the model (None: it does)."""
    if calibration.gguf_sha256 != digest:
        return f"measured on {calibration.gguf_name or '?'} (sha256 {calibration.gguf_sha256[:12] or '?'}...)"
    recorded = (calibration.manifest.get("gguf") or {}).get("size")
    if recorded is not None and int(recorded) != size:
        return f"records a model of {recorded} bytes, not {size}"
    return None


def find_calibration(
    model_path: str | Path, *, named: str | Path | None = None, cache_dir: str | Path | None = None,
    model_sha256: str | None = None, model_cache_dir: str | Path = DEFAULT_CACHE_DIR,
) -> Lookup:
    """The calibration made for this model file (whose digest is `model_sha256`, hashed when not
    given), or a Lookup saying why there is none."""
    path = Path(model_path)
    digest = model_sha256 or model_digest(path, model_cache_dir)
    size = path.stat().st_size
    found = Lookup(model_path=path, model_sha256=digest)
    first = ("named", Path(named).expanduser()) if named is not None else ("shipped", None)
    cached = cached_artifact_dir(digest, cache_dir)
    for source, directory in (first, ("cache", cached)):
        if source == "cache" and not (cached / "manifest.json").is_file():
            found.refused.append(f"cache: nothing at {cached}")
            continue
        try:
            calibration = EdgeCalibration.load(directory)
        except EdgeCalibrationError as exc:
            found.refused.append(f"{source}: {exc}")
            continue
        why = _candidate(calibration, digest, size)
        if why is not None:
            found.refused.append(f"{source} ({calibration.directory}): {why}")
            continue
        found.calibration, found.source, found.directory = calibration, source, calibration.directory
        return found
    return found
