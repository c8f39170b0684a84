"""A learned template served through a real gateway, the upstream a real llama.cpp server with the same base model:
the adapter written while the gateway runs is taken without a restart, never answers before its shadow check
passes, then answers locally (re-asked upstream to hold the bound), and the template goes back upstream when the
bound breaks."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import pytest

from gateway.auth import hash_key
from gateway.keys import PIPELINE, SERVICES
from tests.support.background import BackgroundLoop
from tests.support.config import PASS_THROUGH, upstream_cfg

pytest.importorskip("gguf", reason="the learn extra writes adapters (make install installs it)")

from tests.support.learned import write_learned

pytestmark = pytest.mark.slow
KEY, ADMIN = "tl-learned-app", "tl-learned-admin"
ECHO = "Reply with the user's word in capital letters only."
WORDS = ["apple", "river", "garden", "window", "silver", "orange", "pencil", "mountain", "candle", "forest", "rocket",
         "violin", "tiger", "island", "basket"]  # fmt: skip


def ask(gw: Any, word: str) -> httpx.Response:
    body = {"model": "big-model", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "system", "content": ECHO}, {"role": "user", "content": word}]}  # fmt: skip
    answer = httpx.post(gw.url + "/v1/chat/completions", content=orjson.dumps(body),
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=120)  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer


def settle(bg: BackgroundLoop, gw: Any) -> None:
    """Wait for the completion hooks, the shadow answers and the upstream re-asks they started."""
    pipeline = gw.app[PIPELINE]
    bg.call(pipeline.drain())
    bg.call(gw.app[SERVICES].learn.serving.drain())
    for hook in pipeline.hooks:
        if hook.name == "shadow":
            bg.call(hook.drain())  # type: ignore[attr-defined]


def listed(gw: Any) -> dict[str, Any]:
    rows = httpx.get(gw.url + "/v1/edge/templates", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()["data"]
    return next(row for row in rows if row["template"] == "echo")


def test_a_learned_template_is_served_only_after_its_shadow_check_and_falls_back_when_the_bound_breaks(
    bg: BackgroundLoop, make_gateway: Any, llama_upstream: Any
) -> None:
    keys = [{"sha256": hash_key(KEY), "tenant": "acme", "app": "words"},
            {"sha256": hash_key(ADMIN), "tenant": "ops", "admin": True}]  # fmt: skip
    learn = {"min_observations": 3, "max_disagreement": 0.6, "recheck_rate": 1.0,
             "overrides": [{"match": {"tenant": "acme", "app": "words"}, "set": {"templates": {"echo": {"prefix": ECHO}}}}]}  # fmt: skip
    gw = make_gateway(
        base={**PASS_THROUGH, "edge": {"enabled": True, "n_ctx": 512, "slots": 1, "n_threads": 1}},
        upstreams=[upstream_cfg("llama", llama_upstream.base_url, models=["big-model"])],
        auth={"mode": "keys", "keys": keys}, policy={"learn": learn},
    )  # fmt: skip
    services = gw.app[SERVICES]
    serving = services.learn.serving
    assert serving is not None
    serving.rescan_s = 0.2  # the rescan loop reads it each round
    version = services.learn.policy.for_app("acme", "words").templates.by_name["echo"].version
    assert listed(gw)["state"] == "collecting"

    # The adapter arrives while the gateway runs: a zero adapter (the base model's own answers, which the upstream
    # gives too), every held-out answer confident enough.
    write_learned(services.settings.state_dir / "learn", tenant="acme", app="words", template="echo", version=version,
                  confidences=[(-50.0, True)])  # fmt: skip
    deadline = time.monotonic() + 60
    while listed(gw)["state"] != "shadow":
        assert time.monotonic() < deadline, "the new adapter was not taken"
        time.sleep(0.2)

    answered_by: list[str] = []
    for word in WORDS:
        response = ask(gw, word)
        answered_by.append("edge" if "x-tierlane-learned" in response.headers else "upstream")
        settle(bg, gw)
        if answered_by[-1] == "edge":
            assert response.json()["model"].startswith("learned:echo@")
        state = listed(gw)["state"]
        if answered_by.count("edge") >= 3:
            break
    row = listed(gw)
    figures = row["learned"]
    # never local before the gate opened: every answer before the first local one came from the upstream, and the
    # gate opened only after min_observations judged shadow answers
    first_local = answered_by.index("edge")
    assert first_local >= 3 and set(answered_by[:first_local]) == {"upstream"}
    opened = figures["transitions"][0]
    assert opened["state"] == "serving" and opened["after_judged"] >= 3  # min_observations
    assert first_local >= opened["after_judged"]  # each judged answer was a request the upstream answered first
    assert state == "serving" and figures["served"] >= 3
    assert figures["rechecked"] >= 1  # served answers re-asked upstream (recheck_rate 1) and judged the same
    board = httpx.get(gw.url + "/v1/dashboard", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
    shown = next(row for row in board["learned"] if row["template"] == "echo")
    assert shown["state"] == "serving" and shown["learned"]["served"] == figures["served"]

    # The traffic changes: judged answers disagree until the bound breaks, and the template goes back upstream.
    choice = serving.choice("acme", "words", "echo", version)
    assert choice is not None
    settle(bg, gw)  # the last served answers' re-asks are judged first
    while choice.gate.serves:
        serving.recheck(choice, "apple", "a different answer")
    for _ in range(20):  # and the new traffic keeps disagreeing
        serving.recheck(choice, "apple", "a different answer")
    assert listed(gw)["state"] == "suspended"
    assert "x-tierlane-learned" not in ask(gw, "apple").headers
