"""Two gateway replicas over one pool of servers that report their load (llama.cpp's /metrics): a
session's turns, sent through either replica in turn, meet on one member; a member over the load
bound for both moves its sessions to the same next member on both. Without a shared store
(`session_placement: rendezvous`) the sessions walk their hash ranking and go back when the member is
within the bound again; with the shared placement table (`state.backend: redis`, the default
`balanced`) the sessions are spread evenly and a move is kept by both replicas."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import httpx

from gateway.keys import SERVICES
from gateway.upstream.server_load import current
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app

SESSIONS = 9


def llama_metrics(processing: int, deferred: int) -> str:
    """What llama.cpp's server with --metrics answers on GET /metrics."""
    return ("# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
            "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 1234\n"
            "# HELP llamacpp:requests_processing Number of requests processing.\n"
            f"# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing {processing}\n"
            "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
            f"# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred {deferred}\n")


def turn(s: int, n: int) -> dict[str, object]:
    messages: list[dict[str, str]] = [{"role": "system", "content": f"You are agent {s}. " * 40}]
    for i in range(n):
        messages += [{"role": "user", "content": f"step {i} " * 30}, {"role": "assistant", "content": f"done {i} " * 30}]
    return {"model": "m", "messages": [*messages, {"role": "user", "content": "next"}]}


def wait_for_readings(replicas: list[RunningApp], requests: dict[str, int]) -> None:
    """Until every replica holds a current reading of each member's server saying `requests` of it."""

    def read(gw: RunningApp) -> dict[str, int | None]:
        pool = gw.app[SERVICES].pool
        loads = {}
        for upstream in pool._upstreams:
            reading = current(upstream.server_load, upstream.settings.metrics_interval_s)
            loads[upstream.name] = None if reading is None else reading.requests
        return loads

    deadline = time.monotonic() + 30
    while any(read(gw) != requests for gw in replicas):
        assert time.monotonic() < deadline, [read(gw) for gw in replicas]
        time.sleep(0.05)


def _fleet(bg, make_gateway, tmp_path, **settings: Any) -> tuple[list[Recorder], list[RunningApp]]:
    recs = [Recorder(metrics=llama_metrics(0, 0)) for _ in range(3)]
    apps = [RunningApp(bg, fault_app("ok", rec, text="ok")) for rec in recs]
    upstreams = [upstream_cfg(f"gpu{i}", app.url + "/v1", models=["m"], metrics_url=app.url + "/metrics",
                              metrics_interval_s=0.5) for i, app in enumerate(apps)]
    return recs, [make_gateway(upstreams=upstreams, state_dir=str(tmp_path / f"replica{r}"), **settings)
                  for r in range(2)]


def _ask(replicas: list[RunningApp], s: int, n: int) -> str:
    gw = replicas[(s + n) % 2]  # a session's turns alternate between the replicas
    r = httpx.post(gw.url + "/v1/chat/completions", json=turn(s, n), headers={"x-tierlane-session": f"agent-{s}"},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.headers["x-tierlane-upstream"]


def test_two_gateway_replicas_keep_each_session_on_one_member_of_one_pool(bg, make_gateway, tmp_path):
    recs, replicas = _fleet(bg, make_gateway, tmp_path, pools={"default": {"session_placement": "rendezvous"}})
    idle = {f"gpu{i}": 0 for i in range(3)}
    wait_for_readings(replicas, idle)

    def ask(s: int, n: int) -> str:
        return _ask(replicas, s, n)

    homes: dict[int, str] = {}
    for n in range(1, 5):
        for s in range(SESSIONS):
            where = ask(s, n)
            assert homes.setdefault(s, where) == where, (s, n, where, homes[s])
    assert len(set(homes.values())) >= 2  # the ranking spreads the sessions
    busy = homes[0]
    recs[int(busy[-1])].metrics = llama_metrics(6, 4)  # over the bound, as every replica reads it
    wait_for_readings(replicas, {**idle, busy: 10})
    moved: dict[int, str] = {}
    for n in range(5, 8):
        for s in range(SESSIONS):
            where = ask(s, n)
            if homes[s] == busy:
                assert where != busy and moved.setdefault(s, where) == where, (s, n, where)
            else:
                assert where == homes[s], (s, n, where)
    recs[int(busy[-1])].metrics = llama_metrics(0, 0)  # within the bound again
    wait_for_readings(replicas, idle)
    for n in range(8, 10):
        for s in range(SESSIONS):
            assert ask(s, n) == homes[s], (s, n)


def test_two_replicas_sharing_the_placement_table_spread_sessions_evenly_and_keep_a_move(bg, make_gateway, tmp_path,
                                                                                         valkey):
    recs, replicas = _fleet(bg, make_gateway, tmp_path, state={"backend": "redis", "url": valkey.url,
                                                                "op_timeout_ms": 1000})
    idle = {f"gpu{i}": 0 for i in range(3)}
    wait_for_readings(replicas, idle)
    homes: dict[int, str] = {}
    for n in range(1, 4):
        for s in range(SESSIONS):
            where = _ask(replicas, s, n)
            assert homes.setdefault(s, where) == where, (s, n, where, homes[s])
    assert sorted(Counter(homes.values()).values()) == [3, 3, 3]  # the fewest sessions first: even
    busy = homes[0]
    recs[int(busy[-1])].metrics = llama_metrics(6, 4)  # over the bound, as every replica reads it
    wait_for_readings(replicas, {**idle, busy: 10})
    moved: dict[int, str] = {}
    for n in range(4, 6):
        for s in range(SESSIONS):
            where = _ask(replicas, s, n)
            if homes[s] == busy:
                assert where != busy and moved.setdefault(s, where) == where, (s, n, where)
            else:
                assert where == homes[s], (s, n, where)
    assert len(moved) == 3
    recs[int(busy[-1])].metrics = llama_metrics(0, 0)  # within the bound again: the moves are kept, on both
    wait_for_readings(replicas, idle)
    for n in range(6, 8):
        for s in range(SESSIONS):
            assert _ask(replicas, s, n) == moved.get(s, homes[s]), (s, n)
