"""/v1/usage for the whole fleet (`state.backend: redis`): two gateway replicas and a real Valkey.

Requests spread over both replicas; /v1/usage on either one reports the totals of both (the sum
of the two ledgers); a tenant admin sees only its tenant there too; with Valkey killed, /v1/usage
still answers, from the replica's own ledger, and says so; what was metered while it was down
reaches the totals when it is back.

The upstream is a fixed-answer stub (tests/support/faults.py, mode "ok"), not llama.cpp: the
figures checked are the gateway's own (each replica's ledger, summed across the fleet), compared
with what the replicas metered, not with an upstream's usage counts.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.auth import hash_key
from gateway.keys import SERVICES
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app
from tests.support.fleet import settle as _settle
from tests.support.valkey import ValkeyServer

MODEL = "fake-model"
PRICE = {"input": 2.0, "output": 8.0}
ACME, GLOBEX, ACME_ADMIN, OPS = "tl-acme-user", "tl-globex-user", "tl-acme-admin", "tl-ops-admin"
KEYS = [
    {"sha256": hash_key(ACME), "tenant": "acme", "app": "web"},
    {"sha256": hash_key(GLOBEX), "tenant": "globex", "app": "batch"},
    {"sha256": hash_key(ACME_ADMIN), "tenant": "acme", "admin": True, "admin_scope": "tenant"},
    {"sha256": hash_key(OPS), "tenant": "ops", "admin": True},
]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _replicas(bg: BackgroundLoop, make_gateway: Any, tmp_path: Path, valkey: ValkeyServer) -> list[RunningApp]:
    up = RunningApp(bg, fault_app("ok", Recorder(), text="one two three four five"))
    return [
        make_gateway(
            state_dir=str(tmp_path / f"replica{i}"),
            upstreams=[upstream_cfg("a", up.url + "/v1", models=[MODEL], retries=0)],
            auth={"mode": "keys", "keys": KEYS},
            telemetry={"tracing": False, "metrics": True},
            # budgets on, one tenant limited: usage is aggregated whether or not limits apply
            state={"backend": "redis", "url": valkey.url, "op_timeout_ms": 1000},
            policy={
                "budgets": {
                    "enabled": True,
                    "overrides": [{"match": {"tenant": "acme"}, "set": {"tenant": {"requests_per_minute": 1000}}}],
                },
                "pricing": {"models": {MODEL: PRICE}},
            },  # fmt: skip
        )
        for i in range(2)
    ]


def _ledger_totals(state_dir: Path) -> dict[str, float]:
    conn = sqlite3.connect(state_dir / "ledger.sqlite3")
    try:
        row = conn.execute("SELECT COUNT(*), SUM(input_tokens), SUM(output_tokens), SUM(cost) FROM requests").fetchone()
        return {"requests": row[0], "input_tokens": row[1] or 0, "output_tokens": row[2] or 0, "cost_usd": row[3] or 0.0}
    finally:
        conn.close()


def _usage(gw: RunningApp, key: str, **params: str) -> httpx.Response:
    return httpx.get(gw.url + "/v1/usage", params=params, headers=_bearer(key), timeout=30)


def test_usage_on_either_replica_reports_the_whole_fleet(bg, valkey, make_gateway, tmp_path):
    replicas = _replicas(bg, make_gateway, tmp_path, valkey)
    sent = {"acme": 0, "globex": 0}
    for i in range(10):
        key, tenant = (ACME, "acme") if i % 3 else (GLOBEX, "globex")
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {i}"}], "stream": i % 4 == 0}
        r = httpx.post(replicas[i % 2].url + "/v1/chat/completions", json=body, headers=_bearer(key), timeout=30)
        assert r.status_code == 200, r.text
        sent[tenant] += 1
    for gw in replicas:
        _settle(bg, gw)
    ledgers = [_ledger_totals(tmp_path / f"replica{i}") for i in range(2)]
    assert all(ledger["requests"] > 0 for ledger in ledgers)  # spread over both
    expected = {k: ledgers[0][k] + ledgers[1][k] for k in ledgers[0]}

    for gw in replicas:
        body = _usage(gw, OPS, group_by="tenant").json()
        assert body["source"] == "fleet" and "warning" not in body
        total = body["total"]
        assert total["requests"] == expected["requests"] == 10
        assert total["input_tokens"] == expected["input_tokens"]
        assert total["output_tokens"] == expected["output_tokens"]
        assert total["cost_usd"] == pytest.approx(expected["cost_usd"], rel=1e-9) and total["cost_usd"] > 0
        assert {row["tenant"]: row["requests"] for row in body["data"]} == sent
        # the same shape as the ledger's answer: group keys, filters, CSV
        by_app = _usage(gw, OPS, group_by="app,lane,model,day", app="batch").json()
        assert [(r["app"], r["lane"], r["model"], r["requests"]) for r in by_app["data"]] == [
            ("batch", "upstream", MODEL, sent["globex"])
        ]
        csv = httpx.get(gw.url + "/v1/usage?group_by=tenant", headers={**_bearer(OPS), "Accept": "text/csv"}, timeout=30)
        assert csv.headers["x-usage-source"] == "fleet"
        assert [line.split(",")[:2] for line in csv.text.splitlines()[1:]] == [["acme", str(sent["acme"])],
                                                                                 ["globex", str(sent["globex"])]]  # fmt: skip

    # a tenant admin sees its own tenant only, for the fleet too
    mine = _usage(replicas[1], ACME_ADMIN, group_by="tenant").json()
    assert mine["source"] == "fleet" and [r["tenant"] for r in mine["data"]] == ["acme"]
    assert mine["total"]["requests"] == sent["acme"]
    assert _usage(replicas[0], ACME_ADMIN, tenant="globex").status_code == 403

    # a range before anything was served is empty (hour granularity)
    assert _usage(replicas[0], OPS, **{"from": "2020-01-01", "to": "2020-01-02"}).json()["total"]["requests"] == 0

    valkey.kill()
    for i, gw in enumerate(replicas):
        r = _usage(gw, OPS, group_by="tenant")
        assert r.status_code == 200
        body = r.json()
        assert body["source"] == "local" and "warning" in body
        assert body["total"]["requests"] == ledgers[i]["requests"]
    # serving and metering go on without the store; the lost writes are counted
    assert httpx.post(replicas[0].url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                      headers=_bearer(GLOBEX), timeout=30).status_code == 200  # fmt: skip
    _settle(bg, replicas[0])
    fleet = replicas[0].app[SERVICES].telemetry.fleet
    assert fleet.errors >= 1 and fleet.dropped == 0
    # the store comes back (empty: no persistence): what was metered meanwhile arrives, once
    valkey.start()
    deadline = time.monotonic() + 60  # the writer retries at most 2 s apart: a bound only a lost batch reaches
    while (body := _usage(replicas[1], OPS).json())["source"] != "fleet" or body["total"]["requests"] != 1:
        assert time.monotonic() < deadline, body
        time.sleep(0.1)
    assert body["total"]["cost_usd"] == pytest.approx(_ledger_totals(tmp_path / "replica0")["cost_usd"] - ledgers[0]["cost_usd"])
