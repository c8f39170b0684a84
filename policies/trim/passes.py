"""The trim passes: each takes the working messages and returns fewer or shorter ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.trim.config import TrimPolicy
from policies.trim.messages import SYSTEM_ROLES, TOOL_ROLES, TokenCounter, map_texts
from policies.trim.text import collapse_repeats, normalise_whitespace

HISTORY_MARKER = "[tierlane: {n} earlier messages ({tokens} tokens) omitted to fit the context budget]"
TOOL_OUTPUT_MARK = "tokens of tool output omitted by tierlane"
HISTORY_REASON = "outside the history budget"


@dataclass(slots=True)
class Item:
    """One working message and where it came from."""

    index: int  # position in the request's messages; -1 for a marker the trim inserted
    msg: dict[str, Any]
    pinned: bool  # the last user message and what the policy pins: never cut or dropped
    # what the policy pins: never changed at all
    fixed: bool = False
    # a tool result the model has not answered yet (after the last assistant message): never cut,
    # since it is what the model must act on now
    unseen: bool = False


@dataclass(slots=True, frozen=True)
class Dropped:
    """A message a pass removed from the prompt."""

    index: int
    role: str
    tokens: int
    reason: str


# Roles whose text no lossless pass rewrites. Tool results are what an agent read (files, command
# output) and the base of its next exact-string edit (only the opt-in budget cut changes them). A
# user message is the user's own words: the newest is byte-identical to what the client sent (an
# upstream that matches prompts exactly, a replay or a cache keyed on the last turn, must still
# recognise the question), and since every user message was once the newest, none is rewritten
# later either, so each turn's prompt stays a byte-identical prefix of the next.
_VERBATIM_ROLES = frozenset({*TOOL_ROLES, "user"})
VERBATIM_ROLES = _VERBATIM_ROLES


def _rewrite(items: list[Item], counter: TokenCounter, fn: Any) -> list[Item]:
    out = []
    for item in items:
        if not item.fixed and item.msg["role"] not in _VERBATIM_ROLES:
            new = map_texts(item.msg, fn)
            # A rewrite that does not save tokens with this tokenizer is not worth the change.
            if new is not item.msg and counter.message(new) < counter.message(item.msg):
                item = Item(item.index, new, item.pinned, item.fixed, item.unseen)
        out.append(item)
    return out


def whitespace_pass(items: list[Item], policy: TrimPolicy, counter: TokenCounter) -> tuple[list[Item], list[Dropped]]:
    return _rewrite(items, counter, normalise_whitespace), []


def boilerplate_pass(items: list[Item], policy: TrimPolicy, counter: TokenCounter) -> tuple[list[Item], list[Dropped]]:
    def fn(text: str) -> str:
        return collapse_repeats(text, policy.boilerplate_min_repeats, policy.boilerplate_min_paragraph_chars)

    return _rewrite(items, counter, fn), []


def _dedupable(msg: dict[str, Any]) -> bool:
    # Tool results and tool calls are paired by id; removing one would orphan the other.
    return msg["role"] not in TOOL_ROLES and not msg.get("tool_calls") and not msg.get("function_call")


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["role"] == b["role"] and a.get("content") == b.get("content") and a.get("name") == b.get("name")


def duplicates_pass(items: list[Item], policy: TrimPolicy, counter: TokenCounter) -> tuple[list[Item], list[Dropped]]:
    out: list[Item] = []
    dropped: list[Dropped] = []
    system_seen: list[dict[str, Any]] = []
    for item in items:
        msg = item.msg
        if _dedupable(msg) and item.index >= 0:
            if msg["role"] in SYSTEM_ROLES and not item.pinned and any(_same(msg, s) for s in system_seen):
                dropped.append(Dropped(item.index, msg["role"], counter.message(msg), "repeated system prompt"))
                continue
            prev = out[-1] if out else None
            if prev is not None and prev.index >= 0 and _dedupable(prev.msg) and _same(prev.msg, msg):
                if not item.pinned:
                    dropped.append(Dropped(item.index, msg["role"], counter.message(msg), "duplicate of the previous message"))
                    continue
                if not prev.pinned:
                    dropped.append(Dropped(prev.index, prev.msg["role"], counter.message(prev.msg), "duplicate of the next message"))
                    out.pop()
            if msg["role"] in SYSTEM_ROLES:
                system_seen.append(msg)
        out.append(item)
    return out, dropped


def _cut(text: str, counter: TokenCounter, budget: int, from_end: bool) -> str:
    """The longest head (or tail) of `text` within `budget` tokens, ending on a line break when one is near."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        piece = text[len(text) - mid:] if from_end else text[:mid]
        if counter.count_text(piece) <= budget:
            lo = mid
        else:
            hi = mid - 1
    piece = text[len(text) - lo:] if from_end else text[:lo]
    nl = piece.find("\n") if from_end else piece.rfind("\n")
    if nl >= 0 and (nl < len(piece) // 4 if from_end else nl > len(piece) * 3 // 4):
        piece = piece[nl + 1:] if from_end else piece[:nl]
    return piece


def _truncate(text: str, policy: TrimPolicy, counter: TokenCounter) -> str:
    limit = policy.tool_output
    total = counter.text(text)
    if total <= limit.max_tokens:
        return text
    head_budget, tail_budget = limit.head_tokens, limit.tail_tokens
    while True:
        head = _cut(text, counter, head_budget, from_end=False) if head_budget else ""
        tail = _cut(text, counter, tail_budget, from_end=True) if tail_budget else ""
        omitted = max(0, total - counter.text(head) - counter.text(tail))
        out = f"{head.rstrip()}\n[… {omitted} {TOOL_OUTPUT_MARK} …]\n{tail.lstrip(chr(10))}"
        if counter.text(out) <= limit.max_tokens or (head_budget == 0 and tail_budget == 0):
            return out
        head_budget, tail_budget = head_budget * 3 // 4, tail_budget * 3 // 4


def tool_output_pass(items: list[Item], policy: TrimPolicy, counter: TokenCounter) -> tuple[list[Item], list[Dropped]]:
    out = []
    for item in items:
        if item.msg["role"] in TOOL_ROLES and not item.pinned and not item.unseen:
            new = map_texts(item.msg, lambda t: _truncate(t, policy, counter))
            if new is not item.msg and counter.message(new) < counter.message(item.msg):
                item = Item(item.index, new, item.pinned, item.fixed, item.unseen)
        out.append(item)
    return out, []


def _turns(items: list[Item], lo: int, hi: int) -> list[list[int]]:
    """Positions lo..hi-1 grouped into turns, each starting at a user message, so tool pairs stay together."""
    turns: list[list[int]] = []
    for pos in range(lo, hi):
        if not turns or items[pos].msg["role"] == "user":
            turns.append([])
        turns[-1].append(pos)
    return turns


def _marker(n: int, tokens: int) -> dict[str, Any]:
    return {"role": "system", "content": HISTORY_MARKER.format(n=n, tokens=tokens)}


def history_pass(items: list[Item], policy: TrimPolicy, counter: TokenCounter) -> tuple[list[Item], list[Dropped]]:
    budget = policy.history_budget
    if budget is None:
        return items, []
    total = sum(counter.message(i.msg) for i in items)
    if total <= budget:
        return items, []
    roles = [i.msg["role"] for i in items]
    users = [p for p, r in enumerate(roles) if r == "user"]
    if len(users) < 2:
        return items, []
    # Between the first and the last user message; the system prompt, both ends and what follows stay.
    turns = _turns(items, users[0] + 1, users[-1])
    keep: set[int] = set(range(len(items))) - {p for t in turns for p in t}
    fixed = [t for t in turns if any(items[p].pinned or roles[p] in SYSTEM_ROLES for p in t)]
    for t in fixed:
        keep.update(t)
    left = budget - sum(counter.message(items[p].msg) for p in keep)
    if policy.history.marker and all(i.index >= 0 for i in items):
        # Room for the marker, or the marked prompt would overshoot the budget and a second trim cut again.
        left -= counter.message(_marker(10**6, 10**9))
    for t in reversed([t for t in turns if t not in fixed]):
        cost = sum(counter.message(items[p].msg) for p in t)
        if cost > left:
            break
        keep.update(t)
        left -= cost
    drop = [p for p in range(len(items)) if p not in keep]
    if not drop:
        return items, []
    dropped = [Dropped(items[p].index, roles[p], counter.message(items[p].msg), HISTORY_REASON) for p in drop]
    out = [items[p] for p in sorted(keep)]
    saved = sum(d.tokens for d in dropped)
    if policy.history.marker and counter.message(_marker(len(dropped), saved)) < saved:
        out.insert(sum(1 for p in keep if p < drop[0]), Item(-1, _marker(len(dropped), saved), True, True))
    return out, dropped


PASS_FUNCTIONS = {
    "whitespace": whitespace_pass,
    "boilerplate": boilerplate_pass,
    "duplicates": duplicates_pass,
    "tool_output": tool_output_pass,
    "history": history_pass,
}
