"""Every request that entered the pipeline writes exactly one ledger row and releases what it held:
streams that fail before their first chunk, clients that leave before the first byte, bugs."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.keys import PIPELINE, SERVICES
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, ask_then_leave, fault_app

MSG = [{"role": "user", "content": "What is the capital of France?"}]
METERED = {"policy": {"budgets": {"enabled": True, "tenant": {"daily_spend_usd": 100.0}}}}


def _rows(state: Path) -> list[sqlite3.Row]:
    conn = sqlite3.connect(state / "ledger.sqlite3")
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute("SELECT * FROM requests ORDER BY id").fetchall()
    finally:
        conn.close()


def _flush(bg: Any, gw: Any) -> None:
    async def flush() -> None:
        await gw.app[PIPELINE].drain()
        telemetry = gw.app[SERVICES].telemetry
        await telemetry.usage(telemetry.usage_query({}))  # commits what was appended

    bg.call(flush())


def _gateway(bg: Any, make_gateway: Any, mode: str, rec: Recorder | None = None, **opts: Any) -> Any:
    up = RunningApp(bg, fault_app(mode, rec or Recorder(), **opts))
    return make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", models=["fake-model"], retries=0)], **METERED)


def test_a_stream_that_fails_before_its_first_chunk_is_metered(bg, make_gateway, tmp_path):
    gw = _gateway(bg, make_gateway, "status", status=500)
    for _ in range(3):
        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake-model", "messages": MSG, "stream": True})
        assert r.status_code == 502
    _flush(bg, gw)
    rows = _rows(tmp_path / "state")
    assert [r["status"] for r in rows] == [502, 502, 502]
    assert gw.app[SERVICES].telemetry.budgets.in_flight() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_the_first_byte_is_metered_as_499(bg, make_gateway, tmp_path, stream):
    rec = Recorder()
    gw = _gateway(bg, make_gateway, "slow", rec, delay=600)
    for _ in range(5):  # each client leaves once the upstream has its request (a timeout may come before that)
        body = {"model": "fake-model", "messages": MSG, "stream": stream}
        ask_then_leave(bg, gw.url + "/v1/chat/completions", body, rec)
    deadline = time.monotonic() + 60
    while True:  # the gateway notices each disconnect on its own loop
        _flush(bg, gw)
        rows = _rows(tmp_path / "state")
        if len(rows) >= 5:
            break
        assert time.monotonic() < deadline, len(rows)
        time.sleep(0.02)
    assert len(rows) == 5
    assert {r["status"] for r in rows} == {499}
    assert all(r["error_code"] == "client_closed_request" for r in rows)
    # the upstream was asked: the prompt it read is billed, marked as an estimate
    assert all(r["input_tokens"] > 0 and r["estimated"] == 1 and r["cost"] > 0 for r in rows)
    assert gw.app[SERVICES].telemetry.budgets.in_flight() == 0


def test_an_unexpected_error_is_a_500_with_a_row(bg, make_gateway, tmp_path):
    gw = _gateway(bg, make_gateway, "ok")

    class Broken:
        name = "broken"
        operations = frozenset({"chat"})

        async def run(self, ctx: Any) -> None:
            raise KeyError("a bug in a stage")

    gw.app[PIPELINE].stages.append(Broken())
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake-model", "messages": MSG})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    _flush(bg, gw)
    rows = _rows(tmp_path / "state")
    assert [r["status"] for r in rows] == [500]
    assert gw.app[SERVICES].telemetry.budgets.in_flight() == 0


def test_embeddings_are_budgeted_and_metered(bg, make_gateway, tmp_path):
    up = RunningApp(bg, fault_app("ok", Recorder()))
    policy = {"budgets": {"enabled": True, "tenant": {"requests_per_minute": 2}}}
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", models=["embed-model"])], policy=policy)
    statuses = [
        httpx.post(gw.url + "/v1/embeddings", json={"model": "embed-model", "input": "hello"}).status_code for _ in range(3)
    ]
    assert statuses == [200, 200, 429]
    _flush(bg, gw)
    rows = _rows(tmp_path / "state")
    assert [r["operation"] for r in rows] == ["embeddings"] * 3
    assert rows[0]["input_tokens"] == 2 and rows[0]["status"] == 200
