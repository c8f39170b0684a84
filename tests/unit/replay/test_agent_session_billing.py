"""The agent-session bench's billing: Anthropic-style cache breakpoints, the masking floor's bounds,
and the scripted model's tool calls for each kind of step."""

from __future__ import annotations

from typing import Any

import orjson

from bench.masking_floor import bounds
from bench.pricing_upstream import LOOKBACK_BLOCKS, bill_breakpoints, message_blocks
from policies.trim.messages import estimate_tokens
from tests.support.agent_model import AgentModel, Step, tool_call_for

MARK = {"type": "ephemeral"}


def _text(text: str, marked: bool = False) -> dict[str, Any]:
    return {"type": "text", "text": text, **({"cache_control": MARK} if marked else {})}


def _tokens(blocks: list[dict[str, Any]]) -> list[int]:
    return [estimate_tokens(orjson.dumps({k: v for k, v in b.items() if k != "cache_control"}).decode()) for b in blocks]


def test_a_breakpoint_writes_its_prefix_and_a_later_request_reads_it() -> None:
    first = message_blocks({"system": [_text("rules " * 50, marked=True)],
                            "messages": [{"role": "user", "content": "question " * 40}]})
    written: dict[bytes, float] = {}
    tokens = _tokens(first)
    # the system block is written, the unmarked question after it billed in full
    assert bill_breakpoints(first, written, now=0.0) == (0, tokens[0], tokens[1])
    # the next turn marks its last block: the system is read, the rest (moved mark or not) written
    second = message_blocks({"system": [_text("rules " * 50)],
                             "messages": [{"role": "user", "content": "question " * 40},
                                          {"role": "assistant", "content": [_text("answer " * 30)]},
                                          {"role": "user", "content": [_text("again " * 20, marked=True)]}]})
    tokens = _tokens(second)
    # the mark moved to the last block; the system block's prefix is among the 20 before it: read
    assert bill_breakpoints(second, written, now=1.0) == (tokens[0], sum(tokens[1:]), 0)
    third = message_blocks({"system": [_text("rules " * 50)],
                            "messages": [{"role": "user", "content": "question " * 40},
                                         {"role": "assistant", "content": [_text("answer " * 30)]},
                                         {"role": "user", "content": [_text("again " * 20)]},
                                         {"role": "assistant", "content": [_text("more " * 10)]},
                                         {"role": "user", "content": [_text("last " * 10, marked=True)]}]})
    tokens = _tokens(third)
    # the prefix the second request wrote (4 blocks) is found looking back from the new mark
    assert bill_breakpoints(third, written, now=2.0) == (sum(tokens[:4]), sum(tokens[4:]), 0)


def test_a_prefix_further_back_than_the_lookback_and_an_expired_one_are_not_read() -> None:
    head = [_text(f"block {i} " * 5) for i in range(3)]
    marked_head = [*head[:-1], {**head[-1], "cache_control": MARK}]
    written: dict[bytes, float] = {}
    bill_breakpoints(message_blocks({"messages": [{"role": "user", "content": marked_head}]}), written, now=0.0)
    tail = [_text(f"tail {i} ") for i in range(LOOKBACK_BLOCKS + 1)]
    far = [*head, *tail[:-1], {**tail[-1], "cache_control": MARK}]
    read, _, _ = bill_breakpoints(message_blocks({"messages": [{"role": "user", "content": far}]}), dict(written), now=1.0)
    assert read == 0
    near = [*head, *tail[:LOOKBACK_BLOCKS - 1], {**tail[LOOKBACK_BLOCKS - 1], "cache_control": MARK}]
    read, _, _ = bill_breakpoints(message_blocks({"messages": [{"role": "user", "content": near}]}), dict(written), now=1.0)
    assert read == sum(_tokens(message_blocks({"messages": [{"role": "user", "content": head}]})))
    read, _, _ = bill_breakpoints(message_blocks({"messages": [{"role": "user", "content": near}]}), dict(written), now=1e6)
    assert read == 0


def _responses_session(calls: int) -> list[dict[str, Any]]:
    """A Responses session: each call adds a tool call and its output (1,000 characters) to the input."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "read the files"}]
    session = []
    for i in range(calls):
        session.append({"path": "/v1/responses", "body": {"instructions": "be brief", "input": list(items)}})
        items += [{"type": "function_call", "call_id": f"c{i}", "name": "exec_command", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": str(i) * 1000}]
    return session


def test_the_masking_floor_drops_only_tool_results_older_than_the_kept_calls() -> None:
    out = bounds(_responses_session(6), keep=2)
    # call i (0-based) first carries output i-1; those 2 calls old or more go: call 3 drops output 0, call 4
    # outputs 0-1, call 5 outputs 0-2
    dropped = sum(estimate_tokens(orjson.dumps(str(j) * 1000).decode()) for j in (0, 0, 1, 0, 1, 2))
    assert out["model_calls"] == 6
    assert out["oracle_masked_tokens"] == dropped
    assert out["pass_through"]["read"] - out["oracle_mask"]["read"] == dropped
    assert out["oracle_mask"]["written"] == out["pass_through"]["written"] == out["write_once"]["written"]
    assert out["write_once"]["read"] == 0
    assert out["write_once"]["usd"] < out["oracle_mask"]["usd"] < out["pass_through"]["usd"]


CLAUDE_TOOLS = [{"type": "function", "function": {"name": n}} for n in ("Bash", "Edit", "Read")]
CODEX_TOOLS = [{"type": "function", "function": {"name": "exec"}}]


def test_each_step_is_asked_for_with_the_agents_own_tool() -> None:
    read, search = Step("/w/a.py"), Step("/w", "search", pattern="handler")
    edit = Step("/w/a.py", "edit", old="    x = 1", new="    x = 2")
    claude = [tool_call_for(CLAUDE_TOOLS, s) for s in (read, search, edit)]
    assert [(c.name, c.arguments) for c in claude if c] == [
        ("Read", {"file_path": "/w/a.py"}),
        ("Bash", {"command": "grep -rn -- handler /w", "description": "Search the file"}),
        ("Edit", {"file_path": "/w/a.py", "old_string": "    x = 1", "new_string": "    x = 2"})]
    codex = [tool_call_for(CODEX_TOOLS, s) for s in (read, search, edit)]
    assert [c.arguments["input"].split("(")[0] for c in codex if c] == ["const out = await tools.exec_command"] * 2 + [
        "const out = await tools.apply_patch"]
    assert "*** Update File: /w/a.py\\n@@\\n-    x = 1\\n+    x = 2\\n" in codex[2].arguments["input"]  # type: ignore[union-attr]
    assert tool_call_for(CLAUDE_TOOLS, "/w/b.py") == tool_call_for(CLAUDE_TOOLS, Step("/w/b.py"))


def test_the_script_runs_its_steps_in_order_then_answers() -> None:
    steps = [Step("/w/a.py"), Step("/w", "search", pattern="x"), Step("/w/a.py", "edit", old="a", new="b")]
    model = AgentModel(files=["/w/a.py"], steps=steps)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    names = []
    for _ in range(4):
        reply, finish = model.reply({"messages": messages, "tools": CLAUDE_TOOLS})
        if finish != "tool_calls":
            break
        names.append(reply["tool_calls"][0]["function"]["name"])
        messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "done"}]
    assert names == ["Read", "Bash", "Edit"] and finish == "stop"
    assert AgentModel(files=["/w/a.py", "/w/b.py"]).script == [Step("/w/a.py"), Step("/w/b.py")]
