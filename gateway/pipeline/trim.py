"""Pipeline stage: trims the chat request by the resolved trim policy and records the tokens saved."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.context import TRIM_HEADER, RequestContext
from gateway.pipeline.base import TEXT_OPERATIONS
from gateway.services import Services
from policies.policy import Policy
from policies.pricing import Pricing
from policies.trim import TrimPolicy, TrimResult, trim_request
from policies.trim.agent_context import CachePrices
from policies.trim.messages import TOOL_ROLES, texts
from policies.trim.passes import HISTORY_REASON, TOOL_OUTPUT_MARK, VERBATIM_ROLES
from policies.trim.text import rewritten_before
from telemetry import attributes as attr

log = logging.getLogger(__name__)

# Requests this small are trimmed on the event loop, not on a worker thread (see small_enough_inline).
INLINE_MESSAGES = 4
INLINE_CHARS = 300
# Nor are those whose prose the lossless passes have rewritten before but for this many characters (see
# rewritten_enough): a rewrite costs about 80 us per 1,000 characters not seen before, next to nothing
# for those an earlier turn sent (memoised), and an agent's turn re-sends its whole conversation.
INLINE_NEW_CHARS = 4000


def _policy_variants(policy: Policy) -> list[dict[str, Any]]:
    """The base section and each override applied alone, so a typo fails at start-up."""
    section = policy.section("trim")
    base = {k: v for k, v in section.items() if k != "overrides"}
    variants = [base]
    for rule in section.get("overrides") or []:
        alone = {**base, "overrides": [{"match": {}, "set": rule.get("set") or {}}]}
        variants.append(Policy(sections={"trim": alone}).resolve("trim"))
    return variants


@dataclass(slots=True)
class TrimStage:
    """Applies `policies.trim` to chat requests; the header `x-tierlane-trim: off` skips one request."""

    policy: Policy
    count_tokens: Callable[[str], int] | None  # the edge lane's tokenizer; other lanes are estimated
    pricing: Pricing | None = None  # the cache prices observation masking weighs its steps with
    name: str = "trim"
    operations = TEXT_OPERATIONS
    # Parsed policies per (tenant, app, model): resolving and parsing once, not per request.
    _parsed: dict[tuple[str, str, str], TrimPolicy] = field(default_factory=dict)

    async def run(self, ctx: RequestContext) -> None:
        if ctx.operation != "chat":
            return None
        if (ctx.header(TRIM_HEADER) or "").strip().lower() == "off":
            ctx.response_headers[TRIM_HEADER] = "off"
            return None
        policy = self._policy_for(ctx.principal.tenant, ctx.principal.app, ctx.model)
        if not policy.enabled:
            ctx.response_headers[TRIM_HEADER] = "off"
            return None
        # Measured by bench/trim_savings.py (stage_cost): milliseconds for a 2k-token conversation,
        # mostly tokenizing, so it runs on a worker thread. NOTE: the trim copies nothing (each pass
        # writes a new dict where it changes a message and only reads the rest) and the loop does not
        # touch ctx.body until it returns, so the thread only reads what the loop shares with it.
        # Counted with the tokenizer of the lane the request goes to: the engine's for the edge
        # lane; upstream models' tokenizers are not at hand, so those counts are estimates.
        count = self.count_tokens if ctx.lane == "edge" else None
        prices = self._prices(ctx) if policy.agent_context.mode != "off" else None
        if count is None and (small_enough_inline(ctx.body) or rewritten_enough(ctx.body, policy)):
            # A short request, or an agent's turn whose prose earlier turns sent, trims in well under a
            # millisecond: less than the hop to a worker thread and back (about a millisecond on a busy
            # 2-core machine, bench/hot_path_profile.py), which also makes the loop wait for the GIL
            # behind that thread.
            result = trim_request(ctx.body, policy, None, prices)
        else:
            result = await asyncio.get_running_loop().run_in_executor(None, trim_request, ctx.body, policy, count,
                                                                      prices)
        if policy.agent_context.mode != "off":
            _record_mask(ctx, result, policy.agent_context.mode)
        _record(ctx, result)
        return None

    async def close(self) -> None:
        return None

    def _prices(self, ctx: RequestContext) -> CachePrices:
        """The answering model's cache prices as multiples of its input price (masking's step rule)."""
        if self.pricing is None or ctx.lane != "upstream":
            return CachePrices()
        price = self.pricing.upstream(ctx.target_model or ctx.model, ctx.pool)
        if price.input <= 0:
            return CachePrices()
        return CachePrices(read=price.cached_input / price.input, write=price.cache_write / price.input)

    def _policy_for(self, tenant: str, app: str, model: str) -> TrimPolicy:
        key = (tenant, app, model)
        policy = self._parsed.get(key)
        if policy is None:
            if len(self._parsed) >= 4096:  # bounded: model names come from clients
                self._parsed.clear()
            resolved = self.policy.resolve("trim", tenant=tenant, app=app, model=model)
            policy = self._parsed[key] = TrimPolicy.from_dict(resolved)
        return policy


def small_enough_inline(body: dict[str, Any]) -> bool:
    """Whether the trim of `body` is cheap enough for the event loop (no tools, a few short messages).

    Bounded by what the trim costs: at most INLINE_MESSAGES messages and INLINE_CHARS characters
    of text took under 0.5 ms on one core (the passes compare messages with each other, so the
    cost grows with both).
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or len(messages) > INLINE_MESSAGES or body.get("tools") or body.get("functions"):
        return False
    chars = 0
    for message in messages:
        if not isinstance(message, dict) or message.get("tool_calls") or message.get("function_call"):
            return False
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if not isinstance(text, str):
                    return False  # images, audio, anything else: the worker thread
                chars += len(text)
        elif content is not None:
            return False
        if chars > INLINE_CHARS:
            return False
    return True


def rewritten_enough(body: dict[str, Any], policy: TrimPolicy) -> bool:
    """Whether an estimate-counted trim of `body` is cheap enough for the event loop: only the lossless
    passes and the duplicate check on (no tool-output cut, history budget or masking, which count every
    message), and at most INLINE_NEW_CHARS characters of the prose they rewrite (every role but user
    and tool) not rewritten on an earlier request. Anything malformed goes to the thread, whose trim
    says what is wrong."""
    if policy.tool_output.enabled or policy.history_budget is not None or policy.agent_context.mode != "off":
        return False
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    new = 0
    for message in messages:
        if not isinstance(message, dict):
            return False
        if message.get("role") in VERBATIM_ROLES:
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts: list[Any] = [content]
        elif isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        elif content is None:
            continue
        else:
            return False
        for text in parts:
            if not isinstance(text, str):
                return False
            if not rewritten_before(text):
                new += len(text)
                if new > INLINE_NEW_CHARS:
                    return False
    return True


def cut_tool_results(result: TrimResult) -> int:
    """How many tool results the tool_output pass cut (each carries its marker once)."""
    def marked(messages: list[dict[str, Any]]) -> int:
        return sum(1 for m in messages if m.get("role") in TOOL_ROLES and TOOL_OUTPUT_MARK in "".join(texts(m)))

    return max(0, marked(result.body["messages"]) - marked(result.source))


def _record_mask(ctx: RequestContext, result: TrimResult, mode: str) -> None:
    """What observation masking did (mode on) or would have done (shadow), for the ledger's pricing."""
    mask = result.mask
    ctx.attributes[attr.MASK_MODE] = mode
    ctx.attributes[attr.MASKED_TOKENS] = mask.masked_tokens
    ctx.attributes[attr.MASK_WRITE_TOKENS] = mask.rewrite_tokens
    ctx.attributes["tierlane.trim.masked_results"] = len(mask.masked)
    if mode == "on" and mask.masked:
        ctx.response_headers["x-tierlane-mask"] = f"masked={len(mask.masked)};tokens={mask.masked_tokens}" + (
            ";step" if mask.step else "")


def _record(ctx: RequestContext, result: TrimResult) -> None:
    if not result.unchanged:  # else the client's own messages stay, the very objects parsed from its body
        ctx.body["messages"] = result.body["messages"]
    ctx.trim_saved = result.nonzero()
    saved = result.tokens_saved
    ctx.attributes["tierlane.trim.tokens_saved"] = saved
    ctx.attributes["tierlane.trim.tokens_saved_lossless"] = result.lossless_saved
    ctx.attributes["tierlane.trim.dropped_messages"] = len(result.dropped)
    ctx.attributes["tierlane.trim.estimated"] = result.estimated
    for name, n in ctx.trim_saved.items():
        ctx.attributes[f"tierlane.trim.tokens_saved.{name}"] = n
    if saved > 0:
        # NOTE: a budgeted pass is named with what it did, so a client sees a cut it did not ask for
        value = f"applied;saved={saved}"
        if ctx.trim_saved.get("history"):
            value += f";dropped={sum(1 for d in result.dropped if d.reason == HISTORY_REASON)}"
        if ctx.trim_saved.get("tool_output"):
            value += f";cut=tool_output:{cut_tool_results(result)}"
        ctx.response_headers[TRIM_HEADER] = value + (";estimated" if result.estimated else "")
    else:
        ctx.response_headers[TRIM_HEADER] = "none"


def build(services: Services) -> TrimStage | None:
    """The trim stage, or None when the policy switches trimming off everywhere."""
    variants = _policy_variants(services.policy)
    parsed = [TrimPolicy.from_dict(v) for v in variants]  # raises TrimPolicyError on a bad policy
    if not any(p.enabled for p in parsed):
        return None
    engine = services.engine
    count = getattr(engine, "count_tokens", None) if engine is not None else None
    return TrimStage(policy=services.policy, count_tokens=count, pricing=Pricing.from_policy(services.policy))
