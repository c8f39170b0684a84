"""Settings of the embedded llama.cpp engine and where its bundled default model lives."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edge_engine.model_source import (
    BUNDLED,
    BUNDLED_FILE,
    BUNDLED_PACKAGE,
    DEFAULT_CACHE_DIR,
    DEFAULT_ENDPOINT,
    PULL_COMMAND,
    HubFile,
    ResolvedModel,
    bundled_model_path,
    check_sha256,
    parse_model,
    resolve_model,
    resolve_model_path,
)

__all__ = ["BUNDLED_FILE", "BUNDLED_PACKAGE", "EdgeSettings", "GrammarSettings", "SpeculativeSettings", "bundled_model_path"]

KV_CACHE_TYPES = ("q8_0", "q4_0", "f16", "f32")  # llama.cpp KV cell types this engine accepts


def attention_problem(flash_attn: bool, kv_cache_type: str | None, batch_invariant: bool, n_gpu_layers: int) -> str | None:
    """Why this attention set-up cannot run as asked, or None (kv_cache_type None: the default for it)."""
    if kv_cache_type is None:
        return None
    if kv_cache_type not in KV_CACHE_TYPES:
        return f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}"
    quantized = kv_cache_type not in ("f16", "f32")
    if quantized and not flash_attn:
        return f"kv_cache_type {kv_cache_type} needs flash_attn: llama.cpp cannot quantize the V cache without it (use f16)"
    if flash_attn and batch_invariant and not quantized and n_gpu_layers == 0:
        # NOTE: over an f16/f32 cache, ggml's CPU flash attention takes a split-KV path for one
        # query in one stream with >= 512 cells and a tiled path for >= 64 queries, so a
        # sequence's numbers would depend on what shares its step. Over a quantized cache it
        # always takes the per-row path, which skips masked cells exactly.
        return (
            "batch_invariant with flash_attn needs a quantized kv_cache_type (q8_0): llama.cpp's CPU "
            "flash attention over an f16/f32 cache changes kernels with the step's shape; or set flash_attn false"
        )
    return None


class SpeculativeSettings(BaseModel):
    """Prompt-lookup speculative decoding for greedy requests (the `edge.speculative` section).

    A greedy sequence's last n-gram is looked up in its own prompt and output; the tokens that
    followed it there are decoded as a draft in the same step, and the longest prefix the model
    agrees with (plus its own next token) is kept. Output is token-for-token the same as without
    it (tests/unit/edge_engine/test_speculative.py, bench/edge_speculative.py). On CPU a draft
    row costs ~0.4-0.8 of a one-token step (SmolLM2-135M Q4_1, 2 threads; timed at start), so a
    draft pays only where it is mostly kept: each sequence drafts as many tokens as pay at its
    acceptance (by match length and its own record), and steps with `max_batch` or more
    decoding sequences do not speculate. Exact only with batch_invariant, flash_attn and no GPU
    layers (see the NOTE in scheduler.py): drafts are off in any other set-up.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="draft tokens from the request's own text (greedy requests only)")
    max_draft: int = Field(10, ge=1, le=64, description="most draft tokens per sequence per step")
    ngram_sizes: list[int] = Field(
        default_factory=lambda: [3, 2], min_length=1, description="n-gram lengths looked up, tried in this order"
    )
    min_acceptance: float = Field(
        0.5, ge=0.0, le=1.0, description="no drafts where the expected share of draft tokens kept is lower"
    )
    # Measured with bench/edge_speculative.py (input-grounded prompts, 2 shared threads, drafts
    # forced at any batch, best of 2): vs none 1.13x at 2 concurrent requests and 0.975x at 4 in
    # one run, 1.03x and 1.02x in the next (run-to-run noise ~10%). A draft row costs the same
    # whatever shares its step while batching makes each plain token cheaper, so drafts stop at 4.
    max_batch: int = Field(4, ge=1, description="no speculation in steps with this many decoding sequences or more")

    @field_validator("ngram_sizes")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(n < 1 for n in value):
            raise ValueError("ngram_sizes must be positive")
        return value


class GrammarSettings(BaseModel):
    """What one JSON-mode request may make the engine do (the `edge.grammar` section).

    Checked before anything reaches llama.cpp, in the one path the capability check and the
    engine share (edge_engine/grammar.py): the schema before it is converted (its size, enum
    values, and every length, count or `{m,n}` bound, which the converter writes out once per
    repetition), the grammar after (its size, rules, nesting, alternatives), then llama.cpp's own
    parse, off the scheduler thread with a deadline. Past any bound `auto` traffic goes upstream
    (`capability:json_schema`) and a request pinned to the edge gets a 400 `grammar_too_complex`.
    """

    model_config = ConfigDict(extra="forbid")

    max_schema_bytes: int = Field(32_768, ge=256, description="largest response_format, as compact JSON")
    max_enum_values: int = Field(512, ge=1, description="most enum and const values in one schema, all counted")
    max_bound: int = Field(
        1000, ge=1, description="largest minLength/maxLength/minItems/maxItems/{m,n} bound (a pattern's nested bounds multiply)"
    )
    max_grammar_bytes: int = Field(65_536, ge=1024, description="largest grammar the schema may become")
    max_rules: int = Field(1000, ge=1, description="most rules in that grammar")
    max_depth: int = Field(1100, ge=8, description="deepest nesting of groups in one rule (llama.cpp parses it recursively)")
    max_alternatives: int = Field(2048, ge=1, description="most alternatives (|) in the grammar: each is checked per token")
    compile_timeout_s: float = Field(2.0, gt=0, description="longest a grammar may take to convert and parse")
    cache_entries: int = Field(256, ge=0, description="compiled grammars (and refusals) kept, by schema")
    max_sampling_ms: float = Field(
        10_000.0, gt=0, description="grammar sampling time one request may use in all; past it the request fails"
    )


def _default_threads() -> int:
    # NOTE: one core is left to the event loop and the embedder: llama.cpp's spinning threads
    # collapse throughput when they share every core with other work.
    return max(1, (os.cpu_count() or 1) - 1)


class EdgeSettings(BaseModel):
    """How the edge engine loads its model and shares its KV cache between requests.

    The one source of these settings and their defaults: the gateway's `edge` section extends
    this model (adding only its own fields), and `gateway/defaults.yaml` lists these defaults
    (a test keeps the two equal). Built by keyword (`EdgeSettings(n_ctx=512, n_threads=1)`) or
    validated from a mapping; a misspelt field is an error, not ignored.
    """

    model_config = ConfigDict(extra="forbid")

    # Where the model comes from (edge_engine/model_source.py, docs/edge-model.md). A hub file is
    # downloaded by `tierlane edge pull`, never by the engine: one missing from the cache, or any
    # file unlike its pinned digest, stops the start with the command to run.
    model: str = Field(
        BUNDLED, min_length=1,
        description="bundled (SmolLM2-135M-Instruct Q4_1), a GGUF path, or hf://org/repo[@revision]/file.gguf",
    )
    model_sha256: str | None = Field(
        None, description="the GGUF's sha256: required for a hub file, checked at start for a path when given"
    )
    model_cache_dir: str = Field(
        DEFAULT_CACHE_DIR, description="where hub files are kept, <org>/<repo>/<revision>/<file> (TIERLANE_MODEL_CACHE)"
    )
    hub_endpoint: str = Field(DEFAULT_ENDPOINT, description="where `tierlane edge pull` downloads hub files from (HF_ENDPOINT)")
    model_path: str | None = Field(None, description="older name of `model` for a GGUF path (null: `model` decides)")
    model_name: str = Field("edge", min_length=1, description="the name clients use to reach this lane")
    # Longest prompt + completion of one request, in tokens. With batch_invariant every
    # sequence id (slots + prefix_slots) owns a KV stream of n_ctx cells, so the KV cache
    # holds n_ctx * n_seq_max cells (SmolLM2-135M: ~12 KB per cell at q8_0, ~23 KB at f16); without it,
    # all sequences share one pool of n_ctx cells.
    # NOTE: 2048 by default: (8 + 2) x 2048 cells x 12 KB is ~250 MB of KV cache at q8_0.
    n_ctx: int = Field(2048, ge=256, description="KV cells per sequence: longest prompt + completion")
    n_threads: int = Field(
        default_factory=_default_threads, ge=1, description="llama.cpp threads; null or unset: all cores but one"
    )
    n_batch: int = Field(512, ge=8, description="most tokens one llama_decode call may carry (raised to slots + prefill_chunk)")
    slots: int = Field(8, ge=1, description="sequences decoded together (llama.cpp n_seq_max less the prefix slots)")
    # Prompt ingestion. A request that arrives while a prompt step is being decoded waits for
    # that step, so a step's duration, not its token count, is what bounds interference. A
    # scratch prompt is timed once at start, at position 0 and 512 cells deep (attention reads
    # every earlier cell: with flash attention over q8_0 a prompt token costs ~3.7 ms at the
    # start and ~9 ms 1,500 cells deep on 2 threads), and each piece of a prompt is then sized
    # from where it starts to take about `prefill_step_ms`, at most `prefill_chunk` tokens.
    # Sizes depend only on positions, never on load. The prompt with the least ingestion time
    # left goes first. bench/edge_engine.py --workloads essay --levels 8 --alone 8
    # --long-rounds 2 --prefill-step-ms N, 2 CPU threads, one run each (the interference
    # ratio moves by ~0.5 between runs):
    #   step ms   essay tok/s vs sequential   short TTFT during a long prompt / alone
    #     100               1.04                            2.77
    #     150               1.20                            1.85
    #     250               1.24                            2.15
    # None: always `prefill_chunk` tokens.
    prefill_chunk: int = Field(256, ge=1, description="most prompt tokens in one step")
    prefill_step_ms: float | None = Field(
        150.0, gt=0, description="prompt steps are sized to take about this long (a new request waits at most one)"
    )
    # The step and draft costs above are timed at start (~5 s on one thread, most of it a
    # 512-cell scratch prompt) and kept in this directory per model file, llama.cpp build, CPU
    # and context shape, so a restart or a new replica on the same machine reuses them while
    # they are younger than probe_cache_ttl_s (edge_engine/start_probes.py). null: timed at
    # every start.
    probe_cache_dir: str | None = Field(
        "~/.cache/tierlane/edge", description="where the start probes' costs are kept between starts (null: not kept)"
    )
    probe_cache_ttl_s: float = Field(
        86400.0, ge=0, description="kept start-probe costs older than this are timed again"
    )
    # While prompts are being ingested, running sequences get a decode step at least this often
    # (prompt steps fill the time between). 0: strict alternation of prompt and decode steps.
    # Larger values give new requests their first token sooner and stall running streams longer.
    decode_gap_ms: float = Field(
        100.0, ge=0, description="while prompts are ingested, running sequences still decode at least this often"
    )
    n_gpu_layers: int = Field(0, ge=-1, description="layers offloaded (-1: all); >0 needs a CUDA or Metal build")
    max_queue: int = Field(64, ge=1, description="requests waiting for a slot before new ones get 503")
    max_queue_wait_s: float = Field(30.0, gt=0, description="a request waiting longer than this gets 503")
    default_max_tokens: int = Field(256, ge=1, description="when the request gives no max_tokens")
    # Greedy text independent of concurrent traffic and of prefix reuse (one KV stream per
    # sequence, so each sequence's cells keep the same indices and SIMD reduction order).
    # False: one shared cell pool, n_seq_max times less KV memory, but logits drift ~1 with
    # where other requests' cells lie, and greedy text may change from one run to the next.
    batch_invariant: bool = Field(
        True, description="greedy output independent of other traffic (one KV stream per sequence; more memory)"
    )
    prefix_reuse: bool = Field(True, description="share KV of common prompt prefixes (exact under batch_invariant)")
    prefix_slots: int = Field(2, ge=0, description="finished prompts kept in the KV cache for prefix reuse")
    min_prefix_tokens: int = Field(16, ge=1, description="shorter common prefixes are recomputed")
    # Flash attention: one fused kernel instead of KQ, softmax and KQV as three passes; on 2 CPU
    # threads 8 decoding streams run 1.13x faster (bench/edge_decode.py: 126 vs 111.5 tok/s),
    # but a prompt token deep in a long prompt costs more (~10 vs ~6 ms at 1,500 cells). Its
    # CPU kernel picks a split-KV or tiled path by the step's shape when the KV cache is
    # f16/f32, which breaks batch_invariant; with a quantized cache it always takes the
    # per-row path, so batch_invariant with flash_attn needs kv_cache_type q8_0 (or q4_0).
    # Without flash attention llama.cpp keeps V transposed and cannot quantize it: f16 then.
    flash_attn: bool = Field(
        True, description="fused attention kernel (1.13x decode throughput at 8 streams on 2 CPU threads)"
    )
    # KV cache cell type: q8_0, q4_0, f16 or f32. None: q8_0 with flash attention (half of
    # f16's memory per cell; its logits against f16's in bench/edge_kv_quality.py), else f16.
    kv_cache_type: str | None = Field(
        None,
        description="KV cell type (q8_0, q4_0, f16, f32); null: q8_0 with flash attention (half f16's "
        "memory; quality in bench/edge_kv_quality.py), f16 without",
    )
    # True: a prompt chunk shares each step with the running decodes (one pass over the weights
    # in the shared pool). Under batch_invariant llama.cpp splits such a step into passes of
    # equal tokens per sequence, so it gains little and the chunk is cut again by whatever
    # shares the step, which moves greedy text: keep False where exact output matters.
    mix_prefill: bool = Field(False, description="prompt chunks share steps with decodes (faster, not exact)")
    extra_buffers: bool = Field(
        False, description="weight repacking (AMX/AVX512); off: it faults where AMX is denied"
    )
    seed: int = Field(0xC0FFEE, ge=0, description="default sampler seed when the request gives none")
    speculative: SpeculativeSettings = Field(
        default_factory=SpeculativeSettings, description="prompt-lookup speculative decoding (exact, greedy requests)"
    )
    grammar: GrammarSettings = Field(
        default_factory=GrammarSettings, description="bounds on JSON-mode grammars (per request)"
    )
    # Fairness between tenants (a request's `scope`, its tenant): no tenant holds every slot or
    # fills the whole queue, and a free slot goes to the tenant with the fewest running.
    tenant_slot_share: float = Field(
        0.75, gt=0, le=1, description="most of the slots one tenant may hold at once (at least one)"
    )
    tenant_queue_share: float = Field(
        0.75, gt=0, le=1, description="most of the queue (max_queue) one tenant's waiting requests may take"
    )
    lone_tenant_reserve: int = Field(
        1, ge=0, description="slots a tenant alone leaves free, so a tenant arriving next is admitted at the next step "
        "instead of after a running request ends (0: a lone tenant may take every slot)"
    )
    max_request_s: float = Field(
        300.0, gt=0, description="longest a request may run in the scheduler; then it ends with finish_reason length"
    )

    @field_validator("n_threads", mode="before")
    @classmethod
    def _threads_default(cls, value: Any) -> Any:
        # NOTE: null kept meaning "the default", as the gateway's YAML has always documented it.
        return _default_threads() if value is None else value

    @field_validator("model_sha256")
    @classmethod
    def _digest(cls, value: str | None) -> str | None:
        return check_sha256(value) if value else None

    @model_validator(mode="after")
    def _resolve(self) -> Self:
        if self.model_path:
            if self.model not in (BUNDLED, self.model_path):
                raise ValueError(
                    f"edge.model ({self.model}) and edge.model_path ({self.model_path}) name two models; "
                    "keep edge.model only (model_path is its older name)"
                )
            self.model = self.model_path
        source = parse_model(self.model)  # a malformed hf:// name fails here, at load
        if source.kind == "hub" and not self.model_sha256:
            raise ValueError(
                f"edge.model {self.model} is a hub file: pin its sha256 in edge.model_sha256 (the hub lists it on the "
                "file's page; `sha256sum FILE` prints it for a copy you trust)"
            )
        if self.kv_cache_type is None:
            self.kv_cache_type = "q8_0" if self.flash_attn else "f16"
        problem = attention_problem(self.flash_attn, self.kv_cache_type, self.batch_invariant, self.n_gpu_layers)
        if problem:
            raise ValueError(problem)
        if self.n_batch < self.slots + self.prefill_chunk:
            # NOTE: one step carries a decode token per slot plus a prefill chunk.
            self.n_batch = self.slots + self.prefill_chunk
        return self

    @property
    def hub_file(self) -> HubFile | None:
        """The hub file `model` names, or None for the bundled model or a path."""
        return parse_model(self.model).hub

    def resolved_model_path(self, pull_command: str = PULL_COMMAND) -> Path:
        """The GGUF file to load; never downloads. Missing or unlike model_sha256: ModelUnavailable."""
        return resolve_model_path(self.model, self.model_sha256, self.model_cache_dir, pull_command=pull_command)

    def resolved_model(self, pull_command: str = PULL_COMMAND) -> ResolvedModel:
        """The GGUF file to load and its sha256 (hashed once per file version, remembered in the model cache)."""
        return resolve_model(self.model, self.model_sha256, self.model_cache_dir, pull_command=pull_command)

    @property
    def n_seq_max(self) -> int:
        return self.slots + self.prefix_slots

    @property
    def tenant_max_slots(self) -> int:
        return max(1, int(self.slots * self.tenant_slot_share))

    @property
    def lone_tenant_max_slots(self) -> int:
        return max(1, self.slots - self.lone_tenant_reserve)

    @property
    def tenant_max_queue(self) -> int:
        return max(1, int(self.max_queue * self.tenant_queue_share))
