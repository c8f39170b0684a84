"""Invariants of trim_request over generated conversations (hypothesis)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.trim import TrimPolicy, trim_request
from policies.trim.messages import VALID_ROLES, TokenCounter, texts
from policies.trim.text import segments
from tests.unit.trim.trim_strategies import chat_requests, policies

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REAL = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _is_marker(msg: dict[str, Any]) -> bool:
    return msg["role"] == "system" and str(msg.get("content")).startswith("[tierlane:")


def _protected(msg: dict[str, Any]) -> list[str]:
    return [t[a:b] for t in texts(msg) for a, b, p in segments(t) if p]


def _check(body: dict[str, Any], section: dict[str, Any], count: Callable[[str], int] | None) -> None:
    policy = TrimPolicy.from_dict(section)
    before = copy.deepcopy(body)
    result = trim_request(body, policy, count)
    assert body == before, "the input was mutated"
    src, out = body["messages"], result.body["messages"]
    assert {k: v for k, v in result.body.items() if k != "messages"} == {k: v for k, v in body.items() if k != "messages"}

    # Roles valid and in order: the non-marker output is the input minus the dropped, in input order.
    gone = {d.index for d in result.dropped}
    kept = [i for i in range(len(src)) if i not in gone]
    real = [m for m in out if not _is_marker(m)]
    assert all(m["role"] in VALID_ROLES for m in out)
    assert [m["role"] for m in real] == [src[i]["role"] for i in kept]

    # The last user message is kept, still the last user message, and byte for byte what the client
    # sent; no kept user message is rewritten (each was once the newest: the prefix holds).
    last_user = max(i for i, m in enumerate(src) if m["role"] == "user")
    assert last_user in kept
    assert [m for m in real if m["role"] == "user"][-1] == src[last_user]
    for i, m in zip(kept, real):
        if m["role"] == "user":
            assert m == src[i]

    # The system prompt survives (whitespace aside), first.
    if src[0]["role"] == "system":
        assert out[0]["role"] == "system" and 0 in kept

    # Code blocks are untouched in every kept message that was not cut as tool output.
    for i, m in zip(kept, real):
        if "tool output omitted by tierlane" not in "".join(texts(m)):
            assert _protected(m) == _protected(src[i])
        assert {k: v for k, v in m.items() if k != "content"} == {k: v for k, v in src[i].items() if k != "content"}

    # Tool results stay paired with the assistant message that called them.
    call_ids = {c["id"] for m in out for c in (m.get("tool_calls") or [])}
    result_ids = {m["tool_call_id"] for m in out if m["role"] == "tool"}
    assert result_ids <= call_ids
    src_pairs = {m["tool_call_id"] for m in src if m["role"] == "tool"}
    assert (call_ids & src_pairs) <= result_ids

    # Never more tokens, and the account adds up.
    counter = TokenCounter.create(count, policy.message_overhead_tokens, policy.image_part_tokens)
    assert result.input_tokens == counter.messages(src)
    assert result.output_tokens == counter.messages(out)
    assert result.output_tokens <= result.input_tokens
    assert result.tokens_saved == result.input_tokens - result.output_tokens
    assert all(v >= 0 for v in result.saved.values())
    assert result.estimated is (count is None)

    # Trimming twice equals trimming once.
    again = trim_request(result.body, policy, count)
    assert again.body == result.body
    assert again.tokens_saved == 0


@FAST
@given(chat_requests(), policies())
def test_invariants_with_estimate(body: dict[str, Any], section: dict[str, Any]) -> None:
    _check(body, section, None)


@REAL
@given(chat_requests(), policies())
def test_invariants_with_edge_tokenizer(edge_count: Callable[[str], int], body: dict[str, Any], section: dict[str, Any]) -> None:
    _check(body, section, edge_count)


@FAST
@given(st.text(alphabet=" \t\n\r`~<>pre/abc#-", max_size=80))
def test_whitespace_normalisation_is_idempotent_and_keeps_code(text: str) -> None:
    from policies.trim.text import normalise_whitespace

    once = normalise_whitespace(text)
    assert normalise_whitespace(once) == once
    assert [once[a:b] for a, b, p in segments(once) if p] == [text[a:b] for a, b, p in segments(text) if p]


@FAST
@given(chat_requests(), st.integers(1, 40))
def test_the_shipped_trim_keeps_the_shared_prefix_of_two_turns_byte_identical(body: dict[str, Any], k: int) -> None:
    """A conversation trimmed now and trimmed again a turn later (more messages after it) reads the
    same up to where the first one ended: the provider's cached prefix is never rewritten."""
    policy = TrimPolicy.from_dict({})
    messages = body["messages"]
    now = trim_request({**body, "messages": messages[:k]}, policy, None).body["messages"]
    later = trim_request(body, policy, None).body["messages"]
    assert later[:len(now)] == now
