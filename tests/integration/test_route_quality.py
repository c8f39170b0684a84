"""The routing quality bound through a running gateway: a cost-tier answer judged wrong moves its
region to the strong tier, the dashboard shows it, and a restarted gateway keeps it.

The tiers are fixed-answer stubs (tests/support/faults.py) whose answers differ in their final
number, so the agreement judge says "disagree" whatever the embedder thinks of them; the router
and the embedder are the real ones. The router's own threshold is 1 (nothing is strong enough):
without the bound every request would go to the cost tier.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from gateway.auth import hash_key
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app

pytestmark = pytest.mark.slow  # the embedder loads a real model

ADMIN, USER = "tl-admin", "tl-user"
PRICES = {"small-8b": (0.1, 0.2), "big-70b": (1.0, 2.0)}
TIERS = {"cost": {"pool": "standard", "model": "small-8b"}, "strong": {"pool": "critical", "model": "big-70b"},
         "max_quality_loss": 0.05, "quality_sample_rate": 1.0}
POLICY = {
    **PASS_THROUGH["policy"],
    "router": {"enabled": True, "target": {"mode": "threshold", "value": 1.0}},
    "lanes": {"upstream": {"tiers": None},
              "overrides": [{"match": {"tenant": "acme"}, "set": {"upstream": {"tiers": TIERS}}}]},
    "shadow": {"seed": 7},
    "pricing": {"default_upstream_model": "small-8b",
                "models": {m: {"input_per_1k": i, "output_per_1k": o} for m, (i, o) in PRICES.items()}},
}
PROMPT = "A train leaves at 3 pm at 60 km/h; another at 4 pm at 80 km/h. When does the second catch up?"


def start(bg, make_gateway, *, strong_fails: bool = False) -> tuple[RunningApp, Recorder, Recorder]:
    cheap, strong = Recorder(), Recorder()
    cost_up = RunningApp(bg, fault_app("ok", cheap, text="The answer is 41."))
    strong_app = fault_app("status", strong, status=500) if strong_fails else fault_app("ok", strong, text="The answer is 42.")
    strong_up = RunningApp(bg, strong_app)
    keys = [{"sha256": hash_key(ADMIN), "tenant": "ops", "admin": True},
            {"sha256": hash_key(USER), "tenant": "acme", "app": "web"}]
    gateway = make_gateway(
        base={**PASS_THROUGH, "embedder": {"enabled": True}, "policy": POLICY,
              "telemetry": {"tracing": False, "metrics": True}},
        auth={"mode": "keys", "keys": keys},
        upstreams=[upstream_cfg("cheap", cost_up.url + "/v1", models=["small-8b"], pool="standard"),
                   upstream_cfg("strong", strong_up.url + "/v1", models=["big-70b"], pool="critical")],
    )
    return gateway, cheap, strong


def ask(gw: RunningApp) -> httpx.Response:
    body = {"model": "auto", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    reply = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {USER}"}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply


def tier(reply: httpx.Response) -> str:
    found = re.search(r"tier=(\w+)", reply.headers["x-tierlane-lane"])
    assert found, reply.headers["x-tierlane-lane"]
    return found.group(1)


def regions(gw: RunningApp) -> list[dict]:
    reply = httpx.get(gw.url + "/v1/dashboard", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["quality"].get("route_bound", [])


def judged(gw: RunningApp, n: int) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = regions(gw)
        if rows and rows[0]["judged"] >= n:
            return rows[0]
        time.sleep(0.05)
    raise AssertionError(f"no judgement reached the bound: {regions(gw)}")


def test_a_wrong_cost_answer_moves_its_region_to_the_strong_tier_and_a_restart_keeps_it(bg, make_gateway) -> None:
    gw, cheap, strong = start(bg, make_gateway)
    first = ask(gw)
    assert tier(first) == "cost" and first.json()["choices"][0]["message"]["content"] == "The answer is 41."
    row = judged(gw, 1)
    # the strong tier was asked the same request in the shadow: not streamed, output bounded
    (shadow_call,) = strong.bodies
    assert shadow_call["model"] == "big-70b" and not shadow_call.get("stream") and shadow_call["max_tokens"] == 8
    assert shadow_call["messages"] == [{"role": "user", "content": PROMPT}]
    assert row["tenant"] == "acme" and row["app"] == "web" and row["disagreed"] == 1
    assert row["router_threshold"] == 1.0 and row["threshold"] < 1.0
    assert row["judge_usd"] > 0 and row["label"]
    # the same prompt scores the same: its region now sends it to the strong tier
    second = ask(gw)
    assert tier(second) == "strong" and second.json()["choices"][0]["message"]["content"] == "The answer is 42."
    row = judged(gw, 2)  # the strong answer was judged against the cost tier's: at the threshold, not below it
    assert row["threshold"] < 1.0 and row["requests"] == 2 and row["strong_share"] == 0.5
    assert cheap.bodies[-1]["model"] == "small-8b" and len(cheap.bodies) == 2
    # the tenant is not billed for the judging: its usage is two requests
    usage = httpx.get(gw.url + "/v1/usage", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60).json()
    assert sum(r["requests"] for r in usage["data"]) == 2
    # the judging is billed to the operator's own line, as operation `judge`: shown, never a request
    by_tenant = httpx.get(gw.url + "/v1/usage", params={"group_by": "tenant"}, headers={"Authorization": f"Bearer {ADMIN}"},
                          timeout=60).json()["data"]  # fmt: skip
    lines = {r["tenant"]: r for r in by_tenant}
    assert lines["acme"]["requests"] == 2 and lines["acme"]["judge_requests"] == 0
    assert lines["_operator"]["requests"] == 0 and lines["_operator"]["judge_requests"] == 2
    assert lines["_operator"]["judge_cost_usd"] == pytest.approx(row["judge_usd"], rel=1e-6)
    metrics = httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60).text
    # tenant and app names are bounded on /metrics (unlisted ones are `other`); the region is a label of its own
    assert any(line.startswith("tierlane_route_region_threshold{") and f'region="{row["region"]}"' in line and float(line.rsplit(" ", 1)[1]) == pytest.approx(row["threshold"], abs=1e-4)
               for line in metrics.splitlines()), [x for x in metrics.splitlines() if "route" in x]
    threshold = row["threshold"]
    gw.stop()

    again, _, _ = start(bg, make_gateway)
    third = ask(again)
    assert tier(third) == "strong"
    (row,) = [r for r in regions(again) if r["judged"] >= 1] or [None]
    assert row is not None and row["threshold"] == threshold


def test_a_judgement_that_fails_is_counted_and_never_taken_for_agreement(bg, make_gateway) -> None:
    gw, cheap, strong = start(bg, make_gateway, strong_fails=True)
    assert tier(ask(gw)) == "cost"
    deadline = time.monotonic() + 30
    while not ((rows := regions(gw)) and rows[0]["judge_failed"] >= 1):
        assert time.monotonic() < deadline, regions(gw)
        time.sleep(0.05)
    (row,) = rows
    assert row["judged"] == 0 and row["threshold"] == row["router_threshold"] == 1.0
    assert strong.hits >= 1  # the strong tier was asked (and failed, retried by the pool)
    assert tier(ask(gw)) == "cost"  # no evidence either way: the router decides, as before
