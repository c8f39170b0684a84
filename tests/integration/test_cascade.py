"""The confidence cascade through a gateway: the calibrated edge decision, escalation with and
without streaming (hold-back), the lane header, metrics, ledger and cache admission.

The upstream is the real llama.cpp server; an answer's `model` says which lane produced it. The
shipped calibration of the bundled model decides; thresholds are pinned with `mode: threshold`
so each test forces the branch it checks (0.0: every answer passes, 1.0: none does).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from tests.support.config import PASS_THROUGH
from tests.support.llama_server import UPSTREAM_MODEL

pytestmark = pytest.mark.slow  # the edge engine or the embedder loads a real model

QUESTION = "What is 7 + 5?"
ALWAYS = {"mode": "threshold", "value": 0.0}
NEVER = {"mode": "threshold", "value": 1.0}


def gateway(make_gateway: Any, llama_upstream: Any, *, prior: dict[str, Any], target: dict[str, Any],
            cache: bool = False, hold_tokens: int = 4, **cascade: Any) -> Any:
    policy = {
        **PASS_THROUGH["policy"],
        "router": {"enabled": True},
        "cache": {"enabled": cache},
        "cascade": {"enabled": True, "prior": prior, "target": target, "hold_tokens": hold_tokens, **cascade},
    }
    base = {**PASS_THROUGH, "edge": {"enabled": True, "n_ctx": 1024, "slots": 4, "n_threads": 1},
            "embedder": {"enabled": True}, "telemetry": {"tracing": False, "metrics": True}}
    return make_gateway(
        base=base,
        upstreams=[{"name": "llama", "base_url": llama_upstream.base_url, "models": [UPSTREAM_MODEL], "read_timeout_s": 120}],
        policy=policy,
    )


def ask(gw: Any, content: str = QUESTION, *, stream: bool = False, headers: dict[str, str] | None = None,
        model: str = "auto", max_tokens: int = 16) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=180)


def sse_text(response: httpx.Response) -> tuple[str, set[str]]:
    text, models = [], set()
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            models.add(event.get("model"))
            for choice in event.get("choices") or ():
                text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text), models


def metric(gw: Any, name: str, **labels: str) -> float:
    body = httpx.get(gw.url + "/metrics", timeout=30).text
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def ledger(gw: Any) -> dict[str, Any]:
    r = httpx.get(gw.url + "/v1/usage", params={"group_by": "lane"}, timeout=30)
    assert r.status_code == 200, r.text
    return {row["lane"]: row for row in r.json()["data"]}


def test_an_attempt_past_its_deadline_is_escalated_without_waiting_for_its_check(make_gateway, llama_upstream):
    """The deadline is the engine's own measured cost of the attempt times a slack: at a slack of
    1e-9 (and no minimum) any attempt is past it once the engine has measured a lone decode step."""
    gw = gateway(make_gateway, llama_upstream, prior=ALWAYS, target=ALWAYS, deadline_slack=1e-9, deadline_min_s=0.0)
    first = ask(gw)  # no step cost measured yet: no deadline, the edge answers (and its decode steps are timed)
    assert first.status_code == 200 and first.headers["x-tierlane-lane"].startswith("edge"), first.headers
    second = ask(gw, "Name a colour of the sky.")
    assert second.status_code == 200, second.text
    assert second.json()["model"] == UPSTREAM_MODEL
    assert "escalated (deadline)" in second.headers["x-tierlane-lane"], second.headers["x-tierlane-lane"]
    assert metric(gw, "tierlane_edge_checks_total", result="escalated", reason="deadline") == 1
    # streams too: nothing was sent before the escalation, the client sees the upstream's answer alone
    streamed = ask(gw, "Name a fruit.", stream=True)
    _, models = sse_text(streamed)
    assert models == {UPSTREAM_MODEL} and "escalated (deadline)" in streamed.headers["x-tierlane-lane"]


def test_a_failed_check_escalates_and_the_client_sees_one_answer(make_gateway, llama_upstream):
    gw = gateway(make_gateway, llama_upstream, prior=ALWAYS, target=NEVER)
    r = ask(gw)
    assert r.status_code == 200, r.text
    lane = r.headers["x-tierlane-lane"]
    assert re.match(r"^upstream:\w+; escalated; confidence=[0-9.]+; score=[0-9.]+; reason=calibration_edge$", lane), lane
    assert r.json()["model"] == UPSTREAM_MODEL
    assert len(r.json()["choices"]) == 1
    assert metric(gw, "tierlane_edge_checks_total", result="escalated", reason="low_confidence") == 1
    assert metric(gw, "tierlane_edge_escalated_tokens_total") > 0
    # metered once, on the upstream lane, with the edge tokens as a cost of it
    rows = ledger(gw)
    assert set(rows) == {"upstream"} and rows["upstream"]["requests"] == 1


def test_a_stream_holds_back_and_escalates_before_the_first_byte(make_gateway, llama_upstream):
    gw = gateway(make_gateway, llama_upstream, prior=ALWAYS, target=NEVER)
    r = ask(gw, stream=True)
    assert r.status_code == 200
    assert "escalated" in r.headers["x-tierlane-lane"]
    text, models = sse_text(r)
    assert models == {UPSTREAM_MODEL}  # not one edge chunk reached the client
    assert text


def test_a_passed_check_is_served_from_the_edge_with_its_confidence(make_gateway, llama_upstream):
    gw = gateway(make_gateway, llama_upstream, prior=ALWAYS, target=ALWAYS)
    whole = ask(gw)
    assert whole.status_code == 200
    assert re.match(r"^edge; confidence=[0-9.]+; score=[0-9.]+; reason=calibration_edge$", whole.headers["x-tierlane-lane"])
    assert whole.json()["model"] != UPSTREAM_MODEL
    streamed = ask(gw, stream=True)
    text, models = sse_text(streamed)
    assert UPSTREAM_MODEL not in models
    assert text == whole.json()["choices"][0]["message"]["content"]  # held-back tokens are all sent
    assert metric(gw, "tierlane_edge_checks_total", result="served") == 2


def test_a_low_prior_goes_upstream_without_trying_the_edge(make_gateway, llama_upstream):
    gw = gateway(make_gateway, llama_upstream, prior=NEVER, target=ALWAYS)
    r = ask(gw)
    assert r.headers["x-tierlane-lane"].endswith("reason=calibration_upstream")
    assert "escalated" not in r.headers["x-tierlane-lane"]
    assert metric(gw, "tierlane_edge_checks_total") == 0


def test_pinned_requests_are_never_escalated_and_low_confidence_answers_are_not_cached(make_gateway, llama_upstream):
    gw = gateway(make_gateway, llama_upstream, prior=ALWAYS, target=NEVER, cache=True)
    for _ in range(2):
        r = ask(gw, headers={"x-tierlane-route": "edge"})
        assert r.status_code == 200
        assert r.headers["x-tierlane-lane"].startswith("edge; confidence=")
        assert r.headers.get("x-tierlane-cache") == "miss"  # the first answer was not admitted
    assert metric(gw, "tierlane_edge_checks_total", result="not_cacheable") == 2


def test_confident_edge_answers_are_cached(make_gateway, llama_upstream):
    gw = gateway(make_gateway, llama_upstream, prior=ALWAYS, target=ALWAYS, cache=True)
    first = ask(gw, max_tokens=128)  # only answers that end on their own ("stop") are cached
    assert first.headers["x-tierlane-lane"].startswith("edge")
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    for _ in range(20):  # admission runs after the answer, off the response path
        second = ask(gw, max_tokens=128)
        if second.headers.get("x-tierlane-cache") == "hit":
            break
    assert second.headers.get("x-tierlane-cache") == "hit"
    assert second.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_requests_the_calibration_keeps_are_answered_either_way(make_gateway, llama_upstream, stream):
    """The shipped defaults: whatever the decision, one well-formed answer and a consistent header."""
    gw = make_gateway(
        base={**PASS_THROUGH, "edge": {"enabled": True, "n_ctx": 1024, "slots": 4, "n_threads": 1},
              "embedder": {"enabled": True}},
        upstreams=[{"name": "llama", "base_url": llama_upstream.base_url, "models": [UPSTREAM_MODEL], "read_timeout_s": 120}],
        policy={**PASS_THROUGH["policy"], "router": {"enabled": True}, "cascade": {"enabled": True}},
    )
    for content in ("What is 2 + 3?", "Write a sonnet about the sea in the style of Keats."):
        r = ask(gw, content, stream=stream)
        assert r.status_code == 200, r.text
        lane = r.headers["x-tierlane-lane"]
        # the learnt gate is on by default: an escalated first answer may hold the second off the edge
        assert re.search(r"reason=calibration_(edge|upstream|net_saving|history)$", lane), lane
        model = sse_text(r)[1] if stream else {r.json()["model"]}
        assert (model == {UPSTREAM_MODEL}) == lane.startswith("upstream")


def test_a_long_whole_answer_is_checked_early_and_escalated_without_decoding_the_rest(make_gateway, llama_upstream):
    gw = gateway(make_gateway, llama_upstream, prior=ALWAYS, target=NEVER)
    r = ask(gw, "Tell a long story about a dragon and a knight.", max_tokens=400)
    assert r.status_code == 200 and "escalated" in r.headers["x-tierlane-lane"]
    # the prompt (a few dozen tokens) and the calibration's 48 tokens, not up to 400 generated ones
    assert metric(gw, "tierlane_edge_escalated_tokens_total") < 48 + 60
