"""Priority classes and flow control through the real app, against a fault upstream held by a barrier."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from gateway.keys import SERVICES
from tests.conftest import GatewayFactory
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app

Barrier = dict[str, bool]


def held_upstream(bg: BackgroundLoop) -> tuple[RunningApp, Recorder, Barrier]:
    """An upstream that keeps every answer until the test sets barrier["open"]."""
    rec, barrier = Recorder(), {"open": False}
    return RunningApp(bg, fault_app("ok", rec, hold_until=lambda: barrier["open"])), rec, barrier


def chat(text: str) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}]}


def post(gw: RunningApp, text: str, priority: str | None = None) -> httpx.Response:
    headers = {"x-tierlane-priority": priority} if priority else {}
    return httpx.post(gw.url + "/v1/chat/completions", json=chat(text), headers=headers, timeout=90)


def asked(rec: Recorder) -> list[str]:
    return [body["messages"][0]["content"] for body in rec.bodies]


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def flow(bg: BackgroundLoop, gw: RunningApp) -> dict[str, Any]:
    """The pool's flow-control counts by class, read on the gateway's loop."""

    async def read() -> dict[str, Any]:
        classes, _ = gw.app[SERVICES].pool.flow_stats()
        return {c.priority: c for c in classes}

    return bg.call(read())


def queued(bg: BackgroundLoop, gw: RunningApp, priority: str) -> int:
    return int(flow(bg, gw)[priority].queued)


def budget_of_one(bg: BackgroundLoop, make_gateway: GatewayFactory, **settings: Any) -> tuple[RunningApp, Recorder, Barrier]:
    up, rec, barrier = held_upstream(bg)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", models=["fake-model"], max_concurrency=1)], **settings)
    return gw, rec, barrier


def test_a_freed_slot_goes_to_the_waiting_person_before_the_batch_line_that_came_first(bg: BackgroundLoop, make_gateway: GatewayFactory) -> None:
    gw, rec, barrier = budget_of_one(bg, make_gateway)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(post, gw, "first")
        until(lambda: rec.hits == 1, "the first request never reached the upstream")
        line = pool.submit(post, gw, "batch line", "batch")
        until(lambda: queued(bg, gw, "batch") == 1, "the batch request never waited")
        person = pool.submit(post, gw, "person", "interactive")
        until(lambda: queued(bg, gw, "interactive") == 1, "the interactive request never waited")
        assert asked(rec) == ["first"]
        barrier["open"] = True
        replies = [f.result() for f in (first, line, person)]
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    assert asked(rec) == ["first", "person", "batch line"]
    assert rec.max_inflight == 1
    stats = flow(bg, gw)
    assert stats["batch"].waited == 1 and stats["interactive"].waited == 1 and stats["batch"].queued == 0


def test_a_request_waiting_past_its_class_deadline_is_a_429_with_retry_after_in_each_api_shape(bg: BackgroundLoop, make_gateway: GatewayFactory) -> None:
    gw, rec, barrier = budget_of_one(bg, make_gateway, telemetry={"metrics": True},
                                     pools={"default": {"flow": {"interactive": {"max_wait_s": 0.2, "retry_after_s": 3}}}})
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, gw, "first")
        until(lambda: rec.hits == 1, "the first request never reached the upstream")
        late = post(gw, "late")
        messages = httpx.post(gw.url + "/v1/messages", timeout=90, json={
            "model": "fake-model", "max_tokens": 16, "messages": [{"role": "user", "content": "late too"}]})
        assert asked(rec) == ["first"]
        barrier["open"] = True
        assert first.result().status_code == 200
    assert late.status_code == 429 and late.headers["Retry-After"] == "3"
    error = late.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "upstream_busy" and "max_wait_s" in error["message"]
    assert messages.status_code == 429 and messages.headers["Retry-After"] == "3"
    assert messages.json()["type"] == "error" and messages.json()["error"]["type"] == "rate_limit_error"
    exposition = httpx.get(gw.url + "/metrics", timeout=30).text
    assert 'tierlane_flow_refused_total{pool="default",priority="interactive",reason="deadline"} 2.0' in exposition
    assert 'tierlane_flow_budget{member="a",pool="default"} 1.0' in exposition
    assert 'tierlane_flow_queued{pool="default",priority="batch"} 0.0' in exposition
    assert "tierlane_flow_wait_seconds_bucket" in exposition


def test_the_header_is_bounded_by_the_tenant_max_and_recorded_on_the_ledger(bg: BackgroundLoop, make_gateway: GatewayFactory) -> None:
    up, _, barrier = held_upstream(bg)
    barrier["open"] = True
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", models=["fake-model"])],
                      policy={"priority": {"max": "standard"}})
    assert post(gw, "asks for more", "interactive").status_code == 200
    assert post(gw, "default").status_code == 200
    assert post(gw, "asks for less", "batch").status_code == 200
    bad = post(gw, "asks for something else", "urgent")
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "x-tierlane-priority" and bad.json()["error"]["code"] == "invalid_priority"
    usage = httpx.get(gw.url + "/v1/usage", params={"group_by": "priority"}, timeout=30).json()
    assert {row["priority"]: row["requests"] for row in usage["data"]} == {"standard": 3, "batch": 1}
    only = httpx.get(gw.url + "/v1/usage", params={"priority": "batch"}, timeout=30).json()
    assert only["total"]["requests"] == 1
    dashboard = httpx.get(gw.url + "/v1/dashboard", timeout=30).json()
    classes = {row["priority"]: row for row in dashboard["quality"]["priorities"]}
    assert classes["standard"]["requests"] == 3 and classes["standard"]["errors"] == 1
    assert classes["batch"]["requests"] == 1 and classes["batch"]["mean_latency_ms"] is not None


def test_a_client_that_leaves_while_its_request_waits_gives_its_place_up(bg: BackgroundLoop, make_gateway: GatewayFactory) -> None:
    gw, rec, barrier = budget_of_one(bg, make_gateway)

    async def ask_then_leave() -> None:
        async with httpx.AsyncClient(timeout=90) as client:
            request = asyncio.ensure_future(client.post(gw.url + "/v1/chat/completions", json=chat("gone")))
            try:
                while queued(bg, gw, "interactive") == 0:
                    assert not request.done(), request.result()
                    await asyncio.sleep(0.01)
            finally:
                request.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await request

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, gw, "first")
        until(lambda: rec.hits == 1, "the first request never reached the upstream")
        asyncio.run(ask_then_leave())
        until(lambda: queued(bg, gw, "interactive") == 0, "the request of the client that left still waits")
        assert flow(bg, gw)["interactive"].left == 1
        barrier["open"] = True
        assert first.result().status_code == 200
    assert post(gw, "after").status_code == 200
    assert asked(rec) == ["first", "after"]


def test_without_a_budget_every_request_goes_at_once_as_before(bg: BackgroundLoop, make_gateway: GatewayFactory) -> None:
    up, rec, barrier = held_upstream(bg)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", models=["fake-model"])])
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post, gw, f"q{i}", "batch") for i in range(6)]
        until(lambda: rec.inflight == 6, "requests were held back without a budget")
        assert sum(s.queued for s in flow(bg, gw).values()) == 0
        barrier["open"] = True
        assert [f.result().status_code for f in futures] == [200] * 6


def test_batch_fills_a_member_nobody_uses_and_leaves_a_person_one_slot_while_someone_does(bg: BackgroundLoop, make_gateway: GatewayFactory) -> None:
    up, rec, barrier = held_upstream(bg)
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", models=["fake-model"], max_concurrency=2)],
                      pools={"default": {"flow": {"headroom_idle_s": 3600}}})
    with ThreadPoolExecutor(4) as pool:
        lines = [pool.submit(post, gw, f"line {i}", "batch") for i in range(2)]
        until(lambda: rec.inflight == 2, "batch lines were held back on a member no person uses")
        barrier["open"] = True
        assert [f.result().status_code for f in lines] == [200, 200]
        assert post(gw, "person").status_code == 200  # someone uses it now (headroom_idle_s: for the rest of the test)
        barrier["open"] = False
        lines = [pool.submit(post, gw, f"later {i}", "batch") for i in range(2)]
        until(lambda: queued(bg, gw, "batch") == 1, "the second batch line took the slot kept for people")
        assert rec.inflight == 1
        person = pool.submit(post, gw, "person again")
        until(lambda: rec.inflight == 2, "the person waited for a batch line")
        assert queued(bg, gw, "batch") == 1
        barrier["open"] = True
        assert person.result().status_code == 200 and [f.result().status_code for f in lines] == [200, 200]
