"""`trim_request`: the passes run in order over a chat request, with what each removed.

Copy on write: every pass (and masking) puts a new dict where it changes a message and shares the
rest, so the request is not copied first; a message no pass changed is the client's own object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from policies.trim import agent_context
from policies.trim.agent_context import CachePrices, MaskPlan
from policies.trim.config import MASKING, PASSES, TrimPolicy
from policies.trim.messages import TOOL_ROLES, TokenCounter, validate_messages
from policies.trim.passes import PASS_FUNCTIONS, Dropped, Item
from policies.trim.report import TrimResult

# Passes only ever shorten, so the rounds converge; two are almost always enough.
_MAX_ROUNDS = 4


def _enabled(policy: TrimPolicy) -> list[str]:
    on = {
        "whitespace": policy.whitespace,
        "boilerplate": policy.boilerplate,
        "duplicates": policy.duplicates,
        "tool_output": policy.tool_output.enabled,
        "history": policy.history_budget is not None,
    }
    return [name for name in PASSES if on[name]]


def _pinned(msg: dict[str, Any], policy: TrimPolicy) -> bool:
    return msg["role"] in policy.pin_roles or (isinstance(msg.get("name"), str) and msg["name"] in policy.pin_names)


def trim_request(
    body: dict[str, Any], policy: TrimPolicy, count_tokens: Callable[[str], int] | None = None,
    prices: CachePrices | None = None,
) -> TrimResult:
    """The trimmed chat request; the input is never mutated.

    The result's body is a new dict with a new messages list; each message no pass changed is the
    input's own object (shared, not copied: no pass writes into a message), so a request nothing
    trims comes out with `result.unchanged` and the same messages, by identity.

    Observation masking (`policy.agent_context`) runs last, over the trimmed messages, with the
    model's cache `prices` (default: Anthropic's ratios); in shadow mode it is planned, not applied.

    Raises `InvalidInput` (with `param`) when the messages are malformed.
    """
    messages = validate_messages(body)
    counter = TokenCounter.create(count_tokens, policy.message_overhead_tokens, policy.image_part_tokens)
    source: list[dict[str, Any]] = list(body["messages"])
    new_body = {**body, "messages": source}
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    # the model has seen a tool result once an assistant message follows it
    answered = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    items = []
    for i, m in enumerate(source):
        fixed = _pinned(m, policy)
        items.append(Item(i, m, fixed or i == last_user, fixed, unseen=i > answered and m["role"] in TOOL_ROLES))
    saved = {name: 0 for name in (*PASSES, MASKING)}
    dropped: list[Dropped] = []
    passes = _enabled(policy) if policy.enabled else []
    for _ in range(_MAX_ROUNDS):
        changed = False
        for name in passes:
            new_items, gone = PASS_FUNCTIONS[name](items, policy, counter)
            if len(new_items) != len(items) or any(a.msg is not b.msg for a, b in zip(new_items, items)):
                changed = True
                saved[name] += _removed(items, new_items, counter)
                dropped.extend(gone)
                items = new_items
        if not changed:
            break
    messages_out = [i.msg for i in items]
    mask = MaskPlan.none()
    if policy.enabled and policy.agent_context.mode != "off":
        mask = agent_context.plan(messages_out, policy.agent_context, prices or CachePrices(), counter.message,
                                  counter.text)
        if policy.agent_context.mode == "on" and mask.masked:
            masked = agent_context.apply(messages_out, mask, counter.text)
            saved[MASKING] = counter.messages(messages_out) - counter.messages(masked)
            messages_out = masked
    new_body["messages"] = messages_out
    return TrimResult(
        body=new_body,
        saved=saved,
        estimated=counter.estimated,
        dropped=sorted(dropped, key=lambda d: d.index),
        source=source,
        counter=counter,
        mask=mask,
    )


def _removed(old: list[Item], new: list[Item], counter: TokenCounter) -> int:
    """Tokens of the messages a pass replaced or dropped, less those it put in; untouched ones are not counted."""
    old_ids = {id(i.msg) for i in old}
    new_ids = {id(i.msg) for i in new}
    gone = sum(counter.message(i.msg) for i in old if id(i.msg) not in new_ids)
    added = sum(counter.message(i.msg) for i in new if id(i.msg) not in old_ids)
    return gone - added
