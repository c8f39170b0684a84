"""The newest user message reaches the upstream byte for byte through every front door, with the
shipped trim on: whatever whitespace it carries (an upstream that matches prompts exactly, a replay
or a provider's cache keyed on the last turn, must still recognise the question)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app

EXAMPLES = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# prose with the whitespace a person types or pastes: doubled spaces after a full stop, tabs,
# trailing blanks, runs of blank lines, CRLF
_PIECES = st.sampled_from(["I need it", "by Friday.", "parents?", "the  list", "ok", "\t", "  ", "\n\n\n", "\r\n",
                           " ", ".  ", "Hello", "   trailing   "])
texts = st.lists(_PIECES, min_size=2, max_size=14).map("".join).filter(lambda t: t.strip() != "")


@pytest.fixture
def gw(bg, make_gateway):
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text="fine"))
    base = {**PASS_THROUGH, "policy": {**PASS_THROUGH["policy"], "trim": {"enabled": True}}}
    gateway = make_gateway(base=base, upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"])])
    gateway.rec = rec  # type: ignore[attr-defined]
    return gateway


def _newest_user_text(body: dict[str, Any]) -> str:
    last = [m for m in body["messages"] if m["role"] == "user"][-1]
    content = last["content"]
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def _send(gw: Any, door: str, earlier: str, newest: str) -> None:
    if door == "chat":
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": [
            {"role": "system", "content": "Be  brief.  "}, {"role": "user", "content": earlier},
            {"role": "assistant", "content": "Sure.  Go on."}, {"role": "user", "content": newest}]}
    elif door == "messages":
        path = "/v1/messages"
        body = {"model": "m", "max_tokens": 8, "system": "Be  brief.  ", "messages": [
            {"role": "user", "content": earlier}, {"role": "assistant", "content": "Sure.  Go on."},
            {"role": "user", "content": [{"type": "text", "text": newest}]}]}
    else:
        path = "/v1/responses"
        body = {"model": "m", "max_output_tokens": 8, "instructions": "Be  brief.  ", "input": [
            {"role": "user", "content": earlier}, {"role": "assistant", "content": "Sure.  Go on."},
            {"role": "user", "content": [{"type": "input_text", "text": newest}]}]}
    got = httpx.post(gw.url + path, json=body, timeout=30)
    assert got.status_code == 200, got.text


@EXAMPLES
@given(earlier=texts, newest=texts)
def test_the_newest_user_message_reaches_the_upstream_byte_for_byte(gw, earlier: str, newest: str) -> None:
    for door in ("chat", "messages", "responses"):
        before = len(gw.rec.bodies)
        _send(gw, door, earlier, newest)
        sent = gw.rec.bodies[before:]
        assert len(sent) == 1, door
        assert _newest_user_text(sent[0]) == newest, door
        # and the earlier user message too: it was the newest a turn ago, so the prompt stays a prefix
        assert [m for m in sent[0]["messages"] if m["role"] == "user"][0]["content"] == earlier, door


def test_the_trim_still_rewrites_what_is_not_the_users_own_words(gw) -> None:
    _send(gw, "chat", "hi", "there")
    system = gw.rec.bodies[-1]["messages"][0]
    assert system == {"role": "system", "content": "Be brief."}
