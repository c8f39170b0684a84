"""What a coding agent reads reaches the model whole: the real CLIs through the shipped trim policy.

Claude Code and Codex each read real files (a standard-library Python module of over 8 KB, the
project's Makefile with its tabs, a YAML policy) through a gateway on the shipped trim policy. A
recording proxy between the agent and the gateway keeps what the agent sent, and every tool result
must reach the upstream byte-identical on its first appearance. (The shipped whitespace pass once
turned Claude Code's `  12\\t    def f` into `  12 def f`, and the tool-output budget cut every file
over about 8 KB, the newest included; the agents still finished, so only a byte comparison sees it.)
"""

from __future__ import annotations

import copy
import re
import textwrap
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.integration.test_agents import ALIASES, ledger_rows
from tests.support import agents
from tests.support.agent_model import ANSWER_PREFIX, MODEL, AgentModel
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.recording_proxy import RecordingProxy

pytestmark = pytest.mark.agents

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"wrap.py": Path(textwrap.__file__), "Makefile": ROOT / "Makefile",
           "trim.yaml": ROOT / "policies" / "defaults" / "trim.yaml"}
_LISTING = re.compile(r"^ *(\d+)[\t→](.*)$")


def shipped_trim() -> dict[str, Any]:
    """The pass-through test settings with the trim policy as shipped (no `trim` section of its own)."""
    base = copy.deepcopy(PASS_THROUGH)
    del base["policy"]["trim"]
    return base


def agent_tool_results(recorded: list[Any]) -> dict[str, str]:
    """Each tool result the agent sent, by call id, as its text (the first time it was sent)."""
    out: dict[str, str] = {}
    for request in recorded:
        if request.method != "POST" or not request.body:
            continue
        body = orjson.loads(request.body)
        for message in body.get("messages") or ():  # Messages: tool_result blocks in user turns
            for block in message.get("content") if isinstance(message.get("content"), list) else ():
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    content = block.get("content")
                    text = content if isinstance(content, str) else "\n".join(
                        str(p.get("text") or "") for p in content or () if p.get("type") == "text")
                    out.setdefault(block["tool_use_id"], ("Error: " if block.get("is_error") else "") + text)
        for item in body.get("input") if isinstance(body.get("input"), list) else ():  # Responses: output items
            if isinstance(item, dict) and item.get("type") in ("function_call_output", "custom_tool_call_output"):
                output = item.get("output")
                text = output if isinstance(output, str) else "".join(str(p.get("text") or "") for p in output)
                out.setdefault(item["call_id"], text)
    return out


def first_seen_upstream(requests: list[dict[str, Any]]) -> dict[str, str]:
    """Each tool message the upstream got, by call id, as it was the first time."""
    out: dict[str, str] = {}
    for body in requests:
        for message in body.get("messages") or ():
            if message.get("role") == "tool":
                out.setdefault(message["tool_call_id"], message.get("content"))
    return out


def listing(text: str) -> list[str]:
    """The file lines of a numbered listing (`cat -n`, Claude Code's Read), in order."""
    return [m.group(2) for line in text.split("\n") if (m := _LISTING.match(line))]


@pytest.mark.parametrize(("agent", "model"), [(agents.CLAUDE, None), (agents.CODEX, None),
                                             (agents.CODEX, agents.CODEX_TOOLS_MODEL)],
                         ids=["claude", "codex", "codex-tools"])
def test_every_file_an_agent_reads_reaches_the_model_byte_identical(bg, make_gateway, tmp_path: Path, agent: Any,
                                                                     model: str | None):
    work = tmp_path / "work"
    work.mkdir()
    for name, source in SOURCES.items():
        (work / name).write_bytes(source.read_bytes())
    assert len((work / "wrap.py").read_bytes()) > 8192 and "\t" in (work / "Makefile").read_text()
    scripted = AgentModel(files=[str(work / name) for name in SOURCES], quote_chars=40)
    upstream = RunningApp(bg, scripted.app())
    proxy_state = None
    try:
        gw = make_gateway(base=shipped_trim(), upstreams=[upstream_cfg("model", upstream.url + "/v1", models=[MODEL])],
                          model_aliases=ALIASES)
        proxy_state = RecordingProxy(gw.url)
        proxy = RunningApp(bg, proxy_state.app())
        try:
            out = agents.run(agent, proxy.url, work, tmp_path / "home", "Read wrap.py, Makefile and trim.yaml.",
                             model=model)
        finally:
            proxy.stop()
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        assert ANSWER_PREFIX in out.stdout, out.stdout[-2000:]
        rows = ledger_rows(gw, tmp_path / "state")
        assert rows and {r["status"] for r in rows} == {200}
    finally:
        upstream.stop()

    sent = agent_tool_results(proxy_state.requests)
    received = first_seen_upstream(scripted.requests)
    assert len(received) >= len(SOURCES), received.keys()
    for call_id, text in received.items():
        assert call_id in sent, call_id
        assert text == sent[call_id], f"tool result {call_id} changed on its way: {len(sent[call_id])} -> {len(text)} chars"
    # and what the agent sent is the files themselves, so the comparison above is over real reads
    results = list(received.values())
    for name in SOURCES:
        lines = (work / name).read_text().split("\n")
        if agent is agents.CLAUDE:
            assert any(listing(r)[:len(lines) - 1] == lines[:-1] for r in results), name  # the whole file, numbered
        else:
            opening = "\n".join(lines[:12])
            # Codex's default model reads through its JavaScript `exec` tool, which returns JSON
            quoted = orjson.dumps(opening).decode()[1:-1] if model is None else opening
            assert any(quoted in r for r in results), (name, [r[:300] for r in results])
