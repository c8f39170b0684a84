"""Two consecutive turns of an agent session reach the upstream with their shared part unchanged.

A provider's prompt cache (most of an agent session's bill) reads only an exact prefix: tools in
the same order, the same system entries where they were, the same key order, no per-request ids,
no earlier message rewritten. The real CLIs (Claude Code over the Messages front door, Codex over
Responses, with its default model and the gpt-5.5 tool set) run a session through the gateway on
the shipped trim policy with observation masking in shadow mode, to a chat upstream that routes
its prompt cache by `prompt_cache_key`; every main-loop request must extend the one before it:
each field but `messages` the same bytes, and the earlier request's messages a byte-identical
prefix of the next one's. The upstream also gets one `prompt_cache_key` for the whole session.

Codex also runs against a member that serves only the Messages API (`apis: [messages]`, as
api.anthropic.com): the gateway translates each turn and places the cache breakpoints, so the
same check runs on the translated bodies, the breakpoints aside (Anthropic's cache key is the
content, not the marks); every body carries at most 4 of them, one on the conversation's last block.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.upstream.to_messages import marked, unmarked
from tests.integration.test_agents import ALIASES
from tests.support import agents
from tests.support.agent_model import MODEL, AgentModel
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.native_agent_model import native_app

pytestmark = pytest.mark.agents

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "policies" / "trim").glob("*.py"))[:6]


def shipped_with_shadow_masking() -> dict[str, Any]:
    base = copy.deepcopy(PASS_THROUGH)
    base["policy"]["trim"] = {"agent_context": {"mode": "shadow", "keep_turns": 2}}
    return base


def first_divergence(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """Where `after` stops extending `before` (None: it extends it), in wire order."""
    if list(before) != list(after):
        return f"top-level keys {list(before)} -> {list(after)}"
    for key in before:
        if key != "messages" and orjson.dumps(before[key]) != orjson.dumps(after[key]):
            return f"field {key!r}"
    old, new = before["messages"], after["messages"]
    if len(new) < len(old):
        return f"messages shrank {len(old)} -> {len(new)}"
    for i, message in enumerate(old):
        if orjson.dumps(message) != orjson.dumps(new[i]):
            return f"messages[{i}]: {orjson.dumps(message)[:200]!r} -> {orjson.dumps(new[i])[:200]!r}"
    return None


@pytest.mark.parametrize(("agent", "model", "wire"), [(agents.CLAUDE, None, "chat"), (agents.CODEX, None, "chat"),
                                                     (agents.CODEX, agents.CODEX_TOOLS_MODEL, "chat"),
                                                     (agents.CODEX, None, "messages"),
                                                     (agents.CODEX, agents.CODEX_TOOLS_MODEL, "messages")],
                         ids=["claude", "codex", "codex-tools", "codex-messages", "codex-tools-messages"])
def test_each_turn_extends_the_last_byte_for_byte(bg, make_gateway, tmp_path: Path, agent: Any, model: str | None,
                                                  wire: str):
    work = tmp_path / "work"
    work.mkdir()
    for source in FILES:
        (work / source.name).write_bytes(source.read_bytes())
    scripted = AgentModel(files=[str(work / source.name) for source in FILES], quote_chars=20)
    upstream = RunningApp(bg, scripted.app() if wire == "chat" else native_app(scripted))
    member = (upstream_cfg("model", upstream.url + "/v1", models=[MODEL], prompt_cache_key=True) if wire == "chat" else
              upstream_cfg("model", upstream.url + "/v1", models=[MODEL], apis=["messages"]))
    try:
        gw = make_gateway(base=shipped_with_shadow_masking(), model_aliases=ALIASES, upstreams=[member])
        out = agents.run(agent, gw.url, work, tmp_path / "home", "Read each file in turn.", model=model)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    finally:
        upstream.stop()
    bodies = [orjson.loads(raw) for raw in scripted.raw]
    loop = [body for body in bodies if body.get("tools")]  # the main loop (side calls carry no tools)
    assert len(loop) >= len(FILES) + 1, len(loop)
    if wire == "messages":
        for body in bodies:
            marks = marked(body)
            last = f"messages[{len(body['messages']) - 1}][{len(body['messages'][-1]['content']) - 1}]"
            assert len(marks) <= 4 and last in marks, marks
        loop = [unmarked(body) for body in loop]
    for turn in range(1, len(loop)):
        assert first_divergence(loop[turn - 1], loop[turn]) is None, (turn, first_divergence(loop[turn - 1], loop[turn]))
    if wire == "chat":
        keys = {body.get("prompt_cache_key") for body in loop}
        assert len(keys) == 1 and None not in keys, keys


def test_the_check_sees_a_rewritten_turn() -> None:
    """The comparison itself: a reordered tool list, a changed earlier message or a new id fails it."""
    one = {"model": "m", "messages": [{"role": "user", "content": "a"}], "tools": [{"n": 1}, {"n": 2}]}
    two = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
           "tools": [{"n": 1}, {"n": 2}]}
    assert first_divergence(one, two) is None
    assert first_divergence(one, {**two, "tools": [{"n": 2}, {"n": 1}]}) == "field 'tools'"
    assert first_divergence(one, {**two, "messages": [{"role": "user", "content": "a "}]}) is not None
    assert first_divergence(one, {"messages": two["messages"], "model": "m", "tools": two["tools"]}) is not None
    assert first_divergence(one, {**two, "user": "req-2"}) is not None
