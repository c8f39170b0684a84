"""Agent sessions on the upstream tiers (`lanes.agents`): background calls and one tier per session.

Pure logic over the canonical chat body; the route stage (gateway/pipeline/route.py) applies it.

* Background calls: what an agent asks beside its main loop (a title, a topic check, a summary
  label: no tools, a small model or a small answer from a short prompt, or a known system-prompt
  shape) is sent by policy to the cost tier, or to the edge.
* Session tiers: a session's main-loop turns (requests with tools) keep one tier, computed from the
  conversation itself on every request, so every replica agrees with no shared state: the tier of
  the session's first user message (the router's score of it, or an operator rule on the model the
  client named), moved up to strong once any prefix of the conversation shows a run signal (a
  streak of tool errors, the same tool call repeated, a context past a size, a refusal). A signal
  stays in the history, so the tier never moves back down while the conversation goes on.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

BACKGROUND_LANES = ("cost", "edge")
SESSION_TIERS = ("cost", "strong")  # policies.router.policy.TIERS (not imported: that module imports this one)

# Claude Code's side calls on its small fast model (titles, topics, summary labels), matched in
# the request's system/developer text.
DEFAULT_SHAPES = (
    "Summarize this coding conversation in under 50 characters",
    "Analyze if this message indicates a new conversation topic",
    "Please write a 5-10 word title",
    "Generate a short kebab-case name",
    "Write a short summary label describing what these tool calls accomplished",
    "Generate a concise, technical issue title",
)
DEFAULT_SMALL_MODELS = ("*haiku*", "*-mini", "*-mini-*", "*-nano", "*-nano-*")
# A tool result that starts with one of these is an error. The Messages front door writes an
# is_error result as "Error: ..."; other clients' failures are named here.
DEFAULT_ERROR_MARKERS = ("Error", "error:", "<tool_use_error>")
# An assistant answer that starts with one of these (case-insensitive) is a refusal.
DEFAULT_REFUSALS = ("I can't help with", "I cannot help with", "I can't assist with", "I cannot assist with",
                    "I'm sorry, but I can't", "I'm sorry, but I cannot", "I'm unable to help with")

SIGNALS = ("error_streak", "repeat_call", "context_size", "refusal")

CHARS_PER_TOKEN = 4  # a rough estimate, as for budgets: no tokenizer on the routing path


@dataclass(slots=True, frozen=True)
class BackgroundRules:
    """`lanes.agents.background`."""

    enabled: bool = False
    lane: str = "cost"  # cost: the cost tier (or the default upstream); edge: the edge where it fits
    small_models: tuple[str, ...] = DEFAULT_SMALL_MODELS
    max_tokens: int = 512
    max_prompt_tokens: int = 4000
    shapes: tuple[str, ...] = DEFAULT_SHAPES


@dataclass(slots=True, frozen=True)
class SessionTierRules:
    """`lanes.agents.session_tiers`."""

    enabled: bool = False
    error_streak: int = 3
    repeat_streak: int = 3
    max_context_tokens: int = 150_000
    model_tiers: tuple[tuple[str, str], ...] = ()  # (model glob, tier), first match wins
    error_markers: tuple[str, ...] = DEFAULT_ERROR_MARKERS
    refusals: tuple[str, ...] = DEFAULT_REFUSALS


@dataclass(slots=True, frozen=True)
class AgentRules:
    """`lanes.agents`: off unless a part is enabled."""

    background: BackgroundRules = field(default_factory=BackgroundRules)
    session_tiers: SessionTierRules = field(default_factory=SessionTierRules)


def _strings(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"lanes.agents.{name} must be a list of strings")
    return tuple(value)


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"lanes.agents.{name} must be a positive integer, got {value!r}")
    return value


def _mapping(value: Any, name: str, keys: set[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"lanes.agents.{name} must be a mapping")
    unknown = set(value) - keys
    if unknown:
        raise ValueError(f"lanes.agents.{name} has unknown key(s) {sorted(unknown)}; keys are {', '.join(sorted(keys))}")
    return dict(value)


def parse_agents(raw: Any) -> AgentRules:
    """`lanes.agents` as rules; a ValueError names the bad setting."""
    section = _mapping(raw, "", {"background", "session_tiers"}) if raw is not None else {}
    bg = _mapping(section.get("background"), "background",
                  {"enabled", "lane", "small_models", "max_tokens", "max_prompt_tokens", "shapes"})
    st = _mapping(section.get("session_tiers"), "session_tiers",
                  {"enabled", "error_streak", "repeat_streak", "max_context_tokens", "model_tiers", "error_markers",
                   "refusals"})
    d_bg, d_st = BackgroundRules(), SessionTierRules()
    lane = str(bg.get("lane") or d_bg.lane)
    if lane not in BACKGROUND_LANES:
        raise ValueError(f"lanes.agents.background.lane must be one of {', '.join(BACKGROUND_LANES)}, got {lane!r}")
    model_tiers = st.get("model_tiers") or {}
    if not isinstance(model_tiers, Mapping) or not all(
            isinstance(k, str) and v in SESSION_TIERS for k, v in model_tiers.items()):
        raise ValueError("lanes.agents.session_tiers.model_tiers must map model names (globs) to a tier "
                         f"({', '.join(SESSION_TIERS)})")
    return AgentRules(
        background=BackgroundRules(
            enabled=bool(bg.get("enabled", False)),
            lane=lane,
            small_models=_strings(bg.get("small_models", list(d_bg.small_models)), "background.small_models"),
            max_tokens=_positive(bg.get("max_tokens", d_bg.max_tokens), "background.max_tokens"),
            max_prompt_tokens=_positive(bg.get("max_prompt_tokens", d_bg.max_prompt_tokens),
                                        "background.max_prompt_tokens"),
            shapes=_strings(bg.get("shapes", list(d_bg.shapes)), "background.shapes"),
        ),
        session_tiers=SessionTierRules(
            enabled=bool(st.get("enabled", False)),
            error_streak=_positive(st.get("error_streak", d_st.error_streak), "session_tiers.error_streak"),
            repeat_streak=_positive(st.get("repeat_streak", d_st.repeat_streak), "session_tiers.repeat_streak"),
            max_context_tokens=_positive(st.get("max_context_tokens", d_st.max_context_tokens),
                                         "session_tiers.max_context_tokens"),
            model_tiers=tuple((str(k), str(v)) for k, v in model_tiers.items()),
            error_markers=_strings(st.get("error_markers", list(d_st.error_markers)), "session_tiers.error_markers"),
            refusals=_strings(st.get("refusals", list(d_st.refusals)), "session_tiers.refusals"),
        ),
    )


# The body ---------------------------------------------------------------------------------------


def content_text(content: Any) -> str:
    """A message's text: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or "") for p in content if isinstance(p, Mapping) and "text" in p)
    return ""


def _messages(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = body.get("messages")
    return [m for m in messages if isinstance(m, Mapping)] if isinstance(messages, list) else []


def _message_chars(message: Mapping[str, Any]) -> int:
    chars = len(content_text(message.get("content")))
    for call in message.get("tool_calls") or []:
        if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
            fn = call["function"]
            chars += len(str(fn.get("name") or "")) + len(str(fn.get("arguments") or ""))
    return chars


def estimate_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    """The prompt's size in tokens, estimated from its characters."""
    return sum(_message_chars(m) for m in messages) // CHARS_PER_TOKEN


def has_tools(body: Mapping[str, Any]) -> bool:
    tools = body.get("tools")
    return isinstance(tools, list) and len(tools) > 0


def max_tokens(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def matches_model(model: str | None, patterns: Sequence[str]) -> bool:
    return model is not None and any(fnmatch.fnmatchcase(model.lower(), p.lower()) for p in patterns)


def background_reason(body: Mapping[str, Any], model: str | None, rules: BackgroundRules) -> str | None:
    """Why a request is an agent's background call (small_model, small_request, shape), or None.

    A request with tools is a main-loop turn, never background."""
    if has_tools(body):
        return None
    messages = _messages(body)
    system = "\n".join(content_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer"))
    if system and any(shape in system for shape in rules.shapes):
        return "shape"
    if matches_model(model, rules.small_models):
        return "small_model"
    limit = max_tokens(body)
    if limit is not None and limit <= rules.max_tokens and estimate_tokens(messages) <= rules.max_prompt_tokens:
        return "small_request"
    return None


def short_or_json(body: Mapping[str, Any], rules: BackgroundRules) -> bool:
    """Whether the answer is short (max tokens within the background limit) or a JSON object."""
    limit = max_tokens(body)
    if limit is not None and limit <= rules.max_tokens:
        return True
    response_format = body.get("response_format")
    return isinstance(response_format, Mapping) and response_format.get("type") in ("json_object", "json_schema")


# Session tiers ----------------------------------------------------------------------------------


def first_user_message(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The session's first user message (in every request of the session), as text."""
    for message in _messages(body):
        if message.get("role") == "user":
            text = content_text(message.get("content"))
            if text:
                return {"role": "user", "content": text}
    return None


def fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def model_tier(model: str | None, rules: SessionTierRules) -> str | None:
    """The tier an operator rule gives the model the client named (first matching glob), or None."""
    if model is None:
        return None
    for pattern, tier in rules.model_tiers:
        if fnmatch.fnmatchcase(model, pattern):
            return tier
    return None


def _call_key(message: Mapping[str, Any]) -> tuple[tuple[str, str], ...] | None:
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return None
    key = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            return None
        key.append((str(fn.get("name") or ""), str(fn.get("arguments") or "")))
    return tuple(key)


def run_signal(body: Mapping[str, Any], rules: SessionTierRules) -> str | None:
    """The first run signal in the conversation (one of SIGNALS), or None.

    Each is looked for in the conversation's order and the earliest wins, so every later request
    of the session names the same one."""
    errors = repeats = chars = 0
    last_call: tuple[tuple[str, str], ...] | None = None
    markers = rules.error_markers
    refusals = tuple(r.lower() for r in rules.refusals)
    limit_chars = rules.max_context_tokens * CHARS_PER_TOKEN
    for message in _messages(body):
        role = message.get("role")
        chars += _message_chars(message)
        if chars > limit_chars:
            return "context_size"
        if role == "tool":
            text = content_text(message.get("content")).lstrip()
            errors = errors + 1 if any(text.startswith(m) for m in markers) else 0
            if errors >= rules.error_streak:
                return "error_streak"
        elif role == "assistant":
            key = _call_key(message)
            if key is None:
                repeats, last_call = 0, None
                text = content_text(message.get("content")).lstrip().lower()
                if text and any(text.startswith(r) for r in refusals):
                    return "refusal"
            else:
                repeats = repeats + 1 if key == last_call else 1
                last_call = key
                if repeats >= rules.repeat_streak:
                    return "repeat_call"
    return None


def session_tier(base: str, body: Mapping[str, Any], rules: SessionTierRules) -> tuple[str, str]:
    """A session turn's (tier, reason): `base` (the first message's or the model rule's tier) as
    session_<tier>, or strong as session_escalated:<signal> once the conversation shows a run signal."""
    if base != "strong":
        signal = run_signal(body, rules)
        if signal is not None:
            return "strong", f"session_escalated:{signal}"
    return base, f"session_{base}"


class FirstScores:
    """The router's score of each session's first user message, per (tenant, app, session), LRU-bounded.

    Only a saving: the score is a function of the message, so a miss (another replica, an evicted
    session) recomputes the same value. Keyed with the message's fingerprint, so a session key
    reused for another conversation is scored anew."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._scores: OrderedDict[tuple[str | None, str | None, str], tuple[str, float]] = OrderedDict()

    def get(self, key: tuple[str | None, str | None, str], digest: str) -> float | None:
        found = self._scores.get(key)
        if found is None or found[0] != digest:
            return None
        self._scores.move_to_end(key)
        return found[1]

    def put(self, key: tuple[str | None, str | None, str], digest: str, score: float) -> None:
        self._scores[key] = (digest, score)
        self._scores.move_to_end(key)
        while len(self._scores) > self.size:
            self._scores.popitem(last=False)

    def __len__(self) -> int:
        return len(self._scores)
