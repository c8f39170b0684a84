"""Prompt-cache reads and writes from a native Messages upstream: priced as themselves, reported everywhere."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from tests.support.anthropic_upstream import anthropic_app
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder

PRICE = {"input": 3.0, "output": 15.0, "cached_input": 0.3}  # writes default to 1.25x and 2x input
USAGE = {"input_tokens": 100, "output_tokens": 20, "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 500,
         "cache_creation": {"ephemeral_5m_input_tokens": 300, "ephemeral_1h_input_tokens": 200}}


@pytest.mark.parametrize("stream", [False, True])
def test_cache_reads_and_writes_are_billed_at_their_prices_and_reported(bg, make_gateway, tmp_path, stream):
    up = RunningApp(bg, anthropic_app(Recorder(), usage=USAGE))
    gw = make_gateway(upstreams=[upstream_cfg("claude", up.url + "/v1", models=["big-model"], apis=["chat", "messages"])],
                      policy={"pricing": {"models": {"big-model": PRICE}}}, telemetry={"metering": True})
    body = {"model": "big-model", "max_tokens": 16, "stream": stream, "metadata": {"user_id": "user_x_session_s-42"},
            "system": [{"type": "text", "text": "Long tools.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [{"role": "user", "content": "Capital of France?"}]}
    r = httpx.post(gw.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 200, r.text
    usage = httpx.get(gw.url + "/v1/usage", timeout=30).json()  # flushes the ledger too
    expected = (100 * 3.0 + 1000 * 0.3 + 300 * 3.0 * 1.25 + 200 * 3.0 * 2 + 20 * 15.0) / 1e6
    conn = sqlite3.connect(tmp_path / "state" / "ledger.sqlite3")
    try:
        row = conn.execute("SELECT input_tokens, cached_input_tokens, cache_write_tokens, cost FROM requests").fetchone()
    finally:
        conn.close()
    assert row[:3] == (1600, 1000, 500)
    assert row[3] == pytest.approx(expected, rel=1e-9)
    total = usage["data"][0] if "data" in usage else usage
    assert (total["cached_input_tokens"], total["cache_write_tokens"]) == (1000, 500)
    assert total["cost_usd"] == pytest.approx(expected, rel=1e-6)
    board = httpx.get(gw.url + "/v1/dashboard", timeout=30).json()
    assert board["headline"]["cache_write_tokens"] == 500
    (session,) = board["quality"]["sessions"]
    assert (session["cached_input_tokens"], session["cache_write_tokens"]) == (1000, 500)
