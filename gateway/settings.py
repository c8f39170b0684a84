"""Gateway settings: embedded defaults, an optional YAML file, then TIERLANE_* environment variables.

This is the only module that reads the environment (besides OTEL_* handled by the OTel SDK).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edge_engine.settings import EdgeSettings
from gateway.upstream.flow_settings import FlowSettings
from policies.embedding.embedder import SERVING_PRECISION
from policies.policy import _deep_merge


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def is_loopback(host: str) -> bool:
    """Whether a listen address reaches only this machine: 127.0.0.0/8, ::1 or "localhost".

    Any other name counts as reachable from the network (it may resolve to anything), and so do
    the wildcard addresses 0.0.0.0, :: and "" (all interfaces).
    """
    name = host.strip().strip("[]").lower()
    if name in ("localhost", "localhost."):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


class ServerSettings(_Strict):
    """Where the gateway listens and what one request may carry."""

    host: str = Field("127.0.0.1", description="listen address (TIERLANE_HOST); open auth mode listens on loopback only")
    port: int = Field(8080, ge=0, le=65535, description="listen port (TIERLANE_PORT)")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    max_n: int = Field(8, ge=1, description="largest `n` a request may ask for")
    max_items: int = Field(
        8192, ge=16, description="most messages, input items, content parts and tools one request may carry (400 past "
        "it): validating one costs ~25 us of the event loop, so this bounds a request's validation to ~0.2 s")
    shutdown_timeout_s: float = Field(10.0, gt=0, description="on SIGTERM, requests in flight get this long to finish")
    uvloop: bool = Field(True, description="run on uvloop where it is installed (faster I/O)")
    gc_freeze: bool = Field(
        True,
        description="after start-up, move every live object out of the cyclic GC's reach (gc.freeze): its full "
        "collections then walk what requests allocate, not the libraries and models loaded at start",
    )


class ApiKey(_Strict):
    sha256: str = Field(description="hex SHA-256 digest of the key; the key itself is never stored")
    tenant: str = Field(description="the tenant whose budgets, cache and usage the key's requests count against")
    app: str = Field("default", description="the app within the tenant (budgets, usage and metrics per app)")
    admin: bool = Field(False, description="may read usage, purge the cache, read /v1/shadow (and /metrics if global)")
    admin_scope: Literal["global", "tenant"] = Field(
        "global", description="what an admin key administers: global = every tenant, tenant = its own tenant only"
    )

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str) -> str:
        value = value.lower()
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ValueError("sha256 must be 64 hex characters (see `tierlane hash-key`)")
        return value

    @model_validator(mode="after")
    def _scope_needs_admin(self) -> ApiKey:
        if self.admin_scope == "tenant" and not self.admin:
            raise ValueError("admin_scope: tenant is for admin keys; add admin: true (or drop admin_scope)")
        return self


class AuthSettings(_Strict):
    """Who may call the gateway: open (local use) or API keys stored as SHA-256 digests."""

    mode: Literal["open", "keys"] = Field(
        "open", description='open: every caller is an admin of tenant "default" (loopback only); keys: API keys'
    )
    keys: list[ApiKey] = Field(default_factory=list, description="the API keys, as digests (`tierlane hash-key` makes one)")
    keys_file: Path | None = Field(
        None, description="YAML/JSON list of keys (same fields as `keys`), added to them at load; e.g. a mounted Secret"
    )
    allow_open_on_network: bool = Field(
        False, description="let open mode listen on a non-loopback address (anyone who reaches it is admin)"
    )

    @model_validator(mode="after")
    def _one_entry_per_key(self) -> AuthSettings:
        check_unique_digests([{"sha256": k.sha256} for k in self.keys], [f"auth.keys[{i}]" for i in range(len(self.keys))])
        return self


NativeApi = Literal["chat", "messages"]


class UpstreamSettings(_Strict):
    """One upstream server (an entry of `upstreams`): where it is, what it serves, how it is retried."""

    name: str = Field(description="the member's name (in x-tierlane-upstream, metrics and logs)")
    base_url: str = Field(description="OpenAI-compatible base URL, e.g. http://10.0.0.5:8000/v1")
    api_key_env: str | None = Field(None, description="environment variable holding the upstream key")
    pass_client_auth: bool = Field(False, description="forward the client's own Authorization header")
    models: list[str] = Field(default_factory=lambda: ["*"], description='model names served; "*" = any')
    apis: list[NativeApi] = Field(
        default_factory=lambda: list[NativeApi](["chat"]),
        description="APIs the upstream serves: chat (OpenAI's /chat/completions), messages (Anthropic's /messages). A "
        "Messages request goes to a member serving messages as the client sent it (model mapped); a chat or Responses "
        "request goes to a member without chat (api.anthropic.com: [messages]) translated to a Messages request, with "
        "the prompt-cache breakpoints placed by the gateway",
    )
    pool: str = Field("default", description="the pool this upstream is a member of (see `pools`)")
    connect_timeout_s: float = Field(3.0, gt=0, description="longest wait for a connection (nothing sent yet: another member may take it)")
    read_timeout_s: float = Field(120.0, gt=0, description="longest silence between bytes")
    total_timeout_s: float = Field(600.0, gt=0, description="longest one upstream call may take in all (504 past it)")
    max_connections: int = Field(256, ge=1, description="open connections to this upstream at most")
    retries: int = Field(2, ge=0, le=10, description="retries on connect errors, 429, 502 and 503 (a Retry-After is honoured)")
    backoff_base_s: float = Field(0.1, ge=0, description="the wait before a retry: between this and twice this, at random")
    backoff_max_s: float = Field(2.0, ge=0, description="the longest wait before a retry")
    max_retry_after_s: float = Field(10.0, ge=0, description="a longer Retry-After is passed to the client")
    breaker_failures: int = Field(5, ge=1, description="consecutive failures that open the breaker")
    breaker_cooldown_s: float = Field(10.0, gt=0, description="an open breaker lets a request through again after this long")
    max_response_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="largest answer (or stream event) read from this upstream")
    kv_capacity_tokens: int = Field(
        131_072, ge=1024, description="the KV cache this server keeps prompts in (tokens, all slots): the gateway "
        "remembers about this much of what it sent there for prefix affinity, least recently sent forgotten first")
    max_output_tokens: int | None = Field(
        None, ge=1, description="the most completion tokens this upstream is asked for: a larger max_tokens is clamped "
        "(a small self-hosted context; agents ask for 128,000); none given: this many")
    system_messages: Literal["anywhere", "first"] = Field(
        "anywhere", description="first: every system message merged into one at the start, for chat templates that "
        "render one system message first")
    metrics_url: str | None = Field(
        None, description="the server's Prometheus endpoint (vLLM, SGLang and llama.cpp's server with --metrics: "
        "http://host:port/metrics): its running and waiting requests and KV use are scraped and weigh in balancing; "
        "unreachable or unreadable metrics mean the gateway's own counts")
    metrics_interval_s: float = Field(1.0, gt=0, description="how often metrics_url is scraped")
    max_concurrency: int | None = Field(
        None, ge=1, description="requests this member runs at once: past it, requests wait in the gateway by priority "
        "class (pools.<name>.flow); none: no budget unless its scraped metrics show it saturated (flow.from_metrics)")
    prompt_cache_key: bool | None = Field(
        None, description="send the request's session key as prompt_cache_key (OpenAI routes prompt caching by it); "
        "none: only to api.openai.com. Off, a client's own prompt_cache_key on a chat request still goes as sent")
    cache_salt: bool = Field(
        False, description="send a per-tenant cache_salt (vLLM: its prefix cache is shared only between requests of "
        "one salt), so one tenant's cached prefix never speeds up, and so never reveals itself to, another's; a "
        "client's own cache_salt goes as sent")
    api_key: str | None = Field(None, exclude=True, description="resolved from api_key_env at load")

    @property
    def sends_prompt_cache_key(self) -> bool:
        if self.prompt_cache_key is not None:
            return self.prompt_cache_key
        return self.base_url.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0] == "api.openai.com"

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("base_url must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("apis")
    @classmethod
    def _some_api(cls, value: list[NativeApi]) -> list[NativeApi]:
        if not value:
            raise ValueError("apis must name at least one API (chat, messages)")
        if len(set(value)) != len(value):
            raise ValueError("apis names an API twice")
        return value

    @field_validator("metrics_url")
    @classmethod
    def _metrics_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("metrics_url must start with http:// or https://")
        return value


class PoolSettings(_Strict):
    """A pool of upstreams (an entry of `pools`, by name): how a member is picked, and where to go when all fail."""

    fallback: list[str] = Field(default_factory=list, description="pools tried in order when every member of this one fails")
    balance: Literal["prefix_affinity", "session", "least_outstanding", "round_robin"] = Field(
        "prefix_affinity", description="how a member is picked: the one already holding the request's prompt prefix "
        "(or its session) in its KV cache, weighed against load; session: the session's member only; least_outstanding: "
        "load alone; round_robin: in turn. Prefix affinity is least-outstanding where nothing matches")
    max_load_ratio: float = Field(
        1.5, ge=1.0, description="affinity never picks a member with more than this many times the members' mean "
        "load, the request being placed counted (consistent hashing with bounded loads)")
    session_placement: Literal["balanced", "rendezvous"] = Field(
        "balanced", description="where a session (x-tierlane-session, or the agent's own session header) goes: "
        "balanced = at its first turn the member holding most of its prompt's prefix weighed against load, as without a session "
        "(nothing matched: the least loaded; ties: the fewest sessions used within session_ttl_s), kept after "
        "(moved only off a member over the load bound or down, the move kept too); the table is shared by every "
        "replica with state.backend redis, else this process's own. rendezvous = the session's hash ranking, the "
        "same on every replica without a shared store (a few sessions spread unevenly)")
    session_ttl_s: float = Field(
        300.0, gt=0, description="a session unused this long no longer counts on its member (and is placed afresh)")
    flow: FlowSettings = Field(default_factory=FlowSettings)


class EdgeSettingsModel(EdgeSettings):
    """The `edge` section: the engine's own settings model, plus the two fields only the gateway reads.

    NOTE: every engine field, its default and its bounds come from `edge_engine.settings.EdgeSettings`
    (extra keys forbidden there too), so the gateway can set all of them and repeats none; this
    object is what `gateway.components` hands to the engine.
    """

    enabled: bool = Field(True, description="start the edge lane (TIERLANE_EDGE=off: do not)")
    aliases: list[str] = Field(
        default_factory=lambda: ["smollm2", "SmolLM2-135M-Instruct"],
        description="more model names that reach the edge lane (besides model_name)",
    )
    # The calibration of the model (docs/edge-calibration.md): without one made for this very
    # file (by sha256), the edge takes no `auto` traffic; requests naming it are still answered.
    calibration: str | None = Field(
        None, description="calibration artifact directory for this model (null: the shipped one, made for the bundled "
        "model; either way the per-digest cache is looked in next; the policy's cascade.calibration also names one)")
    calibration_cache: str | None = Field(
        None, description="where calibrations keyed by the model's sha256 are kept (null: ~/.cache/tierlane/calibration)")
    calibrate_on_start: bool | Literal["background"] = Field(
        False, description="true or background: with no calibration for the model, calibrate it in the background after "
        "start (/readyz says calibrating); the edge takes `auto` traffic once it is done, no restart needed")
    calibrate_budget_s: float = Field(900.0, gt=0, description="seconds the background calibration may probe for")
    calibrate_limit: int | None = Field(
        None, ge=1, description="probes per split the background calibration runs at most (null: the whole probe set)")
    calibrate_min_probes: int = Field(
        50, ge=1, description="fewest answered calibration probes the background calibration writes an artifact from")
    calibrate_concurrency: int = Field(
        4, ge=1, description="probes the background calibration keeps in flight on the serving engine")


class EmbedderSettings(_Strict):
    """The sentence embedding the cache and the router read (all-MiniLM-L6-v2, bundled)."""

    enabled: bool = Field(True, description="load the embedding model (off: no semantic cache matching, no router embedding)")
    backend: Literal["onnx", "torch"] = Field(
        "onnx", description="onnx: onnxruntime on a graph exported once from the bundled weights; torch: sentence-transformers"
    )
    cache_dir: Path | None = Field(None, description="where the exported graph is kept (null: ~/.cache/tierlane/models)")
    threads: int | None = Field(1, ge=1, description="intra-op threads of the backend (null: its default)")
    precision: Literal["fp32", "int8"] = Field(
        SERVING_PRECISION,
        description="int8: every matmul by a weight in int8 (activations per token: a vector does not depend on its "
        "batch), about half the CPU; the router and edge prior read it within 0.01 of float32, the cache with its "
        "verifier refitted for it (bench/results/embedding_precision.json); fp32: the vectors the readers were fitted on",
    )
    max_wait_ms: float = Field(2.0, ge=0, description="longest a text waits for others to share its batch (only while others arrive)")
    max_batch: int = Field(64, ge=1, description="most texts encoded in one batch")
    max_queue: int = Field(1024, ge=1, description="most texts waiting for the encoder: past it the cache's semantic "
                           "lookup goes without (exact match only) and the router waits for room")


class TelemetrySettings(_Strict):
    """Spans, metrics and the ledger: what is recorded, and who may read /metrics."""

    service_name: str = Field("tierlane", description="the OpenTelemetry service.name of spans and metrics")
    tracing: bool = Field(True, description="OpenTelemetry spans (exported where OTEL_* names an endpoint)")
    metrics: bool = Field(True, description="Prometheus /metrics and OpenTelemetry metrics")
    metering: bool = Field(True, description="ledger rows, cost attribution and budgets")
    record_content: bool = Field(False, description="record prompt and answer text on spans (never, unless true)")
    tenants: list[str] = Field(
        default_factory=list, description="tenant label values allowed on /metrics; any other is reported as other")
    apps: list[str] = Field(default_factory=list, description="app label values allowed on /metrics; any other is reported as other")
    metrics_auth: Literal["admin", "none"] = Field(
        "admin", description="GET /metrics: admin = needs a global admin key (open mode: anyone); none = public"
    )
    loop_interval_ms: float = Field(
        25.0, ge=0, description="period of the event-loop stall timer (metrics on); 0 = no stall metrics"
    )
    loop_stall_ms: float = Field(100.0, gt=0, description="a loop tick this late counts as a stall")
    ledger_retention_hours: float | None = Field(
        168.0, gt=0, description="raw ledger rows (one per request) are kept this long, then only their hourly and daily "
        "totals: usage and dashboard totals stay, request listings and exact percentiles go (null: keep every row)",
    )
    ledger_hourly_retention_days: float | None = Field(
        400.0, gt=0, description="the ledger's hourly totals are kept this long, then only daily ones (null: for ever; "
        "at least ledger_retention_hours; kept for ever while every raw row is)",
    )

    @model_validator(mode="after")
    def _hours_outlive_rows(self) -> TelemetrySettings:
        rows, days = self.ledger_retention_hours, self.ledger_hourly_retention_days
        if days is not None and rows is not None and days * 24 < rows:
            raise ValueError("telemetry.ledger_hourly_retention_days must cover ledger_retention_hours (hourly totals "
                             "are dropped only where the raw rows are gone): raise it or set it to null")  # fmt: skip
        return self


class StateSettings(_Strict):
    """Where budgets and rate limits are counted: in this process, or shared by every replica in Redis/Valkey."""

    backend: Literal["embedded", "redis"] = Field(
        "embedded", description="embedded: in-process, per replica; redis: one count for all replicas (Redis >= 7 or Valkey)"
    )
    url: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// URL of the shared store")
    key_prefix: str = Field("tierlane:", description="prefix of every key (the tenant follows as the hash tag {tenant})")
    connect_timeout_ms: float = Field(200.0, gt=0, description="longest wait for a connection to the store")
    op_timeout_ms: float = Field(100.0, gt=0, description="no request waits on the store longer than this")
    on_outage: Literal["deny", "local_share", "allow"] | None = Field(
        None,
        description="store down or slow: local_share (null: the default) = admit against this replica's share of what "
        "was left; allow = against this replica's own limits (see fallback_limits); deny = 503 with Retry-After",
    )
    on_store_error: Literal["allow", "deny"] | None = Field(
        None, description="older name: deny = on_outage deny, allow = on_outage allow (used when on_outage is not set)"
    )
    fallback_limits: Literal["local", "none"] = Field(
        "local", description="with on_outage allow: local = each replica enforces the limits alone meanwhile; none = no check"
    )
    heartbeat_s: float = Field(5.0, gt=0, description="how often a replica tells the store it is alive (replicas for local_share)")
    hold_ttl_s: float = Field(900.0, gt=0, description="a reservation no replica settled (it died) is released after this")
    stream_batch_tokens: int = Field(32, ge=1, description="streams are charged to the store every this many tokens")
    stream_batch_ms: float = Field(250.0, ge=0, description="... or this often, whichever comes first")
    cache_stream_max_len: int = Field(
        100_000,
        ge=1000,
        description="the semantic cache's vector stream keeps about this many events (replicas follow it; one that starts, "
        "or falls further behind, catches up from a snapshot of the entries)",
    )

    @property
    def outage(self) -> Literal["deny", "local_share", "allow"]:
        """What limits do while the store is unreachable: on_outage, else the older on_store_error, else local_share."""
        return self.on_outage or self.on_store_error or "local_share"

    @field_validator("url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("state.url must start with redis://, rediss:// or unix://")
        return value

    @field_validator("key_prefix")
    @classmethod
    def _no_hash_tag(cls, value: str) -> str:
        if "{" in value or "}" in value:
            raise ValueError("state.key_prefix must not contain { or }: the tenant is the hash tag")
        return value


class ResponsesSettings(_Strict):
    """Stored responses of the Responses API (`store: true`, the API's default)."""

    ttl_s: float = Field(30 * 86400.0, gt=0, description="a stored response is deleted this long after it was made")
    max_records_per_tenant: int = Field(
        10_000, ge=1, description="stored responses one tenant may hold; a request with store: true past it is a 429 "
        "insufficient_quota (store: false, DELETE or expiry make room)")
    max_bytes_per_tenant: int = Field(
        256 * 1024 * 1024, ge=1024, description="bytes of stored responses one tenant may hold (the same 429 past it)")
    max_bytes_total: int = Field(
        4 * 1024 * 1024 * 1024, ge=1024, description="bytes of stored responses all tenants together may hold in the "
        "SQLite store (each distinct input counted once per tenant); a request with store: true past it is a 507 "
        "response_store_full, checked like the tenant quota (Redis: bounded by its own maxmemory)")
    reserve_output_bytes: int = Field(
        64 * 1024, ge=0, description="a request with store: true reserves its body's size plus this, for its answer, "
        "against the quotas until its record is stored (then its real size counts) or it fails (then it is released)")


class BatchSettings(_Strict):
    """The Batch API: jobs whose lines run through the pipeline at batch priority, kept in state_dir (embedded state only)."""

    enabled: bool = Field(True, description="serve the Batch API endpoints and run their jobs")
    concurrency: int = Field(
        2, ge=1, le=256, description="lines of all jobs in flight at once; kept small so batch work never crowds out "
        "interactive requests until flow control (priority classes at the upstreams) lets it fill idle capacity")
    window_s: float = Field(
        86400.0, gt=0, description="how long a job may run (OpenAI's completion_window 24h, Anthropic's 24 hours); lines "
        "not answered by then are expired and the job ends with what is done")
    deduplicate: bool = Field(
        True, description="identical lines of one job (same endpoint and body) are answered once and share that "
        "answer (one model call, one ledger row); false: each runs on its own (sampling on purpose)")
    max_file_bytes: int = Field(100 * 1024 * 1024, ge=1024, description="largest input file (POST /v1/files, 400 past it)")
    max_file_lines: int = Field(50_000, ge=1, description="most lines one input file (or Anthropic batch) may hold")
    max_bytes_per_tenant: int = Field(
        1024 * 1024 * 1024, ge=1024, description="bytes of files (inputs and results) one tenant may hold; an upload past "
        "it is a 429 insufficient_quota (DELETE files or wait for them to expire)")
    max_queued_lines_per_tenant: int = Field(
        100_000, ge=1, description="lines not yet answered across one tenant's jobs; a job that would pass it is a 429")
    max_active_jobs_per_tenant: int = Field(
        16, ge=1, description="jobs of one tenant not yet ended; one more is a 429 until one ends")
    retention_s: float = Field(
        30 * 86400.0, gt=0, description="files, and jobs that ended, are deleted this long after they were made "
        "(OpenAI's batch files expire after 30 days; Anthropic keeps results 29 days)")


class ApisSettings(_Strict):
    """What the front doors (Messages, Responses) do with fields a chat upstream cannot take."""

    unknown_fields: Literal["drop", "reject"] = Field(
        "drop", description="a field the gateway does not know (a newer client's): drop it and record its name, or 400")
    hosted_tools: Literal["drop", "reject"] = Field(
        "drop", description="a tool the provider runs (web_search, file_search, code_interpreter, mcp, ...): drop it "
        "and record it (the model does not call it), or 400")


class Settings(_Strict):
    """Everything the gateway is configured with."""

    server: ServerSettings = Field(default_factory=ServerSettings)
    state_dir: Path = Field(Path(".tierlane/state"), description="cache entries, vectors, ledger, stored responses (TIERLANE_STATE_DIR)")
    auth: AuthSettings = Field(default_factory=AuthSettings)
    upstreams: list[UpstreamSettings] = Field(default_factory=list)
    pools: dict[str, PoolSettings] = Field(default_factory=dict)
    edge: EdgeSettingsModel = Field(default_factory=EdgeSettingsModel)
    embedder: EmbedderSettings = Field(default_factory=EmbedderSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    state: StateSettings = Field(default_factory=StateSettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    apis: ApisSettings = Field(default_factory=ApisSettings)
    batches: BatchSettings = Field(default_factory=BatchSettings)
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="client model name (globs: * ? [..]) -> auto, a lane's model or an upstream model; "
        "exact names first, then globs in order; a glob never renames a model the gateway serves by name",
    )
    policy_file: Path | None = Field(None, description="operator policy YAML merged over policies/defaults/*.yaml (TIERLANE_POLICY)")
    policy: dict[str, Any] = Field(default_factory=dict, description="inline policy sections")

    @model_validator(mode="after")
    def _open_only_on_loopback(self) -> Settings:
        if self.auth.mode == "open" and not self.auth.allow_open_on_network and not is_loopback(self.server.host):
            raise ValueError(
                f"auth.mode is open (every caller is an admin of tenant 'default') but server.host "
                f"{self.server.host!r} is not a loopback address; use auth.mode: keys (see `tierlane hash-key`), "
                "listen on 127.0.0.1, or accept the exposure with auth.allow_open_on_network: true "
                "(TIERLANE_ALLOW_OPEN_ON_NETWORK=1)"
            )
        return self

    @staticmethod
    def source_file(path: str | Path | None = None, *, env: Mapping[str, str] | None = None) -> str | Path | None:
        """The settings file `load` reads: `path`, else $TIERLANE_CONFIG, else none (the embedded defaults)."""
        env = os.environ if env is None else env
        return path or env.get("TIERLANE_CONFIG") or None

    @staticmethod
    def pull_command(path: str | Path | None = None, *, env: Mapping[str, str] | None = None) -> str:
        """The `tierlane edge pull` command line that reads the same settings file as `load(path)`."""
        import shlex

        source = Settings.source_file(path, env=env)
        return "tierlane edge pull" + (f" --config {shlex.quote(str(source))}" if source else "")

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
        data: dict[str, Any] = yaml.safe_load((resources.files("gateway") / "defaults.yaml").read_text("utf-8"))
        path = cls.source_file(path, env=env)
        if path:
            with open(path, encoding="utf-8") as fh:
                data = _deep_merge(data, yaml.safe_load(fh) or {})
        data = _deep_merge(data, _from_env(env))
        if overrides:
            data = _deep_merge(data, overrides)
        auth = data.get("auth")
        if isinstance(auth, Mapping) and isinstance(auth.get("keys") or [], list):
            inline = list(auth.get("keys") or [])
            places = [f"auth.keys[{i}]" for i in range(len(inline))]
            if auth.get("keys_file"):
                from_file = read_keys_file(auth["keys_file"])
                places += [f"auth.keys_file {str(auth['keys_file'])!r} entry {j}" for j in range(len(from_file))]
                inline += from_file
                data["auth"] = {**auth, "keys": inline}
            check_unique_digests(inline, places)
        settings = cls.model_validate(data)
        for upstream in settings.upstreams:
            if upstream.api_key_env:
                upstream.api_key = env.get(upstream.api_key_env)
        return settings


def check_unique_digests(entries: list[Any], places: list[str]) -> None:
    """Refuses a key digest listed twice (compared case-insensitively), naming both places.

    NOTE: a duplicate is never resolved by order: the later entry could silently make a client
    key an admin of another tenant.
    """
    seen: dict[str, str] = {}
    for entry, place in zip(entries, places):
        digest = entry.get("sha256") if isinstance(entry, Mapping) else None
        if not isinstance(digest, str):
            continue  # the model validation names what is wrong with it
        digest = digest.strip().lower()
        if digest in seen:
            raise ValueError(
                f"the API key digest {digest[:12]}... is listed twice: {seen[digest]} and {place}; "
                "each key may appear once across auth.keys and auth.keys_file"
            )
        seen[digest] = place


def read_keys_file(path: str | Path) -> list[Any]:
    """The key entries of an `auth.keys_file`: a YAML or JSON list of {sha256, tenant, app, admin,
    admin_scope}, or a mapping with such a list under `keys`. Entries are validated as `auth.keys`."""
    try:
        with open(path, encoding="utf-8") as fh:
            loaded = yaml.safe_load(fh)
    except OSError as exc:
        raise ValueError(f"auth.keys_file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"auth.keys_file {str(path)!r} is not valid YAML or JSON: {exc}") from None
    if isinstance(loaded, Mapping) and set(loaded) == {"keys"}:
        loaded = loaded["keys"]
    if loaded is None:
        return []
    if not isinstance(loaded, list):
        raise ValueError(f"auth.keys_file {str(path)!r} must hold a list of keys (or a mapping with `keys:`)")
    return loaded


def hub_token(env: Mapping[str, str] | None = None) -> str | None:
    """The hub token `tierlane edge pull` sends for a gated or private repository (HF_TOKEN); never a setting."""
    env = os.environ if env is None else env
    return env.get("HF_TOKEN") or None


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
    auth: dict[str, Any] = {}
    if "TIERLANE_AUTH_MODE" in env:
        auth["mode"] = env["TIERLANE_AUTH_MODE"]
    if env.get("TIERLANE_API_KEYS_FILE"):
        auth["keys_file"] = env["TIERLANE_API_KEYS_FILE"]
    if env.get("TIERLANE_ALLOW_OPEN_ON_NETWORK"):
        auth["allow_open_on_network"] = env["TIERLANE_ALLOW_OPEN_ON_NETWORK"]  # validated as a boolean
    if auth:
        out["auth"] = auth
    state: dict[str, Any] = {}
    if env.get("TIERLANE_STATE_BACKEND"):
        state["backend"] = env["TIERLANE_STATE_BACKEND"]  # validated: embedded or redis
    if env.get("TIERLANE_STATE_URL"):
        state["url"] = env["TIERLANE_STATE_URL"]
    if state:
        out["state"] = state
    if "TIERLANE_POLICY" in env:
        out["policy_file"] = env["TIERLANE_POLICY"]
    if "TIERLANE_EDGE" in env:
        out["edge"] = {"enabled": env["TIERLANE_EDGE"].lower() not in ("0", "off", "false", "no")}
    # The model: TIERLANE_EDGE_MODEL (or its older name TIERLANE_EDGE_MODEL_PATH) replaces both
    # edge.model and edge.model_path of the file; TIERLANE_EDGE_MODEL wins where both are set.
    for name in ("TIERLANE_EDGE_MODEL_PATH", "TIERLANE_EDGE_MODEL"):
        if env.get(name):
            out.setdefault("edge", {}).update(model=env[name], model_path=None)
    if env.get("TIERLANE_EDGE_MODEL_SHA256"):
        out.setdefault("edge", {})["model_sha256"] = env["TIERLANE_EDGE_MODEL_SHA256"]
    if env.get("TIERLANE_MODEL_CACHE"):
        out.setdefault("edge", {})["model_cache_dir"] = env["TIERLANE_MODEL_CACHE"]
    if env.get("HF_ENDPOINT"):  # the hub's own variable, for `tierlane edge pull`
        out.setdefault("edge", {})["hub_endpoint"] = env["HF_ENDPOINT"]
    if "TIERLANE_EDGE_PROBE_CACHE_DIR" in env:
        out.setdefault("edge", {})["probe_cache_dir"] = env["TIERLANE_EDGE_PROBE_CACHE_DIR"] or None
    if env.get("TIERLANE_EDGE_PROBE_CACHE_TTL_S"):
        out.setdefault("edge", {})["probe_cache_ttl_s"] = float(env["TIERLANE_EDGE_PROBE_CACHE_TTL_S"])
    if "TIERLANE_EMBEDDER_CACHE_DIR" in env:
        out["embedder"] = {"cache_dir": env["TIERLANE_EMBEDDER_CACHE_DIR"]}
    if env.get("TIERLANE_MODEL_ALIASES"):
        # "claude-*=auto,gpt-5*=auto": the coding agents' model names onto what the gateway serves
        aliases = {}
        for pair in env["TIERLANE_MODEL_ALIASES"].split(","):
            name, sep, target = pair.partition("=")
            if not sep or not name.strip() or not target.strip():
                raise ValueError(f"TIERLANE_MODEL_ALIASES: {pair.strip()!r} is not NAME=TARGET")
            aliases[name.strip()] = target.strip()
        out["model_aliases"] = aliases
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
