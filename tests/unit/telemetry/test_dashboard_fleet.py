"""With `state.backend: redis` the dashboard's usage totals are the fleet's, as on GET /v1/usage (two replicas, a real Valkey)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from telemetry.dashboard import merge_fleet
from telemetry.usage import MEASURES
from tests.integration.test_fleet_usage import ACME, GLOBEX, MODEL, OPS, _bearer, _replicas, _settle


def test_headline_and_breakdown_are_the_fleets(bg: Any, make_gateway: Any, tmp_path: Path, valkey: Any) -> None:
    replicas = _replicas(bg, make_gateway, tmp_path, valkey)
    for i in range(8):
        key = ACME if i % 3 else GLOBEX
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {i}"}]}
        assert httpx.post(replicas[i % 2].url + "/v1/chat/completions", json=body, headers=_bearer(key), timeout=30).status_code == 200
    for gw in replicas:
        _settle(bg, gw)
    for gw in replicas:
        dash = httpx.get(gw.url + "/v1/dashboard", headers=_bearer(OPS), timeout=30).json()
        usage = httpx.get(gw.url + "/v1/usage", params={"from": dash["from"], "to": dash["to"]}, headers=_bearer(OPS), timeout=30).json()
        assert dash["source"] == usage["source"] == "fleet"
        for name in MEASURES:
            assert dash["headline"][name] == pytest.approx(usage["total"][name], abs=1e-9), name
        assert dash["headline"]["requests"] == 8  # both replicas' requests, though each ledger has only some
        assert sum(r["requests"] for r in dash["breakdown"]) == 8
    valkey.kill()
    body = httpx.get(replicas[0].url + "/v1/dashboard", headers=_bearer(OPS), timeout=30).json()
    assert body["source"] == "local" and "warning" in body and body["headline"]["requests"] < 8


def test_merge_fleet_replaces_the_usage_totals() -> None:
    body: dict[str, Any] = {
        "headline": {"requests": 1, "cost_usd": 0.1, "saved_usd": 0.0, "errors": 0, "rejected": 0},
        "breakdown": [{"tenant": "a", "app": "w", "model": "m", "requests": 1, "rejected": 2}],
    }
    zero = dict.fromkeys(MEASURES, 0)
    rows = [{**zero, "tenant": "a", "app": "w", "model": "m", "requests": 3, "cost_usd": 0.3, "saved_usd": 0.1},
            {**zero, "tenant": "b", "app": "w", "model": "m", "requests": 2, "cost_usd": 0.5, "errors": 1}]  # fmt: skip
    merge_fleet(body, rows, "fleet", None)
    assert body["source"] == "fleet"
    assert body["headline"]["requests"] == 5 and body["headline"]["cost_usd"] == pytest.approx(0.8)
    assert body["headline"]["error_rate"] == pytest.approx(0.2) and body["headline"]["saved_share"] == pytest.approx(0.1 / 0.9, abs=1e-6)
    assert [(r["tenant"], r["requests"], r["rejected"]) for r in body["breakdown"]] == [("b", 2, 0), ("a", 3, 2)]
