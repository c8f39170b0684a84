"""Observation masking over agent sessions: cache-aligned steps, priced, never the recent turns."""

from __future__ import annotations

from typing import Any

import pytest

from policies.trim import TrimPolicy, TrimPolicyError, trim_request
from policies.trim.agent_context import CachePrices
from policies.trim.messages import TokenCounter, estimate_tokens

ON = {"agent_context": {"mode": "on", "keep_turns": 3}}


def session(turns: int, file_lines: int = 300, ids: int | None = None) -> list[list[dict[str, Any]]]:
    """Each request of an agent session that reads a file per turn: request t holds t tool turns.
    `ids`: call ids repeat with this period (some clients number calls per turn), the tools alternate."""
    system = {"role": "system", "content": "You are a coding agent. Use the tools."}
    history: list[dict[str, Any]] = [system, {"role": "user", "content": "Fix the failing test."}]
    requests = [list(history)]
    for t in range(turns):
        call = f"call_{t if ids is None else t % ids}"
        tool = "Read" if ids is None or t % 2 == 0 else "Cat"
        history.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call, "type": "function", "function": {"name": tool, "arguments": f'{{"file_path": "f{t}.py"}}'}}]})
        listing = "".join(f"{n:>6}\tvalue_{t}_{n} = compute({n}, {t})  # step {n}\n" for n in range(1, file_lines))
        history.append({"role": "tool", "tool_call_id": call, "content": listing})
        requests.append(list(history))
    return requests


def sent(requests: list[list[dict[str, Any]]], section: dict[str, Any], prices: CachePrices | None = None
         ) -> list[tuple[list[dict[str, Any]], Any]]:
    policy = TrimPolicy.from_dict(section)
    out = []
    for messages in requests:
        result = trim_request({"model": "m", "messages": messages}, policy, None, prices)
        out.append((result.body["messages"], result.mask))
    return out


def billed(bodies: list[list[dict[str, Any]]], prices: CachePrices) -> float:
    """What a prompt-caching provider bills, in input-price units: the prefix the previous request
    shared (whole messages) is read, the rest written."""
    counter = TokenCounter.create(None, 4, 85)
    total, previous = 0.0, []
    for body in bodies:
        shared = 0
        while shared < min(len(body), len(previous)) and body[shared] == previous[shared]:
            shared += 1
        read = counter.messages(body[:shared])
        total += read * prices.read + (counter.messages(body) - read) * prices.write
        previous = body
    return total


def test_masking_is_off_as_shipped_and_shadow_changes_nothing() -> None:
    requests = session(20)
    assert all(body == messages for (body, _), messages in zip(sent(requests, {}), requests))
    shadow = sent(requests, {"agent_context": {"mode": "shadow", "keep_turns": 3}})
    assert all(body == messages for (body, _), messages in zip(shadow, requests))
    assert shadow[-1][1].masked_tokens > 0  # what it would have saved is still planned


def test_old_results_are_masked_in_steps_and_the_prefix_is_stable_between_them() -> None:
    requests = session(30)
    out = sent(requests, ON)
    steps = [i for i, (_, mask) in enumerate(out) if mask.step]
    assert 1 <= len(steps) <= 8, steps  # steps, not a rewrite every turn
    for i in range(1, len(out)):
        before, after = out[i - 1][0], out[i][0]
        if i not in steps:  # between steps, the previous request is a prefix of this one, byte for byte
            assert after[:len(before)] == before, i
    last, mask = out[-1]
    assert mask.masked and mask.masked_tokens > 0
    for position, message in enumerate(last):
        if message["role"] == "tool":
            original = requests[-1][position]
            assert message["tool_call_id"] == original["tool_call_id"]  # pairs stay whole
            if position in mask.masked:
                assert message["content"].startswith("[tierlane: the output of this Read call (")
            else:
                assert message["content"] == original["content"]
    # the last keep_turns turns are never touched
    recent = [p for p, m in enumerate(last) if m["role"] == "tool"][-3:]
    assert not set(recent) & set(mask.masked)


def test_call_ids_reused_across_turns_leave_masked_results_as_they_were_and_name_their_own_tool() -> None:
    requests = session(30, ids=3)
    out = sent(requests, ON)
    steps = [i for i, (_, mask) in enumerate(out) if mask.step]
    for i in range(1, len(out)):
        before, after = out[i - 1][0], out[i][0]
        if i not in steps:  # a later call reusing an id never changes an earlier placeholder
            assert after[:len(before)] == before, i
    last, mask = out[-1]
    assert mask.masked
    for position in mask.masked:
        tool = last[position - 1]["tool_calls"][0]["function"]["name"]  # the call this result answers
        assert last[position]["content"].startswith(f"[tierlane: the output of this {tool} call ("), position


def test_masking_bills_less_than_sending_everything_on_a_caching_provider() -> None:
    prices = CachePrices(read=0.1, write=1.25)
    requests = session(40)
    plain = billed([body for body, _ in sent(requests, {})], prices)
    masked = billed([body for body, _ in sent(requests, ON, prices)], prices)
    assert masked < plain * 0.8, (masked, plain)


def test_no_step_is_taken_where_the_rewrite_costs_more_than_it_saves() -> None:
    requests = session(30)
    dear_writes = CachePrices(read=0.1, write=50.0)
    out = sent(requests, ON, dear_writes)
    assert not any(mask.step or mask.masked for _, mask in out)
    assert all(body == messages for (body, _), messages in zip(out, requests))


def test_short_sessions_and_short_results_are_left_whole() -> None:
    assert all(not mask.masked for _, mask in sent(session(3), ON))
    assert all(not mask.masked for _, mask in sent(session(30, file_lines=4), ON))


def test_the_placeholder_counts_what_it_replaced() -> None:
    body, mask = sent(session(30), ON)[-1]
    first = body[mask.masked[0]]["content"]
    tokens = int(first.split("(")[1].split(" tokens")[0])
    original = session(30)[-1][mask.masked[0]]["content"]
    assert tokens == estimate_tokens(original)


@pytest.mark.parametrize("section", [{"agent_context": {"mode": "always"}}, {"agent_context": {"keep_turns": 0}},
                                     {"agent_context": {"step_share": 0}}, {"agent_context": {"mask": True}}])
def test_bad_masking_settings_fail_at_load(section: dict[str, Any]) -> None:
    with pytest.raises(TrimPolicyError):
        TrimPolicy.from_dict(section)
