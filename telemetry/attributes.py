"""Attribute names (OpenTelemetry GenAI semconv v1.37 and tierlane's own) and bounded metric labels."""

from __future__ import annotations

from collections.abc import Iterable

GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_CACHE_CREATION_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
ERROR_TYPE = "error.type"

TENANT = "tierlane.tenant"
APP = "tierlane.app"
LANE = "tierlane.lane"
REQUEST_ID = "tierlane.request_id"
API = "tierlane.api"  # the wire API a request came in through (chat, messages, responses, ...)
PRIORITY = "tierlane.priority"  # the request's class (interactive, standard, batch): flow control's order
CACHE_STATUS = "tierlane.cache.status"
CACHE_SIMILARITY = "tierlane.cache.similarity"
ROUTE_SCORE = "tierlane.route.score"
ROUTE_REASON = "tierlane.route.reason"
TIER = "tierlane.tier"  # upstream tier of an `auto` request (cost | strong), where the policy has tiers
COST = "tierlane.cost_usd"
SAVED = "tierlane.saved_usd"
SAVED_CACHE = "tierlane.saved.cache_usd"
SAVED_EDGE = "tierlane.saved.edge_usd"
SAVED_TRIM = "tierlane.saved.trim_usd"
SAVED_MASK = "tierlane.saved.mask_usd"  # observation masking: cache reads avoided less the rewrite it caused
# what the trim stage's observation masking did (or, in shadow mode, would have done) to a request
MASK_MODE = "tierlane.trim.mask_mode"
MASKED_TOKENS = "tierlane.trim.masked_tokens"
MASK_WRITE_TOKENS = "tierlane.trim.mask_rewrite_tokens"
SAVED_VS_STRONG = "tierlane.saved.vs_strong_usd"  # against everything on the strong tier
SAVED_VS_NAMED = "tierlane.saved.vs_named_usd"  # against the model the client named
USAGE_ESTIMATED = "tierlane.usage.estimated"
# the confidence cascade's check of an edge answer (auto requests; pinned ones for cache admission)
EDGE_CONFIDENCE = "tierlane.edge.confidence"
EDGE_THRESHOLD = "tierlane.edge.threshold"
EDGE_PASSED = "tierlane.edge.passed"
EDGE_ESCALATED = "tierlane.edge.escalated"
EDGE_ESCALATION_REASON = "tierlane.edge.escalation_reason"
EDGE_ESCALATED_TOKENS = "tierlane.edge.escalated_tokens"
STAGE = "tierlane.stage"

# Operation names of the GenAI conventions, by the gateway's operation.
OPERATION_NAMES = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings"}
LANES = ("cache", "edge", "upstream")
SAVING_REASONS = ("cache", "edge", "trim")
TIERS = ("cost", "strong")  # policies.router.policy.TIERS; metric label values, with NO_TIER and OTHER
NO_TIER = "none"
OTHER = "other"


class LabelBounds:
    """Maps label values onto a fixed set so metric series stay bounded: anything unlisted is `other`."""

    __slots__ = ("_tenants", "_apps", "_models")

    def __init__(self, tenants: Iterable[str], apps: Iterable[str], models: Iterable[str]) -> None:
        self._tenants = frozenset(tenants)
        self._apps = frozenset(apps)
        self._models = frozenset(models)

    def tenant(self, value: str | None) -> str:
        return value if value in self._tenants else OTHER

    def app(self, value: str | None) -> str:
        return value if value in self._apps else OTHER

    def model(self, value: str | None) -> str:
        return value if value in self._models else OTHER

    @staticmethod
    def tier(value: str | None) -> str:
        if value is None:
            return NO_TIER
        return value if value in TIERS else OTHER

    @staticmethod
    def lane(value: str | None) -> str:
        return value if value in LANES else OTHER

    @staticmethod
    def status_class(status: int) -> str:
        return f"{status // 100}xx" if 100 <= status < 600 else OTHER
