"""The real coding agents through the gateway, with their defaults: Claude Code and Codex.

Each agent (the npm package at its pinned version, tests/support/agents.py) runs non-interactively
against a gateway whose upstream plays the model (tests/support/agent_model.py): it asks for the
agent's own file-read or shell tool on two files whose contents the test chose, and answers only
once both tool outputs came back through the gateway. Both agents stream (their default).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support import agents
from tests.support.agent_model import ANSWER_PREFIX, MODEL, AgentModel
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg

pytestmark = pytest.mark.agents

NOTES = "the secret word is pelican"
TODO = "buy 7 apples"
PROMPT = "Read notes.txt and todo.txt and tell me what they say."
ALIASES = {"claude-*": "auto", "gpt-*": "auto"}


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text(NOTES + "\n")
    (work / "todo.txt").write_text(TODO + "\n")
    return work


def ledger_rows(gw: RunningApp, state: Path, key: str | None = None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    assert httpx.get(gw.url + "/v1/usage", headers=headers, timeout=30).status_code == 200  # flushes the ledger
    conn = sqlite3.connect(state / "ledger.sqlite3")
    conn.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in conn.execute("SELECT * FROM requests ORDER BY id")]
    finally:
        conn.close()


# lanes.agents on (background calls on the cost tier, one tier per session), with the router picking
# between two tiers that are both the scripted model (under two pool names)
AGENT_LANES: dict[str, Any] = {
    **PASS_THROUGH, "embedder": {"enabled": True},
    "policy": {**PASS_THROUGH["policy"], "router": {"enabled": True},
               "lanes": {"upstream": {"tiers": {"cost": {"pool": "standard", "model": MODEL},
                                                "strong": {"pool": "critical", "model": MODEL}}},
                         "agents": {"background": {"enabled": True}, "session_tiers": {"enabled": True}}}},
}


def run_loop(bg, make_gateway, tmp_path: Path, workdir: Path, agent: agents.Agent, model: str | None = None,
             agent_lanes: bool = False) -> tuple[AgentModel, list[dict[str, Any]], str]:
    scripted = AgentModel(files=[str(workdir / "notes.txt"), str(workdir / "todo.txt")])
    upstream = RunningApp(bg, scripted.app())
    try:
        if agent_lanes:
            gw = make_gateway(base=AGENT_LANES, model_aliases=ALIASES, upstreams=[
                upstream_cfg("cost", upstream.url + "/v1", models=[MODEL], pool="standard"),
                upstream_cfg("strong", upstream.url + "/v1", models=[MODEL], pool="critical")])
        else:
            gw = make_gateway(upstreams=[upstream_cfg("model", upstream.url + "/v1", models=[MODEL])],
                              model_aliases=ALIASES)
        out = agents.run(agent, gw.url, workdir, tmp_path / "home", PROMPT, model=model)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        return scripted, ledger_rows(gw, tmp_path / "state"), out.stdout
    finally:
        upstream.stop()


def check_loop(scripted: AgentModel, rows: list[dict[str, Any]], stdout: str, api: str) -> None:
    # the final answer quotes both files: each tool output came back through the gateway
    assert ANSWER_PREFIX in stdout and NOTES in stdout and TODO in stdout, stdout[-2000:]
    assert [row["status"] for row in rows] == [200] * len(rows), [(r["status"], r["error_code"]) for r in rows]
    assert len(rows) == len(scripted.requests) >= 3  # one ledger row per model call; two tool turns and the answer
    assert {row["api"] for row in rows} == {api} and all(row["stream"] for row in rows)
    sessions = {row["session"] for row in rows}
    assert len(sessions) == 1 and None not in sessions  # the agent's session, one key for its whole loop
    # what self-hosted chat templates take: every content a string, never an array of parts
    assert {kind.split(":")[1] for kind in scripted.content_types} == {"str"}, set(scripted.content_types)
    assert all(body.get("stream") for body in scripted.requests)


def test_claude_code_finishes_a_tool_loop(bg, make_gateway, tmp_path, workdir):
    scripted, rows, stdout = run_loop(bg, make_gateway, tmp_path, workdir, agents.CLAUDE)
    check_loop(scripted, rows, stdout, "messages")
    first = scripted.requests[0]
    # its per-turn `system` entries reach the model in place, as system messages after the first
    assert [m["role"] for m in first["messages"]].count("system") >= 2
    assert {row["requested_model"] for row in rows} == {"auto"}
    assert {"Read", "Bash"} <= {tool["function"]["name"] for tool in first["tools"]}


def test_codex_finishes_a_tool_loop_with_its_default_model(bg, make_gateway, tmp_path, workdir):
    # Codex's default model: tools in `additional_tools` items and namespaces, a freeform `exec` tool
    scripted, rows, stdout = run_loop(bg, make_gateway, tmp_path, workdir, agents.CODEX)
    check_loop(scripted, rows, stdout, "responses")
    names = {tool["function"]["name"] for tool in scripted.requests[0]["tools"]}
    assert "exec" in names and "sleep" in names  # the namespaces' tools, flattened
    assert any(m["role"] == "tool" and NOTES in m["content"] for m in scripted.requests[-1]["messages"])


def test_codex_finishes_a_tool_loop_with_custom_and_hosted_tools(bg, make_gateway, tmp_path, workdir):
    # the profile with a custom `apply_patch` (a Lark grammar), a client `tool_search` and a hosted `web_search`
    scripted, rows, stdout = run_loop(bg, make_gateway, tmp_path, workdir, agents.CODEX, model=agents.CODEX_TOOLS_MODEL)
    check_loop(scripted, rows, stdout, "responses")
    tools = {tool["function"]["name"]: tool["function"] for tool in scripted.requests[0]["tools"]}
    assert tools["apply_patch"]["parameters"]["required"] == ["input"]
    assert "tool_search" in tools and "web_search" not in tools


@pytest.mark.parametrize(("agent", "api"), [(agents.CLAUDE, "messages"), (agents.CODEX, "responses")],
                         ids=["claude-code", "codex"])
def test_the_agents_finish_with_background_lanes_and_session_tiers_on(bg, make_gateway, tmp_path, workdir, agent, api):
    scripted, rows, stdout = run_loop(bg, make_gateway, tmp_path, workdir, agent, agent_lanes=True)
    check_loop(scripted, rows, stdout, api)
    main = [row for row in rows if row["route_reason"] != "background"]
    assert len(main) >= 3 and all(row["route_reason"].startswith("session_") for row in main), \
        [(row["tier"], row["route_reason"]) for row in rows]
    assert len({row["tier"] for row in main}) == 1 and None not in {row["tier"] for row in main}  # one tier
    assert all(row["tier"] == "cost" for row in rows if row["route_reason"] == "background")


def test_the_scripted_model_speaks_the_chat_wire(bg, tmp_path):
    """The stand-in for a model is checked with the `openai` SDK itself, streamed and whole."""
    scripted = AgentModel(files=[str(tmp_path / "a.txt")])
    upstream = RunningApp(bg, scripted.app())
    try:
        client = openai.OpenAI(base_url=upstream.url + "/v1", api_key="x", max_retries=0)
        tools: Any = [{"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}}]
        messages: Any = [{"role": "user", "content": "Read a.txt"}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
        call = whole.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "Read"  # type: ignore[union-attr]
        assert whole.usage is not None and whole.usage.total_tokens > 0
        stream = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments or ""  # type: ignore[index, union-attr]
                            for c in chunks if c.choices and c.choices[0].delta.tool_calls)
        assert arguments == call.function.arguments  # type: ignore[union-attr]
        assert chunks[-1].usage is not None and not chunks[-1].choices
        messages += [{"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "forty-two"}]
        final = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
        assert final.choices[0].finish_reason == "stop" and "forty-two" in (final.choices[0].message.content or "")
    finally:
        upstream.stop()


# The same loops through the official SDKs, with every field the two agents send -----------------


def test_the_messages_loop_through_the_anthropic_sdk_with_claude_codes_fields(bg, make_gateway, tmp_path, workdir):
    import anthropic

    scripted = AgentModel(files=[str(workdir / "notes.txt")])
    upstream = RunningApp(bg, scripted.app())
    try:
        gw = make_gateway(upstreams=[upstream_cfg("model", upstream.url + "/v1", models=[MODEL])], model_aliases=ALIASES)
        sdk = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0, default_headers={
            "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
                              "per-turn-control-2026-07-01,effort-2025-11-24", "x-app": "cli"})
        tools: Any = [{"name": "Read", "description": "Read a file.", "input_schema": {
                          "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}},
                      {"name": "Later", "description": "Loaded on demand.", "input_schema": {"type": "object"},
                       "defer_loading": True}]
        messages: Any = [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"},
                                                      {"type": "text", "text": PROMPT}]},
                         {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: here"}]}]
        fields: Any = dict(
            model=agents.CLAUDE_MODEL, max_tokens=128000, tools=tools,
            system=[{"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
            metadata={"user_id": '{"device_id":"d","account_uuid":"","session_id":"sess-sdk"}'},
            extra_body={"thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "medium"},
                        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}})
        with sdk.messages.stream(messages=messages, **fields) as stream:
            first = stream.get_final_message()
        assert first.stop_reason == "tool_use" and first.model == agents.CLAUDE_MODEL
        call = next(block for block in first.content if block.type == "tool_use")
        assert call.name == "Read" and call.input == {"file_path": str(workdir / "notes.txt")}
        messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": [{"type": "text", "text": NOTES}]}]}]
        with sdk.messages.stream(messages=messages, **fields) as stream:
            final = stream.get_final_message()
            headers = stream.response.headers
        assert headers["x-tierlane-model"] == MODEL and "tools.defer_loading" in headers["x-tierlane-dropped"]
        assert final.stop_reason == "end_turn" and NOTES in final.content[0].text and final.model == agents.CLAUDE_MODEL
        rows = ledger_rows(gw, tmp_path / "state")
        assert [r["status"] for r in rows] == [200, 200] and {r["session"] for r in rows} == {"sess-sdk"}
        assert [m["role"] for m in scripted.requests[0]["messages"]] == ["system", "user", "system"]
    finally:
        upstream.stop()


def test_the_responses_loop_through_the_openai_sdk_with_codexs_fields(bg, make_gateway, tmp_path, workdir):
    scripted = AgentModel(files=[str(workdir / "notes.txt")])
    upstream = RunningApp(bg, scripted.app())
    try:
        gw = make_gateway(upstreams=[upstream_cfg("model", upstream.url + "/v1", models=[MODEL])], model_aliases=ALIASES)
        sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        exec_tool = {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
                     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
        tools: Any = [exec_tool,
                      {"type": "custom", "name": "apply_patch", "description": "Edit files.",
                       "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
                      {"type": "tool_search", "execution": "client", "description": "Find tools.",
                       "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}},
                      {"type": "web_search", "external_web_access": False},
                      {"type": "namespace", "name": "clock", "description": "Time.", "tools": [
                          {"type": "function", "name": "sleep", "parameters": {"type": "object"}}]}]
        inputs: Any = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
                       {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}]
        fields: Any = dict(model=agents.CODEX_TOOLS_MODEL, tools=tools, tool_choice="auto", parallel_tool_calls=True,
                           reasoning={"effort": "medium"}, store=False, include=["reasoning.encrypted_content"],
                           prompt_cache_key="sess-codex", text={"verbosity": "low"},
                           extra_body={"client_metadata": {"session_id": "sess-codex", "turn_id": "t1"}})
        with sdk.responses.stream(input=inputs, **fields) as stream:
            first = stream.get_final_response()
        call = first.output[0]
        assert call.type == "function_call" and call.name == "exec_command" and first.model == agents.CODEX_TOOLS_MODEL
        inputs += [call.model_dump(exclude_none=True),
                   {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
                   {"type": "function_call_output", "call_id": call.call_id, "output": NOTES}]
        with sdk.responses.stream(input=inputs, **fields) as stream:
            final = stream.get_final_response()
        assert NOTES in final.output_text and final.status == "completed"
        rows = ledger_rows(gw, tmp_path / "state")
        assert [r["status"] for r in rows] == [200, 200] and {r["session"] for r in rows} == {"sess-codex"}
        names = [t["function"]["name"] for t in scripted.requests[0]["tools"]]
        assert names == ["exec_command", "apply_patch", "tool_search", "sleep"]
    finally:
        upstream.stop()
