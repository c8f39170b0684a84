"""Shared fixtures for the router tests: the real embedding model and the shipped router, loaded once."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from policies.embedder import Embedder, load_sentence_model
from policies.router import Router
from policies.router.artifact import default_artifact_dir

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer


@pytest.fixture(scope="session")
def router_sentence_model() -> SentenceTransformer:
    return load_sentence_model()


@pytest.fixture(scope="session")
def shipped_router() -> Router:
    return Router.load()


@pytest.fixture
def artifact_copy(tmp_path: Path) -> Path:
    """A writable copy of the shipped artifact, for tampering with."""
    dest = tmp_path / "artifact"
    shutil.copytree(default_artifact_dir(), dest)
    return dest


@pytest.fixture
async def router_embedder(router_sentence_model: SentenceTransformer) -> AsyncIterator[Embedder]:
    emb = Embedder(model=router_sentence_model)
    await emb.start()
    try:
        yield emb
    finally:
        await emb.close()
