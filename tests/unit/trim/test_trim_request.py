"""trim_request on hand-built conversations: what each pass removes and what it must leave alone."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import yaml

from gateway.errors import from_policy
from policies.errors import InvalidInput as InvalidRequest
from policies.policy import Policy
from policies.trim import TrimPolicy, TrimPolicyError, trim_request
from policies.trim.text import normalise_whitespace
from tests.unit.trim.builders import assistant, system, tool_call, tool_result, user

CODE = "```python\ndef f(a,  b):\n\n\n    return  a   \n```"


def _default() -> TrimPolicy:
    return TrimPolicy.from_dict(Policy.load().resolve("trim"))


def test_shipped_policy_parses_and_keeps_every_turn() -> None:
    policy = _default()
    assert policy.enabled and policy.history_budget is None


def test_whitespace_squeezed_in_prose(edge_count: Callable[[str], int]) -> None:
    text = "Fix this.  Then that:  \n\n\n\nand `x  =  1` too.\n\n\n"
    body = {"messages": [system(text), user("go")]}
    out = trim_request(body, _default(), edge_count)
    got = out.body["messages"][0]["content"]
    assert got == "Fix this. Then that:\n\nand `x  =  1` too."
    assert out.saved["whitespace"] == edge_count(text) - edge_count(got)
    assert not out.estimated


# Texts whose whitespace is meaning: each passes every lossless pass byte for byte, with its prose too.
CODE_TEXTS = {
    "fenced": f"Fix   this:  \n\n\n\n{CODE}\n\nand   that.  ",
    "indented": "Run it:\n    indented   code  \n\n\n\nthen   stop.",
    "read listing": "".join(f"  {n}\t    def bar(self):  \n" for n in range(1509, 1514)),
    "arrow listing": "     1→import os\n     2→\n     3→x  =  1\n",
    "python": "def f(a,  b):\n\n\n\n    return  a   \n",
    "yaml": "trim:\n  enabled: true\n  whitespace:\n    enabled:   true   # comment\n",
    "makefile": "test:\n\tpytest  -q\n\n\n\nlint:\n\truff check\n",
    "diff": "diff --git a/x.py b/x.py\n@@ -1,3 +1,3 @@\n-    return  1\n+    return  2\n \n",
    "columns": "NAME      READY   STATUS\nweb-1     1/1     Running\n",
    "repeats in code": "for i in x:\n" + "    pass\n" * 5,
}


@pytest.mark.parametrize("name", sorted(CODE_TEXTS))
def test_text_that_carries_code_passes_byte_for_byte(name: str, edge_count: Callable[[str], int]) -> None:
    text = CODE_TEXTS[name]
    body = {"messages": [system(text), user(text), assistant(text), user("next")]}
    out = trim_request(body, TrimPolicy.from_dict({"boilerplate": {"min_repeats": 2, "min_paragraph_chars": 5}}),
                       edge_count)
    assert [m["content"] for m in out.body["messages"][:3]] == [text, text, text]


def test_tool_results_are_never_rewritten_by_default(edge_count: Callable[[str], int]) -> None:
    # Claude Code's Read of a long file: tabs after the line numbers, indentation, over 8 KB
    listing = "".join(f"{n:>6}\t    def bar(self):  # {'x' * 60}\n" for n in range(1, 400))
    log = "start\n" + "WARN retrying connection to db-1\n" * 40 + "done.   Bye.  \n\n\n"
    msgs = [user("read it"), tool_call("c1"), tool_result("c1", listing), assistant("and the log?"),
            tool_call("c2"), tool_result("c2", log), tool_call("c3"), tool_result("c3", listing)]
    out = trim_request({"messages": msgs}, _default(), edge_count)
    assert out.body["messages"] == msgs and out.tokens_saved == 0


def test_pre_blocks_are_left_alone() -> None:
    text = "see  <pre>a    b\n\n\n\nc</pre>  end"
    assert normalise_whitespace(text) == text  # and the prose beside it: the text carries code


def test_user_messages_are_sent_byte_for_byte_and_read_the_same_next_turn(edge_count: Callable[[str], int]) -> None:
    # the user's own words are never rewritten: the newest reaches the upstream as the client sent
    # it, and an earlier one reads as it did when it was the newest, so the cached prefix holds
    last = "  what   about\n\n\n\nthis?  "
    body = {"messages": [user("hi.  there"), assistant("hello.  Ask  away"), user(last)]}
    out = trim_request(body, _default(), edge_count)
    later = trim_request({"messages": [*body["messages"], assistant("that"), user("ok")]}, _default(), edge_count)
    assert out.body["messages"] == later.body["messages"][:3]
    assert [m["content"] for m in out.body["messages"]] == ["hi.  there", "hello. Ask away", last]


def test_repeated_system_prompt_and_retried_message_are_dropped(edge_count: Callable[[str], int]) -> None:
    sp = "You are a careful assistant."
    body = {"messages": [system(sp), user("q1"), user("q1"), assistant("a1"), system(sp), user("q2")]}
    out = trim_request(body, _default(), edge_count)
    assert [m["content"] for m in out.body["messages"]] == [sp, "q1", "a1", "q2"]
    assert {d.index for d in out.dropped} == {2, 4}
    assert out.saved["duplicates"] == out.tokens_saved > 0


def test_retry_of_the_last_user_message_keeps_the_last_one() -> None:
    body = {"messages": [user("same"), user("same")]}
    out = trim_request(body, _default(), None)
    assert out.body["messages"] == [user("same")]
    assert [d.index for d in out.dropped] == [0]


def test_repeated_lines_collapse_to_a_count(edge_count: Callable[[str], int]) -> None:
    log = "start\n" + "WARN retrying connection to db-1\n" * 40 + "done"
    body = {"messages": [user("what did it say?"), assistant("it said:\n" + log), user("and?"),
                         assistant("ok"), user("pasted:\n" + log)]}
    out = trim_request(body, _default(), edge_count)
    got = out.body["messages"][1]["content"]
    assert got == "it said:\nstart\nWARN retrying connection to db-1\n[previous line repeated 39 more times]\ndone"
    assert out.saved["boilerplate"] > 0 and out.lossless_saved == out.tokens_saved
    assert out.body["messages"][4]["content"] == "pasted:\n" + log  # a user's own paste is sent as it came


def test_long_tool_output_keeps_head_and_tail_once_the_model_has_seen_it(edge_count: Callable[[str], int]) -> None:
    lines = "".join(f"row {i}: value={i * 7}\n" for i in range(3000))
    policy = TrimPolicy.from_dict({"tool_output": {"enabled": True, "max_tokens": 300, "head_tokens": 120,
                                                   "tail_tokens": 80}})
    body = {"messages": [user("q"), tool_call("c1"), tool_result("c1", lines), assistant("seen"), user("summarise")]}
    out = trim_request(body, policy, edge_count)
    got = out.body["messages"][2]["content"]
    assert edge_count(got) <= 300
    assert got.startswith("row 0: value=0\n") and got.endswith("row 2999: value=20993\n")
    assert "tokens of tool output omitted by tierlane" in got
    assert out.saved["tool_output"] > 0


def test_the_budget_cut_is_opt_in_and_never_takes_the_newest_results(edge_count: Callable[[str], int]) -> None:
    lines = "".join(f"row {i}: value={i * 7}\n" for i in range(3000))
    msgs = [user("q"), tool_call("c1"), tool_result("c1", lines), assistant("next"), tool_call("c2"),
            tool_result("c2", lines), user("<system-reminder>go on</system-reminder>")]
    assert trim_request({"messages": msgs}, _default(), edge_count).body["messages"] == msgs  # off as shipped
    policy = TrimPolicy.from_dict({"tool_output": {"enabled": True, "max_tokens": 300, "head_tokens": 120,
                                                   "tail_tokens": 80}})
    got = trim_request({"messages": msgs}, policy, edge_count).body["messages"]
    assert "omitted by tierlane" in got[2]["content"]  # answered: the model has seen it whole
    assert got[5] == msgs[5]  # not answered yet: what the model must act on now


def test_history_window_keeps_system_first_and_recent_turns(edge_count: Callable[[str], int]) -> None:
    msgs = [system("Be brief."), user("first question")]
    for i in range(30):
        msgs += [assistant(f"answer number {i} " * 10), user(f"follow-up number {i}")]
    body = {"messages": msgs}
    policy = TrimPolicy.from_dict({"history": {"max_tokens": 300}})
    out = trim_request(body, policy, edge_count)
    got = out.body["messages"]
    assert got[0] == msgs[0] and got[1] == msgs[1] and got[-1] == msgs[-1]
    assert out.output_tokens <= 300
    assert out.saved["history"] > 0 and out.dropped
    kept = [i for i in range(len(msgs)) if i not in {d.index for d in out.dropped}]
    # Dropped ones are the oldest middle turns: what remains after the first user is a contiguous tail.
    assert kept[2:] == list(range(kept[2], len(msgs)))
    assert got[2]["role"] == "user"


def test_history_marker_says_what_was_dropped(edge_count: Callable[[str], int]) -> None:
    msgs = [user("first")] + [m for i in range(20) for m in (assistant(f"reply {i} " * 20), user(f"q{i}"))]
    policy = TrimPolicy.from_dict({"history": {"max_tokens": 200, "marker": True}})
    out = trim_request({"messages": msgs}, policy, edge_count)
    marker = out.body["messages"][1]
    assert marker["role"] == "system"
    assert f"{len(out.dropped)} earlier messages" in marker["content"]
    assert out.output_tokens <= 200


def test_history_never_splits_a_tool_call_from_its_result(edge_count: Callable[[str], int]) -> None:
    msgs = [user("first")]
    for i in range(15):
        msgs += [user(f"look up item {i}"), tool_call(f"c{i}"), tool_result(f"c{i}", f"item {i} is " + "blue " * 30),
                 assistant(f"item {i} is blue")]
    msgs.append(user("thanks"))
    out = trim_request({"messages": msgs}, TrimPolicy.from_dict({"history": {"max_tokens": 400}}), edge_count)
    calls = {c["id"] for m in out.body["messages"] for c in m.get("tool_calls") or []}
    results = {m["tool_call_id"] for m in out.body["messages"] if m["role"] == "tool"}
    assert calls == results and calls and len(calls) < 15


def test_pinned_messages_survive_the_window(edge_count: Callable[[str], int]) -> None:
    msgs = [user("first")]
    for i in range(20):
        msgs += [assistant(f"reply {i} " * 20), user(f"q{i}")]
    msgs[5] = {"role": "assistant", "name": "facts", "content": "the   account id is 7"}
    policy = TrimPolicy.from_dict({"history": {"max_tokens": 200}, "pin": {"names": ["facts"]}})
    out = trim_request({"messages": msgs}, policy, edge_count)
    assert msgs[5] in out.body["messages"]
    assert 5 not in {d.index for d in out.dropped}


def test_content_parts_and_images(edge_count: Callable[[str], int]) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "system", "content": [{"type": "text", "text": "look   at  this  "}, image]},
                         assistant("ok"), user("and?")]}
    out = trim_request(body, _default(), edge_count)
    parts = out.body["messages"][0]["content"]
    assert parts == [{"type": "text", "text": "look at this"}, image]
    # copy on write: the rewritten message is a new dict, the part no pass changed is the client's own
    assert parts[1] is image and body["messages"][0]["content"][0]["text"] == "look   at  this  "


def test_disabled_policy_changes_nothing() -> None:
    body = {"messages": [system("a   b"), system("a   b"), user("c")]}
    out = trim_request(body, TrimPolicy.from_dict({"enabled": False}), None)
    assert out.body == body and out.tokens_saved == 0 and not out.dropped


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [1]}, "messages[0]"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages[0].content[0].text"),
    ],
)
def test_bad_messages_are_invalid_requests(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        trim_request(body, _default(), None)
    assert from_policy(err.value).status == 400 and err.value.param == param


@pytest.mark.parametrize(
    "section",
    [
        {"histroy": {}},
        {"history": {"max_tokens": "lots"}},
        {"history": {"max_tokens": 0}},
        {"tool_output": {"max_tokens": 100, "head_tokens": 60, "tail_tokens": 30}},
        {"pin": {"roles": "system"}},
        {"whitespace": {"enabled": "yes"}},
    ],
)
def test_bad_policy_sections_are_rejected(section: dict) -> None:
    with pytest.raises(TrimPolicyError):
        TrimPolicy.from_dict(section)


def test_policy_overrides_resolve_per_route() -> None:
    policy = Policy.load(extra=yaml.safe_load(
        "trim: {overrides: [{match: {model: small}, set: {history: {max_tokens: 512}}}]}"))
    assert TrimPolicy.from_dict(policy.resolve("trim", model="small")).history_budget == 512
    assert TrimPolicy.from_dict(policy.resolve("trim", model="big")).history_budget is None


def test_nothing_is_copied_where_nothing_changes(edge_count: Callable[[str], int]) -> None:
    """Copy on write: a request no pass changes keeps its messages, each the very object it came with;
    one pass changing one message puts a new dict there and shares the others."""
    body = {"model": "m", "messages": [system("be brief"), user("hi"), assistant("hello"), user("and?")]}
    out = trim_request(body, _default(), edge_count)
    assert out.unchanged and out.body is not body and out.body["messages"] is not body["messages"]
    assert all(a is b for a, b in zip(out.body["messages"], body["messages"], strict=True))
    spaced = {**body, "messages": [system("be   brief  "), *body["messages"][1:]]}
    out = trim_request(spaced, _default(), edge_count)
    assert not out.unchanged and out.body["messages"][0] is not spaced["messages"][0]
    assert all(a is b for a, b in zip(out.body["messages"][1:], spaced["messages"][1:], strict=True))
    assert spaced["messages"][0]["content"] == "be   brief  "  # the input is never written into
