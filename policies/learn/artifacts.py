"""The adapters `tierlane edge learn` wrote, as the gateway finds them: manifests read, the newest per template.

`tierlane edge learn` writes `<dir>/<tenant>/<app>/<template>/<sha256>.gguf` and `<sha256>.json`
beside it, the manifest last (both under temporary names first), so a manifest found names a
whole adapter. A scan reads every manifest (a stat per file, a read only for a file not seen at
that size and time) and keeps, per (tenant, app, template), the newest whose base model is the
one the gateway serves (its sha256) and whose adapter file is there. Anything else is skipped
with one warning per file: a manifest of another base model, an unreadable one, a missing file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from policies.learn.calibration import Scored, Threshold, threshold

log = logging.getLogger(__name__)

Key = tuple[str, str, str]  # (tenant, app, template)


@dataclass(frozen=True, slots=True)
class Artifact:
    """One adapter and what its manifest says of it."""

    key: Key
    sha256: str
    path: Path  # the adapter GGUF
    created_at: str
    template_version: str
    labels: tuple[str, ...] | None  # a label set: decoding is constrained to it
    answer_tokens_max: int
    held_out: tuple[Scored, ...]  # the held-out answers' confidences and agreement, for the threshold
    agreement: float
    pairs_train: int
    train_seconds: float

    def threshold(self, disagreement: float) -> Threshold:
        """The confidence threshold at which at most `disagreement` of the held-out answers above it disagree."""
        return threshold(self.held_out, disagreement)

    @property
    def name(self) -> str:
        return f"{self.sha256[:12]}"


def read_manifest(path: Path) -> Artifact:
    """The artifact a manifest describes; ValueError when it is not one."""
    data: Any = json.loads(path.read_text(encoding="utf-8"))
    try:
        confidence = data["confidence"]
        labels = confidence.get("labels")
        held = tuple(Scored(pair_id=str(h["pair_id"]), answer=str(h.get("label", "")), confidence=float(h["confidence"]),
                            agrees=bool(h["agrees"])) for h in confidence["held_out"])  # fmt: skip
        return Artifact(
            key=(str(data["tenant"]), str(data["app"]), str(data["template"])),
            sha256=str(data["sha256"]),
            path=path.with_name(str(data["artifact"])),
            created_at=str(data["created_at"]),
            template_version=str(data["template_version"]),
            labels=tuple(str(x) for x in labels) if labels else None,
            answer_tokens_max=int(confidence.get("answer_tokens_max") or 64),
            held_out=held,
            agreement=float(data["evaluation"]["agreement"]),
            pairs_train=int(data["pairs"]["train"]),
            train_seconds=float(data["training"]["seconds"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not an adapter manifest ({type(exc).__name__}: {exc})") from None


def _base_sha(path: Path) -> str | None:
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
        return str(data["base_model"]["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class ArtifactDirectory:
    """Scans one directory for manifests; remembers what it read so a rescan costs a stat per file."""

    def __init__(self, directory: Path, base_sha256: str) -> None:
        self.directory = directory
        self.base_sha256 = base_sha256
        self._read: dict[Path, tuple[tuple[int, int], Artifact | None]] = {}

    def scan(self) -> dict[Key, Artifact]:
        """The newest usable artifact per template."""
        seen: dict[Path, tuple[tuple[int, int], Artifact | None]] = {}
        for path in sorted(self.directory.glob("*/*/*/*.json")) if self.directory.is_dir() else []:
            try:
                stat = path.stat()
            except OSError:
                continue
            stamp = (stat.st_size, stat.st_mtime_ns)
            known = self._read.get(path)
            seen[path] = known if known is not None and known[0] == stamp else (stamp, self._load(path))
        self._read = seen
        newest: dict[Key, Artifact] = {}
        for _, artifact in seen.values():
            if artifact is not None and (artifact.key not in newest or artifact.created_at > newest[artifact.key].created_at):
                newest[artifact.key] = artifact
        return newest

    def _load(self, path: Path) -> Artifact | None:
        base = _base_sha(path)
        if base is None:
            log.warning("learned adapters: %s is not a manifest tierlane edge learn wrote; skipped", path)
            return None
        if base != self.base_sha256:
            log.warning("learned adapters: %s was trained on another base model (sha256 %s..., the edge serves %s...); "
                        "skipped: train it again on this one", path, base[:12], self.base_sha256[:12])  # fmt: skip
            return None
        try:
            artifact = read_manifest(path)
        except (OSError, ValueError) as exc:
            log.warning("learned adapters: %s skipped: %s", path, exc)
            return None
        parts = path.relative_to(self.directory).parts
        if tuple(unquote(p) for p in parts[:3]) != artifact.key:
            log.warning(
                "learned adapters: %s names %s but lies under %s; skipped", path, "/".join(artifact.key), "/".join(parts[:3])
            )
            return None
        if not artifact.path.is_file():
            log.warning("learned adapters: %s names %s, which is not there; skipped", path, artifact.path.name)
            return None
        return artifact
