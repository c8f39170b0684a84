"""`auto` through two upstream tiers: the router's pick in the lane header, the ledger and the savings.

The two upstreams are fixed-answer stubs (tests/support/faults.py, mode "ok"): what is checked is
the gateway's own routing and metering, so each stub only has to say which tier answered. The
router and the embedder are the real ones; the tenants' targets (threshold 1: nothing is strong
enough; threshold 0: everything is) make the pick certain whatever the prompt scores.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import httpx
import pytest

from gateway.auth import hash_key
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app

pytestmark = pytest.mark.slow  # the embedder loads a real model

ADMIN, POOR, RICH = "tl-admin", "tl-poor", "tl-rich"
# USD per 1k tokens; the stubs report 7 prompt and 3 completion tokens per answer
PRICES = {"small-8b": (0.1, 0.2), "big-70b": (1.0, 2.0), "mid": (0.5, 1.0)}


def cost(model: str) -> float:
    inp, out = PRICES[model]
    return (7 * inp + 3 * out) / 1000


POLICY = {
    **PASS_THROUGH["policy"],
    "router": {"enabled": True, "target": {"mode": "threshold", "value": 1.0},
               "overrides": [{"match": {"tenant": "rich"}, "set": {"target": {"mode": "threshold", "value": 0.0}}}]},
    "lanes": {"upstream": {"tiers": {"cost": {"pool": "standard", "model": "small-8b"},
                                     "strong": {"pool": "critical", "model": "big-70b"}}}},
    "pricing": {"default_upstream_model": "mid",
                "models": {m: {"input_per_1k": i, "output_per_1k": o} for m, (i, o) in PRICES.items()}},
}


@pytest.fixture
def gw(bg, make_gateway):
    cheap, strong = Recorder(), Recorder()
    cost_up = RunningApp(bg, fault_app("ok", cheap, text="from cost"))
    strong_up = RunningApp(bg, fault_app("ok", strong, text="from strong"))
    keys = [{"sha256": hash_key(ADMIN), "tenant": "ops", "admin": True},
            {"sha256": hash_key(POOR), "tenant": "poor", "app": "web"},
            {"sha256": hash_key(RICH), "tenant": "rich", "app": "web"}]
    gateway = make_gateway(
        base={**PASS_THROUGH, "embedder": {"enabled": True}, "policy": POLICY,
              "telemetry": {"tracing": False, "metrics": True}},
        auth={"mode": "keys", "keys": keys},
        upstreams=[upstream_cfg("cheap", cost_up.url + "/v1", models=["small-8b"], pool="standard"),
                   upstream_cfg("strong", strong_up.url + "/v1", models=["big-70b"], pool="critical")],
    )
    gateway.recs = (cheap, strong)  # type: ignore[attr-defined]
    return gateway


def ask(gw, key: str, *, stream: bool = False) -> httpx.Response:
    body = {"model": "auto", "messages": [{"role": "user", "content": "What is the capital of Italy?"}],
            "max_tokens": 4, "stream": stream}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_the_router_picks_the_tier_and_the_bill_states_both_counterfactuals(gw, tmp_path: Path) -> None:
    cheap, strong = gw.recs
    poor, rich = ask(gw, POOR), ask(gw, RICH)
    assert poor.status_code == rich.status_code == 200, (poor.text, rich.text)
    assert re.fullmatch(r"upstream:standard; tier=cost; score=[0-9.]+; reason=router_cost", poor.headers["x-tierlane-lane"])
    assert re.fullmatch(r"upstream:critical; tier=strong; score=[0-9.]+; reason=router_strong", rich.headers["x-tierlane-lane"])
    assert poor.json()["choices"][0]["message"]["content"] == "from cost"
    assert rich.json()["choices"][0]["message"]["content"] == "from strong"
    assert [b["model"] for b in cheap.bodies] == ["small-8b"] and [b["model"] for b in strong.bodies] == ["big-70b"]
    streamed = ask(gw, POOR, stream=True)
    assert streamed.status_code == 200 and "tier=cost" in streamed.headers["x-tierlane-lane"]

    admin = {"Authorization": f"Bearer {ADMIN}"}
    usage = httpx.get(gw.url + "/v1/usage", params={"group_by": "tenant"}, headers=admin, timeout=30).json()  # flushes the ledger
    by_tenant = {row["tenant"]: row for row in usage["data"]}
    assert by_tenant["poor"]["cost_usd"] == pytest.approx(2 * cost("small-8b"))
    assert by_tenant["poor"]["saved_vs_strong_usd"] == pytest.approx(2 * (cost("big-70b") - cost("small-8b")))
    assert by_tenant["poor"]["saved_vs_named_usd"] == pytest.approx(2 * (cost("mid") - cost("small-8b")))
    assert by_tenant["rich"]["saved_vs_strong_usd"] == pytest.approx(0.0, abs=1e-9)
    assert by_tenant["rich"]["saved_vs_named_usd"] == pytest.approx(cost("mid") - cost("big-70b"))  # negative: strong costs more

    with sqlite3.connect(tmp_path / "state" / "ledger.sqlite3") as conn:
        rows = conn.execute("SELECT tenant, tier, model FROM requests ORDER BY id").fetchall()
    assert rows == [("poor", "cost", "small-8b"), ("rich", "strong", "big-70b"), ("poor", "cost", "small-8b")]

    dash = httpx.get(gw.url + "/v1/dashboard", headers=admin, timeout=30).json()
    tiers = {t["tier"]: t for t in dash["quality"]["tiers"]}
    assert (tiers["cost"]["requests"], tiers["strong"]["requests"]) == (2, 1)
    assert tiers["strong"]["cost_usd"] == pytest.approx(cost("big-70b"))
    assert dash["headline"]["saved_vs_strong_usd"] == pytest.approx(usage["total"]["saved_vs_strong_usd"])
    metrics = httpx.get(gw.url + "/metrics", headers=admin, timeout=30).text
    # tenants not named in telemetry settings are bounded to "other"; tiers are their own labels
    assert 'tierlane_tier_requests_total{app="other",tenant="other",tier="cost"} 2.0' in metrics
    assert 'tierlane_tier_requests_total{app="other",tenant="other",tier="strong"} 1.0' in metrics


def test_an_escalated_edge_answer_goes_to_the_routers_tier_and_its_cost_is_netted(bg, make_gateway, tmp_path: Path) -> None:
    """The real edge engine drafts; a confidence threshold of 1 fails every check, so each answer escalates."""
    cheap, strong = Recorder(), Recorder()
    cost_up = RunningApp(bg, fault_app("ok", cheap, text="from cost"))
    strong_up = RunningApp(bg, fault_app("ok", strong, text="from strong"))
    policy = {**POLICY, "router": {"enabled": True, "target": {"mode": "threshold", "value": 0.0}},
              "cascade": {"enabled": True, "prior": {"mode": "threshold", "value": 0.0},
                          "target": {"mode": "threshold", "value": 1.0}, "learn": {"enabled": False}}}
    gw = make_gateway(
        base={**PASS_THROUGH, "embedder": {"enabled": True}, "policy": policy,
              "edge": {"enabled": True, "n_ctx": 1024, "slots": 1, "n_threads": 1}},
        upstreams=[upstream_cfg("cheap", cost_up.url + "/v1", models=["small-8b"], pool="standard"),
                   upstream_cfg("strong", strong_up.url + "/v1", models=["big-70b"], pool="critical")],
    )
    body = {"model": "auto", "messages": [{"role": "user", "content": "What is the capital of Italy?"}], "max_tokens": 8}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"upstream:critical; tier=strong; escalated; confidence=[0-9.]+; score=[0-9.]+; reason=calibration_edge",
                        r.headers["x-tierlane-lane"])
    assert r.json()["choices"][0]["message"]["content"] == "from strong" and cheap.hits == 0
    usage = httpx.get(gw.url + "/v1/usage", timeout=30).json()["total"]  # flushes the ledger
    with sqlite3.connect(tmp_path / "state" / "ledger.sqlite3") as conn:
        tier, escalated, edge_tokens, saved_edge = conn.execute(
            "SELECT tier, escalated, edge_tokens, saved_edge FROM requests").fetchone()
    assert (tier, escalated) == ("strong", 1) and edge_tokens > 0 and saved_edge < 0
    # the strong tier served it: against all-strong it saved nothing, and lost the edge's attempt
    assert usage["saved_vs_strong_usd"] == pytest.approx(saved_edge, abs=1e-9)
    assert usage["cost_usd"] == pytest.approx(cost("big-70b") - saved_edge, abs=1e-9)


def test_a_named_tier_model_is_recorded_with_its_tier_allow_listed_and_optionally_routed(bg, make_gateway,
                                                                                         tmp_path: Path) -> None:
    cheap, strong = Recorder(), Recorder()
    cost_up = RunningApp(bg, fault_app("ok", cheap, text="from cost"))
    strong_up = RunningApp(bg, fault_app("ok", strong, text="from strong"))
    keys = [{"sha256": hash_key(POOR), "tenant": "poor", "app": "web"},
            {"sha256": hash_key(RICH), "tenant": "rich", "app": "web"}, {"sha256": hash_key(ADMIN), "tenant": "ops"},
            {"sha256": hash_key("tl-root"), "tenant": "root", "admin": True}]
    lanes = {**POLICY["lanes"], "overrides": [
        {"match": {"tenant": "poor"}, "set": {"tier_names": "auto"}},
        {"match": {"tenant": "ops"}, "set": {"models": ["small-*"]}}]}
    gw = make_gateway(
        base={**PASS_THROUGH, "embedder": {"enabled": True}, "policy": {**POLICY, "lanes": lanes}},
        auth={"mode": "keys", "keys": keys}, model_aliases={"gpt-big": "big-70b"},
        upstreams=[upstream_cfg("cheap", cost_up.url + "/v1", models=["small-8b"], pool="standard"),
                   upstream_cfg("strong", strong_up.url + "/v1", models=["big-70b"], pool="critical")],
    )

    def named(key: str, model: str) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of Italy?"}], "max_tokens": 4}
        return httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)

    rich = named(RICH, "gpt-big")  # an alias of the strong tier's model, served by it (tier_names: direct)
    assert rich.status_code == 200 and rich.json()["choices"][0]["message"]["content"] == "from strong"
    poor = named(POOR, "big-70b")  # tier_names: auto for this tenant: the router picks (threshold 1: cost)
    assert poor.status_code == 200 and poor.json()["choices"][0]["message"]["content"] == "from cost"
    assert "tier=cost" in poor.headers["x-tierlane-lane"]
    refused = named(ADMIN, "big-70b")  # lanes.models: small-* only
    assert refused.status_code == 403 and "lanes.models" in refused.json()["error"]["message"]
    assert named(ADMIN, "small-8b").status_code == 200
    flushed = httpx.get(gw.url + "/v1/usage", headers={"Authorization": "Bearer tl-root"}, timeout=30)  # flushes the ledger
    assert flushed.status_code == 200
    with sqlite3.connect(tmp_path / "state" / "ledger.sqlite3") as conn:
        rows = conn.execute("SELECT tenant, tier, model, status FROM requests ORDER BY id").fetchall()
    assert sorted(rows, key=str) == sorted([("rich", "strong", "big-70b", 200), ("poor", "cost", "small-8b", 200),
                                            ("ops", None, "big-70b", 403), ("ops", "cost", "small-8b", 200)], key=str)
