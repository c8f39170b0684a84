"""Gateway settings: embedded defaults, an optional YAML file, then TIERLANE_* environment variables.

This is the only module that reads the environment (besides OTEL_* handled by the OTel SDK).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edge_engine.settings import attention_problem
from policies.policy import _deep_merge


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    max_n: int = Field(8, ge=1, description="largest `n` a request may ask for")
    shutdown_timeout_s: float = Field(10.0, gt=0)
    uvloop: bool = Field(True, description="run on uvloop where it is installed (faster I/O)")


class ApiKey(_Strict):
    sha256: str = Field(description="hex SHA-256 digest of the key; the key itself is never stored")
    tenant: str
    app: str = "default"
    admin: bool = False

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str) -> str:
        value = value.lower()
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ValueError("sha256 must be 64 hex characters (see `tierlane hash-key`)")
        return value


class AuthSettings(_Strict):
    mode: Literal["open", "keys"] = "open"
    keys: list[ApiKey] = Field(default_factory=list)


class UpstreamSettings(_Strict):
    name: str
    base_url: str = Field(description="OpenAI-compatible base URL, e.g. http://10.0.0.5:8000/v1")
    api_key_env: str | None = Field(None, description="environment variable holding the upstream key")
    pass_client_auth: bool = Field(False, description="forward the client's own Authorization header")
    models: list[str] = Field(default_factory=lambda: ["*"], description='model names served; "*" = any')
    pool: str = "default"
    connect_timeout_s: float = Field(3.0, gt=0)
    read_timeout_s: float = Field(120.0, gt=0, description="longest silence between bytes")
    total_timeout_s: float = Field(600.0, gt=0)
    max_connections: int = Field(256, ge=1)
    retries: int = Field(2, ge=0, le=10)
    backoff_base_s: float = Field(0.1, ge=0)
    backoff_max_s: float = Field(2.0, ge=0)
    max_retry_after_s: float = Field(10.0, ge=0, description="a longer Retry-After is passed to the client")
    breaker_failures: int = Field(5, ge=1, description="consecutive failures that open the breaker")
    breaker_cooldown_s: float = Field(10.0, gt=0)
    max_response_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    api_key: str | None = Field(None, exclude=True, description="resolved from api_key_env at load")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("base_url must start with http:// or https://")
        return value.rstrip("/")


class PoolSettings(_Strict):
    fallback: list[str] = Field(default_factory=list)


class EdgeSettingsModel(_Strict):
    enabled: bool = True
    model_name: str = "edge"
    aliases: list[str] = Field(default_factory=list)
    model_path: str | None = None
    n_ctx: int = Field(2048, ge=256, description="KV cells per sequence: longest prompt + completion")
    n_threads: int | None = Field(None, ge=1)
    n_batch: int = Field(512, ge=8)
    slots: int = Field(8, ge=1)
    prefill_chunk: int = Field(256, ge=1, description="most prompt tokens in one step")
    prefill_step_ms: float | None = Field(
        150.0, gt=0, description="prompt steps are sized to take about this long (a new request waits at most one)"
    )
    decode_gap_ms: float = Field(
        100.0, ge=0, description="while prompts are ingested, running sequences still decode at least this often"
    )
    n_gpu_layers: int = 0
    max_queue: int = Field(64, ge=1)
    batch_invariant: bool = Field(
        True, description="greedy output independent of other traffic (one KV stream per sequence; more memory)"
    )
    prefix_reuse: bool = Field(True, description="reuse the KV cache of a shared prompt prefix")
    mix_prefill: bool = Field(False, description="prompt chunks share steps with decodes (faster, not exact)")
    flash_attn: bool = Field(True, description="fused attention kernel (1.13x decode throughput at 8 streams on 2 CPU threads)")
    kv_cache_type: str | None = Field(
        None,
        description="KV cell type (q8_0, q4_0, f16, f32); null: q8_0 with flash attention (half f16's "
        "memory; quality in bench/edge_kv_quality.py), f16 without",
    )

    @model_validator(mode="after")
    def _attention(self) -> EdgeSettingsModel:
        problem = attention_problem(self.flash_attn, self.kv_cache_type, self.batch_invariant, self.n_gpu_layers)
        if problem:
            raise ValueError(problem)
        return self


class EmbedderSettings(_Strict):
    enabled: bool = True
    backend: Literal["onnx", "torch"] = Field(
        "onnx", description="onnx: onnxruntime on a graph exported once from the bundled weights; torch: sentence-transformers"
    )
    cache_dir: Path | None = Field(None, description="where the exported graph is kept (null: ~/.cache/tierlane/models)")
    threads: int | None = Field(1, ge=1, description="intra-op threads of the backend (null: its default)")
    max_wait_ms: float = Field(2.0, ge=0)
    max_batch: int = Field(64, ge=1)


class TelemetrySettings(_Strict):
    service_name: str = "tierlane"
    tracing: bool = True
    metrics: bool = True
    metering: bool = Field(True, description="ledger rows, cost attribution and budgets")
    record_content: bool = False
    tenants: list[str] = Field(default_factory=list)
    apps: list[str] = Field(default_factory=list)


class Settings(_Strict):
    """Everything the gateway is configured with."""

    server: ServerSettings = Field(default_factory=ServerSettings)
    state_dir: Path = Path(".tierlane/state")
    auth: AuthSettings = Field(default_factory=AuthSettings)
    upstreams: list[UpstreamSettings] = Field(default_factory=list)
    pools: dict[str, PoolSettings] = Field(default_factory=dict)
    edge: EdgeSettingsModel = Field(default_factory=EdgeSettingsModel)
    embedder: EmbedderSettings = Field(default_factory=EmbedderSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    policy_file: Path | None = None
    policy: dict[str, Any] = Field(default_factory=dict, description="inline policy sections")

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> Settings:
        """Embedded defaults, then `path` (or $TIERLANE_CONFIG), then TIERLANE_* variables, then overrides."""
        env = os.environ if env is None else env
        data: dict[str, Any] = yaml.safe_load(
            (resources.files("gateway") / "defaults.yaml").read_text("utf-8")
        )
        path = path or env.get("TIERLANE_CONFIG")
        if path:
            with open(path, encoding="utf-8") as fh:
                data = _deep_merge(data, yaml.safe_load(fh) or {})
        data = _deep_merge(data, _from_env(env))
        if overrides:
            data = _deep_merge(data, overrides)
        settings = cls.model_validate(data)
        for upstream in settings.upstreams:
            if upstream.api_key_env:
                upstream.api_key = env.get(upstream.api_key_env)
        return settings


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    server: dict[str, Any] = {}
    if "TIERLANE_HOST" in env:
        server["host"] = env["TIERLANE_HOST"]
    if "TIERLANE_PORT" in env:
        server["port"] = int(env["TIERLANE_PORT"])
    if server:
        out["server"] = server
    if "TIERLANE_STATE_DIR" in env:
        out["state_dir"] = env["TIERLANE_STATE_DIR"]
    if "TIERLANE_AUTH_MODE" in env:
        out["auth"] = {"mode": env["TIERLANE_AUTH_MODE"]}
    if "TIERLANE_POLICY" in env:
        out["policy_file"] = env["TIERLANE_POLICY"]
    if "TIERLANE_EDGE" in env:
        out["edge"] = {"enabled": env["TIERLANE_EDGE"].lower() not in ("0", "off", "false", "no")}
    if "TIERLANE_EDGE_MODEL_PATH" in env:
        out.setdefault("edge", {})["model_path"] = env["TIERLANE_EDGE_MODEL_PATH"]
    if "TIERLANE_EMBEDDER_CACHE_DIR" in env:
        out["embedder"] = {"cache_dir": env["TIERLANE_EMBEDDER_CACHE_DIR"]}
    if env.get("TIERLANE_UPSTREAM_URL"):
        models = [m.strip() for m in env.get("TIERLANE_UPSTREAM_MODELS", "*").split(",") if m.strip()]
        out["upstreams"] = [
            {
                "name": env.get("TIERLANE_UPSTREAM_NAME", "upstream"),
                "base_url": env["TIERLANE_UPSTREAM_URL"],
                "api_key_env": env.get("TIERLANE_UPSTREAM_API_KEY_ENV"),
                "models": models,
                "pool": env.get("TIERLANE_UPSTREAM_POOL", "default"),
            }
        ]
    return out
