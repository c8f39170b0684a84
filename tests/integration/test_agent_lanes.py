"""lanes.agents through a gateway: background calls on the cost tier, one tier per agent session.

Two fixed-answer upstreams play the tiers (tests/support/faults.py, mode "ok"); the router and the
embedder are the real ones. Tenant `poor`'s target (threshold 1) makes the router pick cost for
everything, `rich`'s (threshold 0) strong: so what moves a request off the router's pick is
lanes.agents. The agent speaks the Messages API, as Claude Code does (an is_error tool result
reaches the model as "Error: ...").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.auth import hash_key
from tests.integration.test_agents import ledger_rows
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app

pytestmark = pytest.mark.slow  # the embedder loads a real model

ADMIN, POOR, RICH = "tl-admin", "tl-poor", "tl-rich"
TITLE = "Summarize this coding conversation in under 50 characters.\nCapture the main task and current status."
TOOLS = [{"name": "Read", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]
AGENTS = {"background": {"enabled": True}, "session_tiers": {"enabled": True}}


@pytest.fixture
def gw(bg, make_gateway):
    cheap, strong = Recorder(), Recorder()
    cost_up = RunningApp(bg, fault_app("ok", cheap, text="from cost"))
    strong_up = RunningApp(bg, fault_app("ok", strong, text="from strong"))
    policy = {
        **PASS_THROUGH["policy"],
        "router": {"enabled": True, "target": {"mode": "threshold", "value": 1.0},
                   "overrides": [{"match": {"tenant": "rich"}, "set": {"target": {"mode": "threshold", "value": 0.0}}}]},
        "lanes": {"upstream": {"tiers": {"cost": {"pool": "standard", "model": "small-8b"},
                                         "strong": {"pool": "critical", "model": "big-70b"}}},
                  "agents": AGENTS},
    }
    keys = [{"sha256": hash_key(ADMIN), "tenant": "ops", "admin": True},
            {"sha256": hash_key(POOR), "tenant": "poor", "app": "cli"},
            {"sha256": hash_key(RICH), "tenant": "rich", "app": "cli"}]
    gateway = make_gateway(
        base={**PASS_THROUGH, "embedder": {"enabled": True}, "policy": policy},
        auth={"mode": "keys", "keys": keys},
        model_aliases={"claude-*": "auto"},
        upstreams=[upstream_cfg("cheap", cost_up.url + "/v1", models=["small-8b"], pool="standard"),
                   upstream_cfg("strong", strong_up.url + "/v1", models=["big-70b"], pool="critical")],
    )
    yield gateway
    cost_up.stop()
    strong_up.stop()


def post(gw: RunningApp, key: str, body: dict[str, Any]) -> httpx.Response:
    response = httpx.post(gw.url + "/v1/messages", json=body, timeout=120,
                          headers={"x-api-key": key, "anthropic-version": "2023-06-01"})
    assert response.status_code == 200, response.text
    return response


def rows(gw: RunningApp, state: Path) -> list[dict[str, Any]]:
    columns = ("tenant", "session", "tier", "model", "route_reason")
    return [{k: row[k] for k in columns} for row in ledger_rows(gw, state, ADMIN)]


def metadata(session: str) -> dict[str, str]:
    return {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": session})}


class Session:
    """A Claude Code-like main loop: Read calls whose results the test marks as errors or not."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": "Read notes.txt and tell me what it says."}]
        self.n = 0

    def body(self, model: str = "claude-sonnet-4-5") -> dict[str, Any]:
        return {"model": model, "max_tokens": 32000, "system": "You are a coding agent.", "tools": TOOLS,
                "messages": self.messages, "metadata": metadata(self.session)}

    def tool_turn(self, *, error: bool) -> None:
        self.n += 1
        call = f"toolu_{self.n}"
        self.messages = [*self.messages,
                         {"role": "assistant", "content": [{"type": "tool_use", "id": call, "name": "Read",
                                                            "input": {"file_path": f"notes{self.n}.txt"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call, "is_error": error,
                                                       "content": "File does not exist." if error else "pelican"}]}]


def test_a_background_call_goes_to_the_cost_tier(gw, tmp_path: Path) -> None:
    # rich: the router sends everything to strong; Claude Code's title call on its small model goes to cost
    title = {"model": "claude-haiku-4-5", "max_tokens": 512, "system": TITLE, "metadata": metadata("s-bg"),
             "messages": [{"role": "user", "content": "Please fix the flaky test in tests/test_io.py"}]}
    answer = post(gw, RICH, title)
    assert answer.json()["content"][0]["text"] == "from cost"
    main = post(gw, RICH, Session("s-bg").body())  # its main loop: the session's tier (strong, for rich)
    assert main.json()["content"][0]["text"] == "from strong"
    plain = post(gw, RICH, {"model": "claude-sonnet-4-5", "max_tokens": 8000,
                            "messages": [{"role": "user", "content": "Explain monads."}]})
    assert plain.json()["content"][0]["text"] == "from strong"  # neither background nor a session turn
    assert rows(gw, tmp_path / "state") == [
        {"tenant": "rich", "session": "s-bg", "tier": "cost", "model": "small-8b", "route_reason": "background"},
        {"tenant": "rich", "session": "s-bg", "tier": "strong", "model": "big-70b", "route_reason": "session_strong"},
        {"tenant": "rich", "session": None, "tier": "strong", "model": "big-70b", "route_reason": "router_strong"},
    ]


def test_a_session_keeps_its_tier_and_moves_up_for_good_after_three_tool_errors(gw, tmp_path: Path) -> None:
    loop = Session("s-loop")
    errors = [False, True, True, True, False, False]
    answers = [post(gw, POOR, loop.body()).json()["content"][0]["text"]]
    for error in errors:
        loop.tool_turn(error=error)
        answers.append(post(gw, POOR, loop.body()).json()["content"][0]["text"])
    # a background call of the session between turns leaves its tier alone
    post(gw, POOR, {"model": "claude-haiku-4-5", "max_tokens": 512, "system": TITLE, "metadata": metadata("s-loop"),
                    "messages": [{"role": "user", "content": "Read notes.txt and tell me what it says."}]})
    loop.tool_turn(error=False)
    answers.append(post(gw, POOR, loop.body()).json()["content"][0]["text"])
    assert answers == ["from cost"] * 4 + ["from strong"] * 4
    got = [(r["tier"], r["route_reason"]) for r in rows(gw, tmp_path / "state")]
    up = ("strong", "session_escalated:error_streak")
    assert got == [("cost", "session_cost")] * 4 + [up] * 3 + [("cost", "background"), up]
