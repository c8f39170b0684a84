"""Observation masking for agent sessions: old tool output becomes a placeholder, in cache-aligned steps.

An agent's input is mostly the tool output of earlier turns (files read, command output), sent
again on every call. Replacing results older than the last K turns with a short placeholder
("observation masking", The Complexity Trap, arXiv 2508.21433: $1.29 -> $0.61 per SWE-bench
Verified task at 54.8 % vs 53.4 % solved; that is the paper's measurement, not one made here)
cuts that input. But each change to the prompt rewrites the provider's cached prefix from the
first changed byte on, and a cache write costs more than the reads it replaces (Anthropic: read
0.1x, write 1.25x the input price), so the masked boundary moves in steps:

- it only moves when the tool output it would mask has grown to `step_share` of the whole
  conversation (unmasked), so steps grow with the session;
- it only moves where the priced net saving is positive: the masked tokens at the cached-read
  price over the session's expected remaining turns, minus the cache rewrite the step causes
  (every token after the first masked one, at the write price less the read it replaces);
- expected remaining turns: `remaining_share` of the turns the session has had so far (at least
  `min_remaining_turns`): an estimate that grows with the session. Under heavy-tailed session
  lengths "as many again" is only the median, and a step the session does not outlive costs more
  than it saves, so the default asks a step to pay back within a quarter of the turns so far
  (measured in bench/agent_sessions.py on the same recorded sessions: at 0.5, 33-call sessions paid
  1.03x (Claude Code) and 1.04x (Codex) with masking, a late step never paying back; at 0.25 they
  pay 0.98x and 0.99x, and the 101-call session 0.595x against 0.594x).

NOTE: stateless. The boundary is replayed from the conversation itself (each earlier request is
taken as a prefix of this one, as agents send them), so every replica and every turn computes
the same boundary and the masked prefix stays byte-stable between steps. The current turn's
results, and every result of the last K turns, are never touched; a tool result keeps its call
id (pairs stay whole); only the `content` of a masked tool message changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from policies.sections import StrictSection
from policies.trim.messages import TOOL_ROLES, texts

PLACEHOLDER = "[tierlane: the output of this {tool} call ({tokens} tokens) was cleared from the context to save cost; call the tool again if it is needed]"
Mode = Literal["off", "shadow", "on"]


class AgentContextPolicy(StrictSection):
    """`trim.agent_context`: observation masking for agent sessions (off as shipped)."""

    mode: Mode = Field("off", description="off | shadow (compute and record what it would save) | on")
    keep_turns: int = Field(10, ge=1, description="tool results of the last K model turns stay whole")
    step_share: float = Field(0.25, gt=0.0, le=1.0,
                              description="the boundary moves once the maskable output is this share of the context")
    min_result_tokens: int = Field(200, ge=0, description="shorter tool results are never masked")
    min_remaining_turns: int = Field(4, ge=1, description="floor of the expected remaining turns in the priced check")
    remaining_share: float = Field(0.25, gt=0.0, le=4.0,
                                   description="expected remaining turns as a share of the turns so far")


@dataclass(slots=True, frozen=True)
class CachePrices:
    """A model's cache prices as multiples of its input price."""

    read: float = 0.1
    write: float = 1.25


@dataclass(slots=True, frozen=True)
class MaskPlan:
    """Which tool results to mask in this request, and what that costs and saves."""

    masked: tuple[int, ...]  # positions of the tool messages to clear
    masked_tokens: int  # prompt tokens removed (placeholders counted)
    rewrite_tokens: int  # prompt tokens after the first newly masked one, when this request takes a step
    step: bool  # this request moves the boundary (and so rewrites the cached prefix)
    boundary: int  # results before this position are masked

    @staticmethod
    def none() -> MaskPlan:
        return MaskPlan((), 0, 0, False, 0)


def _tool_names(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Per position, the name of the tool whose call a tool result answers: the call with its id in
    the nearest assistant message before it. NOTE: not the last call with that id in the whole
    conversation: clients that reuse ids across turns would otherwise change an already-masked
    placeholder whenever a later call reuses the id, rewriting the cached prefix every turn."""
    names: list[str] = []
    calls: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                calls[call["id"]] = str((call.get("function") or {}).get("name") or "tool")
        names.append(calls.get(str(message.get("tool_call_id")), "tool") if message.get("role") in TOOL_ROLES else "")
    return names


def placeholder(message: dict[str, Any], tokens: int, tool: str) -> str:
    return PLACEHOLDER.format(tool=tool, tokens=tokens)


def plan(messages: Sequence[dict[str, Any]], policy: AgentContextPolicy, prices: CachePrices,
         count_message: Callable[[dict[str, Any]], int], count_text: Callable[[str], int]) -> MaskPlan:
    """The masking plan of one request: the boundary replayed over the session's earlier requests."""
    if policy.mode == "off":
        return MaskPlan.none()
    n = len(messages)
    cost = [count_message(m) for m in messages]
    names = _tool_names(messages)
    # a result is maskable when long enough that its placeholder saves tokens
    gain = [0] * n
    for i, m in enumerate(messages):
        if m.get("role") in TOOL_ROLES and isinstance(m.get("content"), str):
            body = count_text("".join(texts(m)))
            if body >= policy.min_result_tokens:
                gain[i] = max(0, body - count_text(placeholder(m, body, names[i])))
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if len(assistants) <= policy.keep_turns or not any(gain):
        return MaskPlan.none()
    prefix_cost = [0] * (n + 1)
    prefix_gain = [0] * (n + 1)
    for i in range(n):
        prefix_cost[i + 1] = prefix_cost[i] + cost[i]
        prefix_gain[i + 1] = prefix_gain[i] + gain[i]
    later_gain = [n] * (n + 1)  # the first maskable position at or after i
    for i in range(n - 1, -1, -1):
        later_gain[i] = i if gain[i] else later_gain[i + 1]

    boundary, step_at, rewrite = 0, -1, 0
    # each earlier request ended just before an assistant message (its answer); the current one ends at n
    ends = [(a, j) for j, a in enumerate(assistants) if j > 0] + [(n, len(assistants))]
    for end, turns in ends:
        if turns <= policy.keep_turns:
            continue
        candidate = assistants[turns - policy.keep_turns]
        if candidate <= boundary:
            continue
        masked_now = prefix_gain[candidate] - prefix_gain[boundary]  # what moving the boundary removes
        # NOTE: a share of the whole (unmasked) conversation, so steps grow with the session and
        # come rarer as it runs, rather than as often as the masked prompt stays short
        if masked_now <= 0 or masked_now < policy.step_share * prefix_cost[end]:
            continue
        # the provider holds the previous request and its answer: from the first newly masked
        # result up to there, what would have been read is written again
        first = later_gain[boundary]
        cached_until = assistants[turns - 1] + 1
        rewritten = max(0, prefix_cost[cached_until] - prefix_cost[first] - (prefix_gain[candidate] - prefix_gain[first]))
        remaining = max(policy.min_remaining_turns, int(turns * policy.remaining_share))
        net = remaining * masked_now * prices.read - rewritten * max(0.0, prices.write - prices.read)
        if net <= 0:
            continue
        boundary, step_at, rewrite = candidate, end, rewritten
    masked = tuple(i for i in range(boundary) if gain[i])
    step = step_at == n
    return MaskPlan(masked, prefix_gain[boundary], rewrite if step else 0, step, boundary)


def apply(messages: list[dict[str, Any]], chosen: MaskPlan, count_text: Callable[[str], int]) -> list[dict[str, Any]]:
    """The messages with the plan's tool results cleared (new dicts; the rest shared)."""
    if not chosen.masked:
        return messages
    names = _tool_names(messages)
    out = list(messages)
    for i in chosen.masked:
        message = messages[i]
        tokens = count_text("".join(texts(message)))
        out[i] = {**message, "content": placeholder(message, tokens, names[i])}
    return out
