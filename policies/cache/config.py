"""The cache policy section, parsed into a typed config (one per tenant/app/model/route)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from policies.cache.error_bound import BoundParams
from policies.cache.scope import ScopeRules
from policies.cache.verify import VerifyConfig, VerifySection
from policies.policy import Policy
from policies.sections import OverrideRule, StrictSection, parse_section

# Request fields known not to change the answer (see policies/defaults/cache.yaml).
_NEUTRAL_PARAMS = (
    "model", "stream", "stream_options", "user", "metadata", "store", "service_tier",
    "max_tokens", "max_completion_tokens", "prompt_cache_key", "safety_identifier",
)
_MATCH_KEYS = frozenset({"tenant", "app", "model", "route"})  # what SemanticCache.config_for resolves with


Operation = Literal["chat", "completions", "embeddings"]


def _chat_only() -> list[Operation]:
    # NOTE: a function, not a lambda: mypy infers a lambda's `["chat"]` as list[str] here.
    return ["chat"]


class CachePolicyError(ValueError):
    """The cache section of the policy is malformed; raised at start-up, not per request."""




class CacheSection(StrictSection):
    """The `cache` policy section as written. Its defaults are the shipped policy's.

    NOTE: the one source of these defaults; policies/defaults/cache.yaml lists the same values
    for operators to read, and a test keeps the two equal.
    """

    enabled: bool = True
    operations: list[Operation] = Field(
        default_factory=_chat_only, min_length=1, description="operations whose answers are cached"
    )
    exact: bool = Field(True, description="hash of the normalised request, tried before the semantic search")
    semantic: bool = True
    # 0.02 above the lowest value where precision >= 0.97 holds on STS-B and GPTCache alike
    # (bench/cache_quality.py).
    threshold: float = Field(0.80, ge=-1.0, le=1.0, description="cosine a candidate needs before verification")
    candidates: int = Field(4, ge=1, description="best candidates verified, most similar first")
    ttl_s: float = Field(86_400, ge=0, description="entries expire this long after they were stored (0: never served again)")
    max_entries: int = Field(100_000, ge=1, description="least recently used entries are evicted above this")
    # The sidecar's limit (deploy/k8s/sidecar.yaml) is 2 GiB and the gateway there runs at ~0.7 GB
    # without the cache; 256 MiB leaves ~1 GiB for requests in flight and the allocator's slack.
    max_memory_bytes: int | None = Field(
        268_435_456, ge=1 << 20,
        description="the cache's memory in this process (vectors, their maps; shared backend: also what it knows "
        "of every entry) is kept under this, least recently used first; null: no bound",
    )  # fmt: skip
    max_disk_bytes: int | None = Field(
        1_073_741_824, ge=1 << 20,
        description="the entries' rows in the SQLite file (responses, texts, vectors, keys) are kept under this, "
        "least recently used evicted first; null: no bound (embedded backend; the shared one keeps them in Redis)",
    )  # fmt: skip
    max_temperature: float = Field(0.7, ge=0, description="above this the answer is a sample: not cached")
    share_across_tenants: bool = Field(False, description="true only for public content")
    max_text_chars: int = Field(4000, ge=1, description="longer last turns are matched exactly, never semantically")
    neutral_params: list[str] = Field(
        default_factory=lambda: list(_NEUTRAL_PARAMS), description="request fields that never change the answer"
    )
    verify: VerifySection = Field(default_factory=VerifySection)
    max_error_rate: float | None = Field(
        None, gt=0.0, lt=1.0,
        description="bound on the served semantic hits' error (policies/cache/error_bound.py); null: off",
    )
    error_confidence: float = Field(0.95, gt=0.5, lt=1.0, description="one-sided confidence of that bound")
    error_sample_rate: float = Field(
        0.2, gt=0.0, le=1.0, description="share of served semantic hits the shadow stage re-asks upstream to judge"
    )
    overrides: list[OverrideRule] = Field(default_factory=list)


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """The resolved `cache` policy for one request (built from `CacheSection`, which has the defaults)."""

    enabled: bool
    operations: frozenset[str]
    exact: bool
    semantic: bool
    threshold: float
    candidates: int
    ttl_s: float
    max_entries: int
    max_text_chars: int
    rules: ScopeRules
    verify: VerifyConfig
    bound: BoundParams | None = None  # cache.max_error_rate set: the online error bound's parameters
    max_memory_bytes: int | None = None
    max_disk_bytes: int | None = None

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> CacheConfig:
        """The config of a resolved section (missing keys: the defaults).

        Given the raw policy section, with its `overrides`, each override is validated too and
        the base config is returned: that is the start-up check. Raises CachePolicyError.
        """
        parsed = parse_section(CacheSection, section, "cache", _MATCH_KEYS, CachePolicyError)
        return cls(
            enabled=parsed.enabled,
            operations=frozenset(parsed.operations),
            exact=parsed.exact,
            semantic=parsed.semantic,
            threshold=parsed.threshold,
            candidates=parsed.candidates,
            ttl_s=parsed.ttl_s,
            max_entries=parsed.max_entries,
            max_text_chars=parsed.max_text_chars,
            rules=ScopeRules(
                max_temperature=parsed.max_temperature,
                neutral_params=frozenset(parsed.neutral_params),
                share_across_tenants=parsed.share_across_tenants,
            ),
            verify=(verify := parsed.verify.config()),
            bound=None if parsed.max_error_rate is None else bound_params(
                parsed.max_error_rate, parsed.error_confidence, parsed.error_sample_rate, verify, parsed.threshold
            ),
            max_memory_bytes=parsed.max_memory_bytes,
            max_disk_bytes=parsed.max_disk_bytes,
        )


# Where loosening stops: a verifier probability of 0.5 (the verifier's "as likely as not"), or a
# cosine this far below the shipped gate (verifier off).
PROBABILITY_FLOOR = 0.5
COSINE_FLOOR_BELOW = 0.07


def bound_params(max_error_rate: float, confidence: float, sample_rate: float, verify: VerifyConfig, gate: float) -> BoundParams:
    """The bound moves the verifier's min probability when a verifier runs, the cosine gate otherwise."""
    if verify.verifier is not None:
        return BoundParams(max_error_rate, "probability", start=verify.min_probability,
                           floor=min(PROBABILITY_FLOOR, verify.min_probability), confidence=confidence,
                           sample_rate=sample_rate)  # fmt: skip
    return BoundParams(max_error_rate, "cosine", start=gate, floor=gate - COSINE_FLOOR_BELOW, confidence=confidence,
                       sample_rate=sample_rate)  # fmt: skip


class ResolvedConfigs:
    """The cache policy resolved per tenant/app/model/route, memoised (policies are immutable)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._configs: dict[tuple[str | None, ...], CacheConfig] = {}

    def resolve(self, *, tenant: str, app: str, model: str, route: str | None) -> CacheConfig:
        key = (tenant, app, model, route)
        config = self._configs.get(key)
        if config is None:
            if len(self._configs) > 4096:
                self._configs.clear()
            section = self.policy.resolve("cache", tenant=tenant, app=app, model=model, route=route)
            config = self._configs[key] = CacheConfig.from_section(section)
        return config
