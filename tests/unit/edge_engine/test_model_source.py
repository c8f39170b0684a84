"""`edge.model`: what it may name, how it resolves to a local GGUF, and the digest kept per file version."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from edge_engine import EdgeSettings, bundled_model_path
from edge_engine.model_source import (
    ModelSourceError,
    ModelUnavailable,
    file_sha256,
    memo_file,
    parse_hub,
    parse_model,
    remembered_sha256,
    resolve_model,
)

PIN = hashlib.sha256(b"some model").hexdigest()


@pytest.mark.parametrize(
    ("spec", "org", "repo", "revision", "file"),
    [
        ("hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf",
         "Qwen", "Qwen2.5-0.5B-Instruct-GGUF", "main", "qwen2.5-0.5b-instruct-q4_k_m.gguf"),
        ("hf://org/repo@0123abc/sub/dir/m.GGUF", "org", "repo", "0123abc", "sub/dir/m.GGUF"),
    ],
)
def test_a_hub_name_gives_org_repo_revision_and_file(spec: str, org: str, repo: str, revision: str, file: str) -> None:
    hub = parse_hub(spec)
    assert (hub.org, hub.repo, hub.revision, hub.file) == (org, repo, revision, file)
    assert parse_hub(hub.spec) == hub


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("hf://org/repo", "hf://org/repo/file.gguf"),
        ("hf://org//m.gguf", "hf://org/repo/file.gguf"),
        ("hf://org/repo/../m.gguf", "not a hub name"),
        ("hf://org/repo@/m.gguf", "not a hub name"),
        ("hf://org/repo/model.bin", "GGUF"),
        ("https://example.com/m.gguf", "only scheme known is hf://"),
    ],
)
def test_a_malformed_model_name_is_refused(spec: str, says: str) -> None:
    with pytest.raises(ModelSourceError, match=re.escape(says)):
        parse_model(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "hf://../repo/m.gguf",
        "hf://org/../m.gguf",
        "hf://org/repo/../m.gguf",
        "hf://org/repo@../m.gguf",
        "hf://org/repo/./m.gguf",
        "hf://org/repo/.hidden/m.gguf",
        "hf://org/repo/sub\\..\\m.gguf",
        "hf://org/repo/%2e%2e/m.gguf",
        "hf://org/repo/~/m.gguf",
        "hf://org/repo\n/m.gguf",
        "hf://org/repo@main\n/m.gguf",
    ],
)
def test_a_spec_that_would_leave_the_cache_folder_is_refused(spec: str) -> None:
    # a trailing newline in a name would make a folder of its own under the cache
    with pytest.raises(ModelSourceError, match="not a hub name"):
        parse_hub(spec)


def test_a_remembered_digest_with_a_trailing_newline_is_not_taken(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"some model")
    file_sha256(gguf, tmp_path / "cache")
    memo = memo_file(gguf, tmp_path / "cache")
    memo.write_text(json.dumps({**json.loads(memo.read_text()), "sha256": PIN + "\n"}))
    assert remembered_sha256(gguf, memo) is None


def test_bundled_and_paths_are_told_apart() -> None:
    assert parse_model("bundled").kind == "bundled"
    local = parse_model("~/models/m.gguf")
    assert local.kind == "local" and local.path == Path.home() / "models" / "m.gguf"


def test_the_bundled_default_resolves_without_any_network(tmp_path: Path) -> None:
    settings = EdgeSettings(model_cache_dir=str(tmp_path))
    assert settings.model == "bundled" and settings.hub_file is None
    assert settings.resolved_model_path() == bundled_model_path()
    resolved = settings.resolved_model()
    assert resolved.path == bundled_model_path() and resolved.source.kind == "bundled"
    assert resolved.sha256 == hashlib.sha256(bundled_model_path().read_bytes()).hexdigest()
    # pinned, it is checked like any file
    assert EdgeSettings(model_sha256=resolved.sha256, model_cache_dir=str(tmp_path)).resolved_model_path() == resolved.path


def test_a_hub_model_needs_its_digest_pinned() -> None:
    with pytest.raises(ValidationError, match="pin its sha256 in edge.model_sha256"):
        EdgeSettings(model="hf://org/repo/m.gguf")
    with pytest.raises(ValidationError, match="not a sha256"):
        EdgeSettings(model="hf://org/repo/m.gguf", model_sha256="abc")
    pinned = EdgeSettings(model="hf://org/repo/m.gguf", model_sha256="sha256:" + PIN.upper())
    assert pinned.model_sha256 == PIN and pinned.hub_file == parse_hub("hf://org/repo@main/m.gguf")


def test_model_path_is_the_older_name_of_model(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert EdgeSettings(model_path=str(gguf)).model == str(gguf)
    assert EdgeSettings(model_path=str(gguf), model_cache_dir=str(tmp_path)).resolved_model_path() == gguf
    assert EdgeSettings(model=str(gguf), model_path=str(gguf)).model == str(gguf)
    with pytest.raises(ValidationError, match="name two models"):
        EdgeSettings(model="hf://org/repo/m.gguf", model_sha256=PIN, model_path=str(gguf))


def test_a_hub_model_missing_from_the_cache_names_the_pull_command(tmp_path: Path) -> None:
    settings = EdgeSettings(model="hf://org/repo/m.gguf", model_sha256=PIN, model_cache_dir=str(tmp_path))
    with pytest.raises(ModelUnavailable, match=r"not in the model cache .*run `tierlane edge pull --config x.yaml`"):
        settings.resolved_model_path(pull_command="tierlane edge pull --config x.yaml")


def test_a_cached_hub_file_unlike_its_pin_is_refused_naming_both_digests(tmp_path: Path) -> None:
    settings = EdgeSettings(model="hf://org/repo/m.gguf", model_sha256=PIN, model_cache_dir=str(tmp_path))
    placed = tmp_path / "org" / "repo" / "main" / "m.gguf"
    placed.parent.mkdir(parents=True)
    placed.write_bytes(b"not that model")
    got = hashlib.sha256(b"not that model").hexdigest()
    with pytest.raises(ModelUnavailable, match=f"expected {PIN}, got {got}; run `tierlane edge pull` to download it again"):
        settings.resolved_model_path()
    placed.write_bytes(b"some model")
    assert settings.resolved_model_path() == placed
    assert settings.resolved_model().sha256 == PIN


def test_a_local_path_is_checked_against_its_pin_when_one_is_given(tmp_path: Path) -> None:
    gguf = tmp_path / "mounted" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"some model")
    cache = tmp_path / "cache"
    assert EdgeSettings(model=str(gguf), model_sha256=PIN, model_cache_dir=str(cache)).resolved_model_path() == gguf
    other = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(ModelUnavailable, match=f"expected {other}, got {PIN}"):
        EdgeSettings(model=str(gguf), model_sha256=other, model_cache_dir=str(cache)).resolved_model_path()
    with pytest.raises(ModelUnavailable, match="edge model not found"):
        EdgeSettings(model=str(tmp_path / "absent.gguf"), model_cache_dir=str(cache)).resolved_model_path()


def test_a_digest_is_hashed_once_per_file_version(tmp_path: Path) -> None:
    gguf = tmp_path / "mounted" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"some model")
    cache = tmp_path / "cache"
    hashed: list[int] = []
    assert file_sha256(gguf, cache, hashed.append) == PIN
    assert file_sha256(gguf, cache, hashed.append) == PIN
    assert hashed == [len(b"some model")], "the second call reads the memo, not the file"
    # a path outside the cache is remembered under <cache>/local/, never beside a (maybe read-only) mount
    assert memo_file(gguf, cache).parent == cache / "local" and memo_file(gguf, cache).is_file()
    # the same size, a new mtime: hashed again
    gguf.write_bytes(b"same size!")
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert resolve_model(str(gguf), None, cache).sha256 == hashlib.sha256(b"same size!").hexdigest()


def test_a_memo_that_cannot_be_written_only_costs_a_hash(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"some model")
    blocked = tmp_path / "cache-is-a-file"
    blocked.write_text("")
    hashed: list[int] = []
    assert file_sha256(gguf, blocked, hashed.append) == PIN
    assert file_sha256(gguf, blocked, hashed.append) == PIN
    assert len(hashed) == 2
