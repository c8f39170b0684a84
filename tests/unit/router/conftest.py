"""Fixtures for the router tests: the shipped router, loaded once (the embedder fixtures are suite-wide)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from policies.router import Router
from policies.router.artifact import default_artifact_dir


@pytest.fixture(scope="session")
def shipped_router() -> Router:
    return Router.load()


@pytest.fixture
def artifact_copy(tmp_path: Path) -> Path:
    """A writable copy of the shipped artifact, for tampering with."""
    dest = tmp_path / "artifact"
    shutil.copytree(default_artifact_dir(), dest)
    return dest
