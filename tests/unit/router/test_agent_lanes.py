"""lanes.agents: the background classifier, the session tier function and the route stage applying them."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import pytest

from gateway.context import Principal, RequestContext
from gateway.pipeline.route import RouteStage
from policies.policy import Policy
from policies.router import RoutePolicy, Router
from policies.router.agent_lanes import (
    BackgroundRules,
    FirstScores,
    SessionTierRules,
    background_reason,
    parse_agents,
    run_signal,
    session_tier,
)

TOOLS = [{"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}]
TITLE_SYSTEM = ("Summarize this coding conversation in under 50 characters.\nCapture the main task, key files, "
                "problems addressed, and current status.")
FIRST = "Read notes.txt and todo.txt and tell me what they say."


def haiku_title_call() -> dict[str, Any]:
    """Claude Code's title side call as the Messages front door leaves it (no tools, its small model)."""
    return {"model": "auto", "max_tokens": 512, "stream": True,
            "messages": [{"role": "system", "content": TITLE_SYSTEM},
                         {"role": "user", "content": "Please fix the flaky test in tests/test_io.py"}]}


def main_loop_call(max_tokens: int = 32000) -> dict[str, Any]:
    return {"model": "auto", "max_tokens": max_tokens, "stream": True, "tools": TOOLS,
            "messages": [{"role": "system", "content": "You are Claude Code, Anthropic's official CLI."},
                         {"role": "user", "content": FIRST}]}


# The background classifier --------------------------------------------------------------------------


def test_claude_codes_haiku_title_call_is_background() -> None:
    rules = BackgroundRules(enabled=True)
    assert background_reason(haiku_title_call(), "claude-haiku-4-5", rules) == "shape"
    # the shape alone, whatever the model and budget
    assert background_reason({**haiku_title_call(), "max_tokens": 8000}, "claude-sonnet-4-5", rules) == "shape"
    topic = {"max_tokens": 8000, "messages": [
        {"role": "system", "content": "Analyze if this message indicates a new conversation topic. If it does, ..."},
        {"role": "user", "content": "now the parser"}]}
    assert background_reason(topic, "claude-sonnet-4-5", rules) == "shape"


def test_small_models_and_small_requests_are_background() -> None:
    rules = BackgroundRules(enabled=True)
    big_prompt = {"max_tokens": 8000, "messages": [{"role": "user", "content": "hello " * 40000}]}
    assert background_reason(big_prompt, "claude-haiku-4-5", rules) == "small_model"
    assert background_reason(big_prompt, "gpt-5-mini", rules) == "small_model"
    assert background_reason(big_prompt, "gpt-4.1-nano-2025-04-14", rules) == "small_model"
    assert background_reason(big_prompt, "claude-sonnet-4-5", rules) is None  # big answer, long prompt
    small = {"max_completion_tokens": 100, "messages": [{"role": "user", "content": "Name this file."}]}
    assert background_reason(small, "claude-sonnet-4-5", rules) == "small_request"
    long_small = {"max_tokens": 100, "messages": [{"role": "user", "content": "x" * 4 * 5000}]}
    assert background_reason(long_small, "claude-sonnet-4-5", rules) is None  # prompt past max_prompt_tokens
    assert background_reason({"messages": [{"role": "user", "content": "hi"}]}, "claude-sonnet-4-5", rules) is None


def test_a_main_loop_turn_with_tools_is_never_background() -> None:
    rules = BackgroundRules(enabled=True)
    assert background_reason(main_loop_call(), "claude-sonnet-4-5", rules) is None
    assert background_reason(main_loop_call(max_tokens=64), "claude-haiku-4-5", rules) is None
    shaped = main_loop_call()
    shaped["messages"][0]["content"] = TITLE_SYSTEM
    assert background_reason(shaped, "claude-haiku-4-5", rules) is None


def test_the_settings_parse_with_defaults_and_reject_bad_values(shipped_router: Router) -> None:
    rules = parse_agents(None)
    assert not rules.background.enabled and not rules.session_tiers.enabled
    assert rules.background.max_tokens == 512 and rules.session_tiers.error_streak == 3
    shipped = RoutePolicy(Policy.load(), shipped_router).rules("t", "a").agents
    assert shipped == parse_agents(Policy.load().section("lanes")["agents"])
    assert not shipped.background.enabled and not shipped.session_tiers.enabled
    custom = parse_agents({"background": {"enabled": True, "lane": "edge", "shapes": ["title please"]},
                           "session_tiers": {"enabled": True, "model_tiers": {"claude-opus-*": "strong"}}})
    assert custom.background.lane == "edge" and custom.background.shapes == ("title please",)
    assert custom.session_tiers.model_tiers == (("claude-opus-*", "strong"),)
    for bad in ({"background": {"lane": "gpu"}}, {"background": {"max_tokens": 0}},
                {"session_tiers": {"model_tiers": {"x": "medium"}}}, {"session_tiers": {"streak": 3}}):
        with pytest.raises(ValueError, match="lanes.agents"):
            parse_agents(bad)


def test_overrides_switch_it_on_per_tenant(shipped_router: Router) -> None:
    policy = RoutePolicy(Policy.load(extra={"lanes": {"overrides": [
        {"match": {"tenant": "acme"}, "set": {"agents": {"background": {"enabled": True},
                                                          "session_tiers": {"enabled": True}}}}]}}), shipped_router)
    assert policy.rules("acme", "x").agents.background.enabled and policy.rules("acme", "x").agents.session_tiers.enabled
    assert not policy.rules("other", "x").agents.background.enabled


# The session tier function ---------------------------------------------------------------------------


class Conversation:
    """A growing agent conversation in the canonical chat shape."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                               {"role": "user", "content": FIRST}]
        self.n = 0

    def call(self, name: str = "Read", args: dict[str, Any] | None = None, result: str = "ok") -> None:
        self.n += 1
        call_id = f"c{self.n}"
        arguments = json.dumps(args if args is not None else {"file_path": f"f{self.n}.txt"})
        self.messages += [{"role": "assistant", "content": "",
                           "tool_calls": [{"id": call_id, "type": "function",
                                           "function": {"name": name, "arguments": arguments}}]},
                          {"role": "tool", "tool_call_id": call_id, "content": result}]

    def say(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def body(self) -> dict[str, Any]:
        return {"model": "auto", "tools": TOOLS, "max_tokens": 32000, "messages": [dict(m) for m in self.messages]}


RULES = SessionTierRules(enabled=True)


def test_a_session_keeps_its_first_tier_without_signals() -> None:
    conv = Conversation()
    seen = []
    for _ in range(6):
        seen.append(session_tier("cost", conv.body(), RULES))
        conv.call(result="some output")
    assert set(seen) == {("cost", "session_cost")}
    assert session_tier("strong", conv.body(), RULES) == ("strong", "session_strong")


@pytest.mark.parametrize("signal", ["error_streak", "repeat_call", "context_size", "refusal"])
def test_each_signal_escalates_and_it_never_goes_back_down(signal: str) -> None:
    conv = Conversation()
    conv.call()
    assert session_tier("cost", conv.body(), RULES) == ("cost", "session_cost")
    if signal == "error_streak":
        conv.call(result="Error: <tool_use_error>File does not exist.</tool_use_error>")
        conv.call(result="Error: permission denied")
        assert session_tier("cost", conv.body(), RULES)[0] == "cost"  # two in a row: not yet
        conv.call(result="error: no such file")
    elif signal == "repeat_call":
        for _ in range(2):
            conv.call(args={"cmd": "make test"})
        assert session_tier("cost", conv.body(), RULES)[0] == "cost"
        conv.call(args={"cmd": "make test"})
    elif signal == "context_size":
        conv.call(result="x" * 4 * 150_001)
    else:
        conv.say("I'm sorry, but I can't help with that request.")
        conv.messages.append({"role": "user", "content": "please do"})
    assert session_tier("cost", conv.body(), RULES) == ("strong", f"session_escalated:{signal}")
    # the streak ends: fine results, other calls, and the tier stays up
    for _ in range(5):
        conv.call(result="fine")
        assert session_tier("cost", conv.body(), RULES) == ("strong", f"session_escalated:{signal}")


def test_errors_interrupted_by_a_success_are_no_streak() -> None:
    conv = Conversation()
    for result in ("Error: a", "Error: b", "ok", "Error: c", "Error: d"):
        conv.call(result=result)
    assert run_signal(conv.body(), RULES) is None
    conv.call(result="Error: e")
    assert run_signal(conv.body(), RULES) == "error_streak"
    assert run_signal(conv.body(), SessionTierRules(error_streak=4)) is None


def test_the_earliest_signal_names_the_escalation() -> None:
    conv = Conversation()
    for _ in range(3):
        conv.call(result="Error: x")
    conv.call(result="y" * 4 * 150_001)
    assert session_tier("cost", conv.body(), RULES) == ("strong", "session_escalated:error_streak")


def test_first_scores_are_kept_per_session_and_message() -> None:
    scores = FirstScores(size=2)
    scores.put(("t", "a", "s1"), "d1", 0.3)
    assert scores.get(("t", "a", "s1"), "d1") == 0.3
    assert scores.get(("t", "a", "s1"), "other") is None  # the key reused for another conversation
    scores.put(("t", "a", "s2"), "d2", 0.4)
    scores.put(("t", "a", "s3"), "d3", 0.5)
    assert len(scores) == 2 and scores.get(("t", "a", "s1"), "d1") is None


# The route stage: two replicas -----------------------------------------------------------------------


class HashEmbedder:
    """A deterministic stand-in for the shared embedder: a unit vector from the text's hash, or
    one of `fixed` (text -> vector)."""

    fixed: dict[str, np.ndarray] = {}

    def __init__(self) -> None:
        self.texts: list[str] = []

    async def embed(self, text: str) -> np.ndarray:
        self.texts.append(text)
        if text in self.fixed:
            return self.fixed[text]
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        vec = np.random.default_rng(seed).standard_normal(384).astype(np.float32)
        return vec / np.linalg.norm(vec)


TIERS = {"cost": {"pool": "standard", "model": "small"}, "strong": {"pool": "critical", "model": "big"}}


def replica(router: Router, threshold: float, *, edge: bool = False, **agents: Any) -> RouteStage:
    lanes = {"upstream": {"tiers": TIERS}, "agents": agents}
    return RouteStage(
        router=router, policy=RoutePolicy(Policy.load(extra={
            "router": {"target": {"mode": "threshold", "value": threshold}}, "lanes": lanes}), router),
        embedder=HashEmbedder(), edge_available=edge, upstream_available=True, pool_names=["standard", "critical"],
        edge_model="edge", pool_model={"standard": "standard-model", "critical": "critical-model"}.get,
    )


def request(body: dict[str, Any], session: str | None = "sess-1", client_model: str = "claude-sonnet-4-5"
            ) -> RequestContext:
    c = RequestContext(request_id="r", operation="chat", body=body, headers={}, principal=Principal("t", "a"),
                       model="auto", client_model=client_model, session=session)
    c.lane, c.pool, c.target_model = "upstream", "standard", "standard-model"
    return c


async def test_background_goes_to_the_cost_tier_and_main_loop_turns_do_not(shipped_router: Router) -> None:
    stage = replica(shipped_router, 0.0, background={"enabled": True})  # threshold 0: the router picks strong
    title = request(haiku_title_call(), client_model="claude-haiku-4-5")
    await stage.run(title)
    assert (title.lane, title.tier, title.target_model, title.route.reason) == ("upstream", "cost", "small", "background")
    assert title.attributes["tierlane.route.background"] == "shape"
    main = request(main_loop_call())
    await stage.run(main)
    assert (main.tier, main.route.reason) == ("strong", "router_strong")
    off = replica(shipped_router, 0.0)
    title = request(haiku_title_call(), client_model="claude-haiku-4-5")
    await off.run(title)
    assert (title.tier, title.route.reason) == ("strong", "router_strong")  # off by default


async def test_background_goes_to_the_edge_when_asked_and_it_runs(shipped_router: Router) -> None:
    stage = replica(shipped_router, 0.0, edge=True, background={"enabled": True, "lane": "edge"})
    title = request(haiku_title_call(), client_model="claude-haiku-4-5")
    await stage.run(title)
    # no edge engine in this stage (capabilities None): the edge cannot be checked, so the cost tier
    assert (title.lane, title.tier, title.route.reason) == ("upstream", "cost", "background")

    class Fits:
        async def gaps(self, operation: str, body: Any) -> list[Any]:
            return []

    stage.capabilities = Fits()  # type: ignore[assignment]
    title = request(haiku_title_call(), client_model="claude-haiku-4-5")
    await stage.run(title)
    assert (title.lane, title.target_model, title.route.reason) == ("edge", "edge", "background")
    long_answer = request({**haiku_title_call(), "max_tokens": 4000}, client_model="claude-haiku-4-5")
    await stage.run(long_answer)
    assert (long_answer.lane, long_answer.tier) == ("upstream", "cost")  # not short, not JSON: not the edge


class StubRouter:
    """A router whose score is the embedding's first component: the test sets each text's score."""

    def score(self, prompt: Any, embedding: Any) -> float:
        return float(np.asarray(embedding)[0])

    def threshold_for(self, mode: str, value: float) -> float:
        return value


def unit(first: float) -> np.ndarray:
    vec = np.zeros(384, dtype=np.float32)
    vec[0], vec[1] = first, (1 - first * first) ** 0.5
    return vec


async def test_two_replicas_agree_on_every_turn_and_the_tier_only_moves_up(monkeypatch: pytest.MonkeyPatch) -> None:
    later = "Now run the failing test again and show me the traceback of the parser module in full detail."
    # the session's first message scores 0.2, each later user turn 0.8: the session's tier is cost,
    # each later turn's own pick would be strong
    monkeypatch.setattr(HashEmbedder, "fixed", {FIRST: unit(0.2), later: unit(0.8)})
    router: Any = StubRouter()
    threshold = 0.5
    a = replica(router, threshold, session_tiers={"enabled": True})
    b = replica(router, threshold, session_tiers={"enabled": True})
    conv = Conversation()
    results = ["ok", "ok", "Error: a", "Error: b", "Error: c", "ok", "ok"]
    seen: list[tuple[str | None, str]] = []
    for i, result in enumerate(results):
        body = conv.body()
        body["messages"].append({"role": "user", "content": later})  # a later user turn: the per-request pick
        ra, rb = request(body), request(json.loads(json.dumps(body)))
        await a.run(ra)
        if i % 2:
            b.first_scores = FirstScores()  # a replica that has not seen the session (or evicted it)
        await b.run(rb)
        assert (ra.tier, ra.route.reason, ra.route.score) == (rb.tier, rb.route.reason, rb.route.score), i
        assert ra.route.score == pytest.approx(0.2)  # the first message's score on every turn
        seen.append((ra.tier, ra.route.reason))
        conv.call(result=result)
    assert seen[:5] == [("cost", "session_cost")] * 5
    assert seen[5:] == [("strong", "session_escalated:error_streak")] * 2  # up after three errors, and stays
    # without session tiers each of these turns is the router's own pick of its last user turn
    plain = request(body)
    await replica(router, threshold).run(plain)
    assert (plain.tier, plain.route.reason) == ("strong", "router_strong")
    # the first message was embedded once per replica life, not every turn
    assert sum(t == FIRST for t in a.embedder.texts) == 1


async def test_an_operator_rule_on_the_model_name_sets_the_session_tier(shipped_router: Router) -> None:
    stage = replica(shipped_router, 0.0, session_tiers={"enabled": True, "model_tiers": {"claude-sonnet-*": "cost"}})
    c = request(main_loop_call())
    await stage.run(c)
    assert (c.tier, c.route.reason, c.target_model) == ("cost", "session_cost", "small")
    assert c.attributes["tierlane.route.session_source"] == "model_tiers"
    opus = request(main_loop_call(), client_model="claude-opus-4-5")  # no rule: the first message's score
    await stage.run(opus)
    assert (opus.tier, opus.route.reason) == ("strong", "session_strong")
    no_session = request(main_loop_call(), session=None)  # not a session: the per-request pick
    await stage.run(no_session)
    assert no_session.route.reason == "router_strong"
