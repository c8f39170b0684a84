"""The trim pipeline stage over a real RequestContext and the shipped policy."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from gateway.context import Principal, RequestContext
from gateway.pipeline.trim import INLINE_NEW_CHARS, build, rewritten_enough, small_enough_inline
from gateway.services import Services
from gateway.settings import Settings
from policies.policy import Policy
from policies.trim import TrimPolicyError, trim_request
from tests.unit.trim.builders import assistant, system, tool_call, user


@dataclass
class EdgeTokenizer:
    """The part of the edge engine the stage uses, backed by the real SmolLM2 vocabulary."""

    count_tokens: Callable[[str], int]


def _services(policy: Policy | None = None, engine: Any = None) -> Services:
    return Services(settings=Settings.load(env={}), policy=policy or Policy.load(), pool=None, engine=engine)  # type: ignore[arg-type]


def _ctx(messages: list[dict[str, Any]], *, headers: dict[str, str] | None = None,
         operation: str = "chat", tenant: str = "t1", model: str = "m") -> RequestContext:
    return RequestContext(
        request_id="r1", operation=operation, body={"model": model, "messages": messages},  # type: ignore[arg-type]
        headers=headers or {}, principal=Principal(tenant=tenant, app="a"), model=model,
    )


MESSAGES = [system("Be   brief.  "), system("Be   brief.  "), user("hi  there"), assistant("hello  again"),
            user("last  one ")]


async def test_trims_and_records_saving_with_the_engine_tokenizer(edge_count: Callable[[str], int]) -> None:
    stage = build(_services(engine=EdgeTokenizer(edge_count)))
    assert stage is not None and stage.name == "trim"
    ctx = _ctx([dict(m) for m in MESSAGES])
    ctx.lane = "edge"
    assert await stage.run(ctx) is None
    # the users' own words byte for byte; the system prompt and the assistant's turn normalised
    assert [m["content"] for m in ctx.body["messages"]] == ["Be brief.", "hi  there", "hello again", "last  one "]
    total = sum(ctx.trim_saved.values())
    assert total > 0 and set(ctx.trim_saved) == {"whitespace", "duplicates"}
    assert ctx.attributes["tierlane.trim.tokens_saved"] == total
    assert ctx.response_headers["x-tierlane-trim"] == f"applied;saved={total}"
    assert ctx.attributes["tierlane.trim.estimated"] is False


async def test_upstream_requests_are_estimated_even_with_an_engine(edge_count: Callable[[str], int]) -> None:
    stage = build(_services(engine=EdgeTokenizer(edge_count)))
    ctx = _ctx([dict(m) for m in MESSAGES])
    ctx.lane = "upstream"  # the edge tokenizer says nothing about an upstream model's tokens
    await stage.run(ctx)  # type: ignore[union-attr]
    assert ctx.attributes["tierlane.trim.estimated"] is True


async def test_without_an_engine_the_count_is_an_estimate() -> None:
    stage = build(_services())
    ctx = _ctx([dict(m) for m in MESSAGES])
    await stage.run(ctx)  # type: ignore[union-attr]
    assert ctx.response_headers["x-tierlane-trim"].endswith(";estimated")
    assert ctx.attributes["tierlane.trim.estimated"] is True


@pytest.mark.parametrize("value", ["off", "OFF", " off "])
async def test_header_turns_it_off_for_one_request(value: str) -> None:
    stage = build(_services())
    messages = [dict(m) for m in MESSAGES]
    ctx = _ctx(messages, headers={"x-tierlane-trim": value})
    await stage.run(ctx)  # type: ignore[union-attr]
    assert ctx.body["messages"] == MESSAGES and ctx.trim_saved == {}
    assert ctx.response_headers["x-tierlane-trim"] == "off"


async def test_only_chat_is_trimmed() -> None:
    stage = build(_services())
    ctx = _ctx([dict(m) for m in MESSAGES], operation="completions")
    await stage.run(ctx)  # type: ignore[union-attr]
    assert ctx.body["messages"] == MESSAGES and "x-tierlane-trim" not in ctx.response_headers


async def test_nothing_to_trim_says_none() -> None:
    stage = build(_services())
    ctx = _ctx([user("a"), assistant("b"), user("c")])
    await stage.run(ctx)  # type: ignore[union-attr]
    assert ctx.response_headers["x-tierlane-trim"] == "none" and ctx.trim_saved == {}


async def test_policy_switches_it_off_per_tenant() -> None:
    policy = Policy.load(extra=yaml.safe_load("trim: {overrides: [{match: {tenant: quiet}, set: {enabled: false}}]}"))
    stage = build(_services(policy))
    off = _ctx([dict(m) for m in MESSAGES], tenant="quiet")
    on = _ctx([dict(m) for m in MESSAGES], tenant="loud")
    await stage.run(off)  # type: ignore[union-attr]
    await stage.run(on)  # type: ignore[union-attr]
    assert off.response_headers["x-tierlane-trim"] == "off" and off.body["messages"] == MESSAGES
    assert on.response_headers["x-tierlane-trim"].startswith("applied")


async def test_large_bodies_are_trimmed(edge_count: Callable[[str], int]) -> None:
    stage = build(_services(engine=EdgeTokenizer(edge_count)))
    big = "word  " * 5000
    ctx = _ctx([system(big), assistant("ok"), user("q")])
    await stage.run(ctx)  # type: ignore[union-attr]
    assert ctx.body["messages"][0]["content"] == big.rstrip().replace("  ", " ")


def test_switched_off_everywhere_builds_nothing() -> None:
    assert build(_services(Policy.load(extra={"trim": {"enabled": False}}))) is None


def test_a_bad_override_fails_at_start_up() -> None:
    policy = Policy.load(extra=yaml.safe_load("trim: {overrides: [{match: {app: x}, set: {history: {max_tokens: -1}}}]}"))
    with pytest.raises(TrimPolicyError):
        build(_services(policy))


@pytest.mark.parametrize(
    ("body", "inline"),
    [
        ({"messages": MESSAGES[1:]}, True),
        ({"messages": MESSAGES}, False),  # five messages
        ({"messages": [user("x" * 300)]}, True),
        ({"messages": [user("x" * 301)]}, False),
        ({"messages": [user("a")] * 5}, False),  # the passes compare messages: cost grows with their number
        ({"messages": [user([{"type": "text", "text": "hi"}])]}, True),
        ({"messages": [user([{"type": "image_url", "image_url": {"url": "data:,"}}])]}, False),
        ({"messages": [user("a"), tool_call("c1")]}, False),
        ({"messages": [user("a")], "tools": [{"type": "function", "function": {"name": "f"}}]}, False),
        ({"messages": "not a list"}, False),
    ],
)
def test_only_small_plain_requests_are_trimmed_on_the_loop(body: dict[str, Any], inline: bool) -> None:
    assert small_enough_inline(body) is inline


async def test_a_small_request_is_trimmed_on_the_loop_and_a_large_one_on_a_thread(
    monkeypatch: pytest.MonkeyPatch, edge_count: Callable[[str], int]
) -> None:
    loop = asyncio.get_running_loop()
    handed: list[Any] = []
    real = loop.run_in_executor

    def counting(executor: Any, fn: Any, *args: Any) -> Any:
        handed.append(fn)
        return real(executor, fn, *args)

    monkeypatch.setattr(loop, "run_in_executor", counting)
    stage = build(_services(engine=EdgeTokenizer(edge_count)))
    assert stage is not None
    small = _ctx([dict(m) for m in MESSAGES[1:]])
    small.lane = "upstream"
    await stage.run(small)
    assert handed == []  # trimmed without leaving the loop, the same way
    assert [m["content"] for m in small.body["messages"]] == ["Be brief.", "hi  there", "hello again", "last  one "]
    assert small.response_headers["x-tierlane-trim"].endswith(";estimated")
    for ctx in (_ctx([system(f"{uuid.uuid4()} word  " * 500)]), _ctx([dict(m) for m in MESSAGES])):
        ctx.lane = "edge" if len(ctx.body["messages"]) > 1 else "upstream"  # the engine's tokenizer: a thread
        await stage.run(ctx)
    assert handed == [trim_request, trim_request]


async def test_an_agent_turn_whose_prose_was_seen_before_is_trimmed_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent re-sends its conversation every turn: the first turn's long prose goes to a thread, the
    next turn (the same prose, memoised, plus long tool results, which no lossless pass rewrites) stays on
    the loop; the result is the same either way."""
    loop = asyncio.get_running_loop()
    handed: list[Any] = []
    real = loop.run_in_executor

    def counting(executor: Any, fn: Any, *args: Any) -> Any:
        handed.append(fn)
        return real(executor, fn, *args)

    monkeypatch.setattr(loop, "run_in_executor", counting)
    stage = build(_services())
    assert stage is not None
    prose = f"{uuid.uuid4()} You are  a coding agent.   \n\n" * 400
    turn = [system(prose), user("read a.py"), tool_call("c1", "read"),
            {"role": "tool", "tool_call_id": "c1", "content": "x = 1\n" * 20_000}, user("explain")]
    policy = stage._policy_for("t1", "a", "m")
    assert len(prose) > INLINE_NEW_CHARS and not rewritten_enough({"messages": turn}, policy)
    first, second = _ctx([dict(m) for m in turn]), _ctx([dict(m) for m in turn])
    for ctx in (first, second):
        ctx.lane = "upstream"
        await stage.run(ctx)
    assert handed == [trim_request]  # the first turn only
    assert first.body == second.body and first.response_headers == second.response_headers
    assert rewritten_enough({"messages": turn}, policy)
    masking = dataclasses.replace(policy, agent_context=policy.agent_context.model_copy(update={"mode": "shadow"}))
    assert not rewritten_enough({"messages": turn}, masking)  # masking counts every message: the thread
    assert not rewritten_enough({"messages": [{"role": "system", "content": 5}]}, policy)  # malformed: the thread


async def test_a_budget_cut_of_tool_output_is_named_in_the_header() -> None:
    policy = Policy.load(extra=yaml.safe_load(
        "trim: {overrides: [{match: {tenant: t1}, set: {tool_output: {enabled: true, max_tokens: 300, "
        "head_tokens: 120, tail_tokens: 80}}}]}"))
    stage = build(_services(policy=policy))
    assert stage is not None
    rows = "".join(f"row {i}: value={i * 7}\n" for i in range(3000))
    messages = [user("q"), tool_call("c1"), {"role": "tool", "tool_call_id": "c1", "content": rows}, assistant("seen"),
                user("more")]
    ctx = _ctx([dict(m) for m in messages])
    await stage.run(ctx)
    assert ctx.response_headers["x-tierlane-trim"].startswith("applied;saved=")
    assert ";cut=tool_output:1" in ctx.response_headers["x-tierlane-trim"]
    other = _ctx([dict(m) for m in messages], tenant="t2")  # not opted in: the result goes whole
    await stage.run(other)
    assert other.body["messages"][2]["content"] == rows and other.response_headers["x-tierlane-trim"] == "none"


async def test_masking_in_shadow_mode_records_what_it_would_save_and_changes_nothing() -> None:
    from telemetry import attributes as attr
    from tests.unit.trim.test_agent_context import session

    policy = Policy.load(extra=yaml.safe_load(
        "trim: {overrides: [{match: {tenant: t1}, set: {agent_context: {mode: shadow, keep_turns: 3}}}]}"))
    stage = build(_services(policy=policy))
    assert stage is not None
    messages = session(20)[-1]
    ctx = _ctx([dict(m) for m in messages])
    ctx.lane = "upstream"
    await stage.run(ctx)
    assert ctx.body["messages"] == messages and "x-tierlane-mask" not in ctx.response_headers
    assert ctx.attributes[attr.MASK_MODE] == "shadow" and ctx.attributes[attr.MASKED_TOKENS] > 0
    on = Policy.load(extra=yaml.safe_load("trim: {agent_context: {mode: 'on', keep_turns: 3}}"))
    ctx = _ctx([dict(m) for m in messages])
    ctx.lane = "upstream"
    await build(_services(policy=on)).run(ctx)  # type: ignore[union-attr]
    assert ctx.response_headers["x-tierlane-mask"].startswith("masked=")
    assert sum(1 for m in ctx.body["messages"] if str(m.get("content")).startswith("[tierlane: the output")) > 0
