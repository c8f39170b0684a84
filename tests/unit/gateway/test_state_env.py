"""TIERLANE_STATE_BACKEND / TIERLANE_STATE_URL: the shared store from the environment (deploy files use them)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.settings import Settings


def test_state_backend_and_url_come_from_the_environment() -> None:
    settings = Settings.load(env={"TIERLANE_STATE_BACKEND": "redis", "TIERLANE_STATE_URL": "redis://valkey:6379/0"})
    assert settings.state.backend == "redis" and settings.state.url == "redis://valkey:6379/0"
    assert Settings.load(env={}).state.backend == "embedded"
    with pytest.raises(ValidationError):
        Settings.load(env={"TIERLANE_STATE_BACKEND": "memcached"})
    with pytest.raises(ValidationError, match="redis://"):
        Settings.load(env={"TIERLANE_STATE_URL": "http://valkey:6379"})
