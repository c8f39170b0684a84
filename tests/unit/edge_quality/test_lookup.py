"""Finding the calibration of a model file by its sha256: named or shipped artifact first, then the per-digest cache."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from policies.edge_quality.artifact import MANIFEST_FILE, default_artifact_dir
from policies.edge_quality.lookup import (
    cached_artifact_dir,
    find_calibration,
    model_digest,
    publish_artifact,
    staging_dir,
)


def fake_model(path: Path, content: bytes) -> Path:
    """A file standing in for a GGUF: the lookup only hashes it, it never loads it."""
    path.write_bytes(content)
    return path


def artifact_for(directory: Path, model: Path | None, *, sha256: str | None = None, size: int | None = None) -> Path:
    """The shipped artifact copied to `directory`, its manifest saying it was measured on `model`."""
    shutil.copytree(default_artifact_dir(), directory)
    manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    if sha256 is None:
        assert model is not None
        sha256 = hashlib.sha256(model.read_bytes()).hexdigest()
    manifest["gguf"] = {"file": model.name if model else "other.gguf", "sha256": sha256,
                        "size": size if size is not None else (model.stat().st_size if model else 1)}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return directory


def test_a_named_artifact_for_another_model_is_refused_and_the_cache_is_looked_in(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "mine.gguf", b"my model weights")
    digest = hashlib.sha256(b"my model weights").hexdigest()
    other = artifact_for(tmp_path / "other", None, sha256="ab" * 32)
    cache = tmp_path / "cache"
    missing = find_calibration(model, named=other, cache_dir=cache, model_cache_dir=tmp_path / "models")
    assert not missing.found and missing.model_sha256 == digest
    assert any("named" in why and "abababababab" in why for why in missing.refused), missing.refused
    artifact_for(cached_artifact_dir(digest, cache), model)
    found = find_calibration(model, named=other, cache_dir=cache, model_cache_dir=tmp_path / "models")
    assert found.found and found.source == "cache" and found.directory == cache / digest
    assert found.calibration is not None and found.calibration.gguf_sha256 == digest


def test_a_named_artifact_made_for_the_model_is_taken_first(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "mine.gguf", b"weights")
    named = artifact_for(tmp_path / "named", model)
    artifact_for(cached_artifact_dir(model_digest(model, tmp_path / "models"), tmp_path / "cache"), model)
    found = find_calibration(model, named=named, cache_dir=tmp_path / "cache", model_cache_dir=tmp_path / "models")
    assert (found.source, found.directory) == ("named", named)


def test_the_shipped_artifact_describes_only_the_bundled_model(tmp_path: Path) -> None:
    from edge_engine import bundled_model_path

    bundled = find_calibration(bundled_model_path(), cache_dir=tmp_path / "cache")
    assert bundled.found and bundled.source == "shipped"
    other = find_calibration(fake_model(tmp_path / "x.gguf", b"x"), cache_dir=tmp_path / "cache",
                             model_cache_dir=tmp_path / "models")
    assert not other.found
    assert [why.split(":")[0] for why in other.refused] == ["shipped (" + str(default_artifact_dir()) + ")", "cache"]


def test_an_artifact_recording_another_file_size_is_refused(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "mine.gguf", b"weights")
    named = artifact_for(tmp_path / "named", model, size=model.stat().st_size + 1)
    found = find_calibration(model, named=named, cache_dir=tmp_path / "cache", model_cache_dir=tmp_path / "models")
    assert not found.found and "bytes" in found.refused[0]


def test_the_digest_follows_the_file_version(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "m.gguf", b"one")
    assert model_digest(model, tmp_path / "models") == hashlib.sha256(b"one").hexdigest()
    model.write_bytes(b"two, longer")  # another size (and mtime): hashed again
    assert model_digest(model, tmp_path / "models") == hashlib.sha256(b"two, longer").hexdigest()


def test_publishing_replaces_an_older_entry_whole(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "m.gguf", b"weights")
    digest = model_digest(model, tmp_path / "models")
    cache = tmp_path / "cache"
    old = artifact_for(cached_artifact_dir(digest, cache), model)
    (old / "stale").write_text("x")
    staged = staging_dir(digest, cache)
    staged.rmdir()
    artifact_for(staged, model)
    assert publish_artifact(staged, digest, cache) == cache / digest
    assert not (cache / digest / "stale").exists() and not staged.exists()
    assert sorted(p.name for p in cache.iterdir()) == [digest]
    assert find_calibration(model, cache_dir=cache, model_cache_dir=tmp_path / "models").source == "cache"


@pytest.mark.parametrize("content", [b"", b"\x00" * 10])
def test_a_model_nothing_was_made_for_is_reported_with_its_digest(tmp_path: Path, content: bytes) -> None:
    model = fake_model(tmp_path / "m.gguf", content)
    found = find_calibration(model, named=tmp_path / "nowhere", cache_dir=tmp_path / "cache",
                             model_cache_dir=tmp_path / "models")
    assert not found.found and found.model_sha256 == hashlib.sha256(content).hexdigest()
    assert found.refused[0].startswith("named: no edge calibration manifest")
