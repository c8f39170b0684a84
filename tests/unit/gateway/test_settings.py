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


def test_edge_attention_defaults_to_flash_attention_over_a_q8_0_cache() -> None:
    edge = Settings.load(env={}).edge
    assert edge.flash_attn is True
    assert edge.kv_cache_type == "q8_0"  # resolved at load by the engine's own settings model


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("edge:\n  flash_attn: false\n  kv_cache_type: q8_0\n", "needs flash_attn"),
        ("edge:\n  kv_cache_type: f16\n", "needs a quantized kv_cache_type"),
        ("edge:\n  kv_cache_type: q5_1\n", "kv_cache_type"),
    ],
)
def test_edge_attention_set_ups_that_cannot_run_are_rejected_at_load(tmp_path: Path, yaml_text: str, message: str) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValidationError, match=message):
        Settings.load(path, env={})


def test_a_key_digest_listed_twice_refuses_to_start_naming_both_places(tmp_path: Path) -> None:
    """The same digest inline (tenant alpha) and, upper-cased, in keys_file (tenant ops, admin): refused."""
    digest = "ab" * 32
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"- {{sha256: {digest.upper()}, tenant: ops, admin: true}}\n")
    overrides = {"auth": {"mode": "keys", "keys": [{"sha256": digest, "tenant": "alpha"}], "keys_file": str(keys_file)}}
    with pytest.raises(ValueError, match=r"listed twice: auth\.keys\[0\] and auth\.keys_file .*keys\.yaml' entry 0"):
        Settings.load(env={}, overrides=overrides)
    with pytest.raises(ValueError, match=r"listed twice: auth\.keys\[0\] and auth\.keys\[1\]"):
        Settings.load(env={}, overrides={"auth": {"mode": "keys", "keys": [
            {"sha256": digest, "tenant": "alpha"}, {"sha256": digest.upper(), "tenant": "ops", "admin": True}]}})


def test_the_outage_mode_defaults_to_local_share_and_reads_its_older_name() -> None:
    assert Settings.load(env={}).state.outage == "local_share"
    assert Settings.load(env={}, overrides={"state": {"on_store_error": "deny"}}).state.outage == "deny"
    both = {"state": {"on_store_error": "deny", "on_outage": "allow"}}
    assert Settings.load(env={}, overrides=both).state.outage == "allow"


def test_model_aliases_from_the_environment_and_the_start_hint() -> None:
    from gateway.serve_cli import start_hint

    bare = Settings.load(env={})
    assert bare.model_aliases == {} and bare.apis.unknown_fields == "drop" and bare.apis.hosted_tools == "drop"
    assert "TIERLANE_MODEL_ALIASES='claude-*=auto,gpt-*=auto'" in start_hint(bare)
    settings = Settings.load(env={"TIERLANE_MODEL_ALIASES": " claude-*=auto, gpt-5*=edge "})
    assert settings.model_aliases == {"claude-*": "auto", "gpt-5*": "edge"}
    assert "claude-* -> auto" in start_hint(settings)
    with pytest.raises(ValueError, match="NAME=TARGET"):
        Settings.load(env={"TIERLANE_MODEL_ALIASES": "claude-*"})
