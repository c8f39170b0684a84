"""Settings: embedded defaults, the TIERLANE_* variables that override them, and rejected values."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.settings import Settings


def test_defaults_embed_with_onnx_and_the_user_cache() -> None:
    settings = Settings.load(env={})
    assert settings.embedder.backend == "onnx"
    assert settings.embedder.cache_dir is None
    assert settings.embedder.threads == 1


def test_environment_overrides_the_defaults(tmp_path: Path) -> None:
    settings = Settings.load(env={
        "TIERLANE_PORT": "9123",
        "TIERLANE_STATE_DIR": str(tmp_path / "state"),
        "TIERLANE_EDGE": "off",
        "TIERLANE_EMBEDDER_CACHE_DIR": str(tmp_path / "models"),
    })
    assert settings.server.port == 9123
    assert settings.state_dir == tmp_path / "state"
    assert settings.edge.enabled is False
    assert settings.embedder.cache_dir == tmp_path / "models"


def test_unknown_embedding_backend_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("embedder:\n  backend: tensorflow\n")
    with pytest.raises(ValidationError, match="backend"):
        Settings.load(path, env={})
