"""The dashboard in a real headless browser (Debian's chromium driven by Playwright) against a real gateway.

The gateway's ledger holds five days of history (written before it starts) and then the traffic
it serves here over HTTP: answers of the real llama.cpp upstream (their tokens and cost as it
counted them), 429s from a rate limit, upstream errors (a stub that answers 500) carrying a
`traceparent`. Checked on the page itself: the headline equals GET /v1/usage over the same
range; in Asia/Kolkata (+05:30) the single days add up to the multi-day total; a non-admin key
gets 403; the page polls and shows new traffic; the CSV download; only the gateway is contacted.
A screenshot is saved as an artifact (pytest's tmp_path; also $TIERLANE_TEST_ARTIFACTS when set).
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest

from gateway.auth import hash_key
from gateway.keys import PIPELINE, SERVICES
from telemetry.ledger import FILENAME, Ledger, LedgerRow
from telemetry.usage import MEASURES
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app
from tests.support.llama_server import UPSTREAM_MODEL

CHROMIUM = os.environ.get("TIERLANE_CHROMIUM", "/usr/bin/chromium")
ADMIN, USER = "tl-dash-admin", "tl-dash-user"
TZ = "Asia/Kolkata"
MSG = [{"role": "user", "content": "What is the capital of France?"}]
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the `test` extra (make install)")


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: `make install` installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} is missing: `make install` installs Debian's chromium")
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def history(now: float) -> list[LedgerRow]:
    """Rows on each of the five days before today (Kolkata), some just before and after its midnight."""
    zone = ZoneInfo(TZ)
    today = dt.datetime.fromtimestamp(now, zone).date()
    rows = []
    for back in range(1, 6):
        midnight = dt.datetime.combine(today - dt.timedelta(days=back), dt.time(), zone).timestamp()
        for j, offset_h in enumerate((-0.25, 0.25, 3.0, 9.5, 17.0, 23.9)[: back + 1]):
            lane = ("upstream", "cache", "edge")[j % 3]
            rows.append(LedgerRow(
                request_id=f"hist-{back}-{j}", ts=midnight + offset_h * 3600, tenant="acme", app="web", lane=lane,
                model="fake-model", requested_model="fake-model", operation="chat", stream=False, input_tokens=50 + j,
                output_tokens=5 + back, cached_input_tokens=0, estimated=False, trimmed_tokens=j, cost=0.001 * (j + 1) if lane != "cache" else 0.0,
                saved_cache=0.002 if lane == "cache" else 0.0, saved_edge=0.0015 if lane == "edge" else 0.0, saved_trim=0.0001 * j,
                status=200, complete=True, error_code=None, latency_ms=20.0 + j, ttft_ms=None,
                cache_status="hit" if lane == "cache" else "miss", route_score=None, route_reason="router",
                confidence=0.8 if lane == "edge" else None, cache_similarity=0.95 if lane == "cache" else None,
            ))  # fmt: skip
    return rows


@pytest.fixture
def seeded() -> list[LedgerRow]:
    """The history the ledger is seeded with, made once: the test counts the very rows the gateway
    reads (made again later, a day that turned meanwhile would move every one of them)."""
    return history(time.time())


@pytest.fixture
def gateway(
    bg: BackgroundLoop, make_gateway: Any, tmp_path: Path, llama_upstream: Any, seeded: list[LedgerRow]
) -> RunningApp:
    ledger = Ledger(tmp_path / "state" / FILENAME)
    ledger.start()
    for row in seeded:
        ledger.append(row)
    ledger.close()
    bad = RunningApp(bg, fault_app("status", Recorder(), status=500))
    return make_gateway(
        upstreams=[
            upstream_cfg("a", llama_upstream.base_url, models=[UPSTREAM_MODEL]),
            upstream_cfg("b", bad.url + "/v1", models=["broken-model"], retries=0),
        ],
        auth={"mode": "keys", "keys": [
            {"sha256": hash_key(ADMIN), "tenant": "ops", "admin": True},
            {"sha256": hash_key(USER), "tenant": "acme", "app": "web"},
        ]},
        policy={"budgets": {"enabled": True, "tenant": {"requests_per_minute": 24}},
                "pricing": {"models": {UPSTREAM_MODEL: {"input": 2.0, "output": 8.0}}}},
    )  # fmt: skip


def serve_workload(bg: BackgroundLoop, gw: RunningApp) -> dict[str, int]:
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {USER}"}, timeout=30) as client:
        for i in range(28):
            model = "broken-model" if i % 7 == 3 else UPSTREAM_MODEL
            headers = {"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"} if model == "broken-model" else {}
            body = {"model": model, "messages": MSG, "max_tokens": 4, "temperature": 0}
            r = client.post("/v1/chat/completions", json=body, headers=headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    settle(bg, gw)
    return statuses


def settle(bg: BackgroundLoop, gw: RunningApp) -> None:
    async def flush() -> None:
        await gw.app[PIPELINE].drain()
        telemetry = gw.app[SERVICES].telemetry
        await telemetry.usage(telemetry.usage_query({}))  # commits what was appended

    bg.call(flush())


def headline(page: Any) -> dict[str, float]:
    values = page.eval_on_selector_all(
        "#headline [data-metric]", "els => Object.fromEntries(els.map(e => [e.dataset.metric, e.dataset.value]))"
    )
    return {k: float(v) for k, v in values.items() if v != ""}


COUNT_CHARTS = ("#chart-requests", "#chart-confidence", "#chart-similarity")


def count_ticks(page: Any, chart: str) -> list[float]:
    """A count axis's labels as drawn, bottom up, checked to be whole numbers in even steps (no label twice)."""
    labels = page.eval_on_selector_all(f"{chart} svg text[text-anchor=end]", "els => els.map(e => e.textContent)")
    values = [float(label.replace(",", "")) for label in labels]
    steps = {b - a for a, b in zip(values, values[1:], strict=False)}
    assert all(v.is_integer() for v in values) and len(steps) <= 1 and all(d > 0 for d in steps), (chart, labels)
    return values


def open_page(context: Any, base: str, **params: str) -> Any:
    page = context.new_page()
    query = "&".join(f"{k}={v}" for k, v in params.items())
    response = page.goto(f"{base}/dashboard?{query}")
    assert response is not None and response.status == 200
    page.wait_for_selector("body[data-state=ready]", timeout=30_000)
    return page


def test_dashboard_in_a_real_browser(
    bg: BackgroundLoop, gateway: RunningApp, chromium: Any, tmp_path: Path, seeded: list[LedgerRow]
) -> None:
    statuses = serve_workload(bg, gateway)
    assert statuses.get(429, 0) >= 1 and statuses.get(200, 0) >= 10 and sum(statuses.values()) == 28
    base = gateway.url
    today = dt.datetime.now(ZoneInfo(TZ)).date()
    first = today - dt.timedelta(days=5)
    admin = chromium.new_context(viewport={"width": 1400, "height": 1000}, extra_http_headers={"Authorization": f"Bearer {ADMIN}"},
                                 accept_downloads=True)  # fmt: skip
    contacted: list[str] = []
    admin.on("request", lambda request: contacted.append(request.url))
    try:
        page = open_page(admin, base, **{"from": first.isoformat(), "to": today.isoformat(), "tz": TZ, "refresh": "1"})
        assert page.inner_text("#tz-shown") == TZ

        # the headline equals GET /v1/usage over the same range
        body = httpx.get(f"{base}/v1/dashboard", params={"from": first.isoformat(), "to": today.isoformat(), "tz": TZ},
                         headers={"Authorization": f"Bearer {ADMIN}"}).json()  # fmt: skip
        usage = httpx.get(f"{base}/v1/usage", params={"from": body["from"], "to": body["to"]}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert usage.status_code == 200, usage.text
        total = usage.json()["total"]
        shown = headline(page)
        for name in MEASURES:
            assert shown[name] == pytest.approx(total[name], abs=1e-9), name
        assert page.inner_text("#headline [data-metric=requests] .v") == f"{total['requests']:,}"
        start = dt.datetime.combine(first, dt.time(), ZoneInfo(TZ)).timestamp()
        assert total["requests"] == sum(r.ts >= start for r in seeded) + 28
        assert total["errors"] == statuses.get(429, 0) + sum(n for s, n in statuses.items() if s >= 500)

        # single days add up to the multi-day total in a zone half an hour off UTC
        days = [open_page(admin, base, **{"from": d.isoformat(), "to": d.isoformat(), "tz": TZ})
                for d in (first + dt.timedelta(days=i) for i in range(6))]  # fmt: skip
        per_day = [headline(p) for p in days]
        # days with one request an hour, one edge answer, one cache hit: count axes step by whole numbers
        ticks = {chart: [count_ticks(p, chart) for p in days] for chart in COUNT_CHARTS}
        assert all(any(t and t[-1] <= 4 for t in ticks[chart]) for chart in COUNT_CHARTS), ticks
        for p in days:
            p.close()
        assert sum(h["requests"] for h in per_day) == shown["requests"]
        assert sum(h["cost_usd"] for h in per_day) == pytest.approx(shown["cost_usd"], abs=1e-9)
        assert sum(1 for h in per_day if h["requests"] > 0) == 6
        chart = page.get_attribute("#chart-requests", "data-total")
        assert chart is not None and float(chart) == shown["requests"]

        # recent errors carry request and trace ids
        errors = page.inner_text("#errors")
        assert TRACE in errors and "429" in errors

        # live refresh: new traffic shows without reloading
        generation = int(page.get_attribute("body", "data-generation") or 0)
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}) as client:
            body = {"model": UPSTREAM_MODEL, "messages": MSG, "max_tokens": 4, "temperature": 0}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        settle(bg, gateway)
        page.wait_for_function(  # a function, not a string: the page's CSP forbids eval
            "([generation, requests]) => Number(document.body.dataset.generation) > generation && "
            "Number(document.querySelector('#headline [data-metric=requests]').dataset.value) === requests",
            arg=[generation, int(shown["requests"]) + 1],
            timeout=15_000,
        )

        # CSV of what is shown
        with page.expect_download() as download:
            page.click("#csv")
        csv_path = tmp_path / "dashboard.csv"
        download.value.save_as(csv_path)
        lines = csv_path.read_text().splitlines()
        assert lines[0] == "section,group,metric,value" and f"headline,,requests,{int(shown['requests']) + 1}" in lines

        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        artifacts = os.environ.get("TIERLANE_TEST_ARTIFACTS")
        if artifacts:
            Path(artifacts).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(artifacts) / "dashboard.png")

        # offline: the page contacts nothing but the gateway
        assert contacted and all(url.startswith(base) or url.startswith(("blob:", "data:")) for url in contacted), contacted
    finally:
        admin.close()

    # a key that is not an admin key: 403, for the page and its data
    user = chromium.new_context(extra_http_headers={"Authorization": f"Bearer {USER}"})
    try:
        page = user.new_page()
        response = page.goto(f"{base}/dashboard")
        assert response is not None and response.status == 403
        assert "admin" in page.inner_text("body")
    finally:
        user.close()
    assert httpx.get(f"{base}/v1/dashboard", headers={"Authorization": f"Bearer {USER}"}).status_code == 403

    # a browser that sends no key gets the page, which asks for one and then shows the figures
    keyless = chromium.new_context()
    try:
        page = keyless.new_page()
        response = page.goto(f"{base}/dashboard")
        assert response is not None and response.status == 200
        page.wait_for_selector("#keyform:not([hidden])", timeout=30_000)
        page.fill("#f-key", ADMIN)
        page.press("#f-key", "Enter")
        page.wait_for_selector("body[data-state=ready]", timeout=30_000)
        assert headline(page)["requests"] > 0
    finally:
        keyless.close()
    assert httpx.get(f"{base}/v1/dashboard").status_code == 401
