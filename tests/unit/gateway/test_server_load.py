"""A member's own load, scraped from its Prometheus endpoint, in the balancer's choice; prompt_cache_key."""

from __future__ import annotations

import itertools
import time
from typing import Any

import httpx

from gateway.auth import hash_key
from gateway.upstream.server_load import ServerLoad, current, parse
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen"} 2.0
vllm:num_requests_waiting{engine="0",model_name="qwen"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.42
vllm:prompt_tokens_total{model_name="qwen"} 1.2e6
"""
LLAMA_CPP = """# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:prompt_tokens_total 43
llamacpp:requests_processing 2
llamacpp:requests_deferred 1
"""


HISTOGRAMS = "".join(f'vllm:e2e_request_latency_seconds_bucket{{le="{i}",model_name="qwen"}} {i * 7}\n' for i in range(6000))


def test_the_known_servers_expositions_are_read_and_anything_else_is_none():
    vllm = parse(VLLM, at=1.0)
    assert vllm == ServerLoad(running=5, waiting=4, kv_usage=0.42, at=1.0)  # summed over engines
    llama = parse(LLAMA_CPP, at=1.0)
    assert llama is not None and (llama.running, llama.waiting, llama.kv_usage) == (2, 1, None)
    sglang = parse("sglang:num_running_reqs{x=\"a b}\"} 7 1700000000\nsglang:num_queue_reqs 0\nsglang:token_usage 0.9\n", 1.0)
    assert sglang is not None and (sglang.requests, sglang.kv_usage) == (7, 0.9)
    for garbage in ("", "<html>nope</html>", "vllm:num_requests_running NaN\n", "vllm:num_requests_running -3\n",
                    "vllm:num_requests_running{model_name=\"q\"}\n", "process_cpu_seconds_total 4\n"):
        assert parse(garbage, 1.0) is None, garbage
    assert current(ServerLoad(1, 0, None, at=10.0), interval_s=1.0, now=12.9) is not None
    assert current(ServerLoad(1, 0, None, at=10.0), interval_s=1.0, now=13.1) is None  # stale: not used


def _short(i: int) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}


def test_a_member_whose_server_reports_a_queue_is_passed_over_and_failing_metrics_change_nothing(bg, make_gateway):
    recs = [Recorder(), Recorder()]
    # busy with other clients' work, its gauges after 400 KB of histograms (read whole, not its first chunk)
    recs[0].metrics = HISTOGRAMS + "vllm:num_requests_running 6\nvllm:num_requests_waiting 4\n"
    recs[1].metrics = None  # 404: the gateway's own counts alone
    apps = [RunningApp(bg, fault_app("ok", rec, text="ok")) for rec in recs]
    # NOTE: each scrape may take the interval (its timeout) and a reading lasts 3 intervals: 0.5 s
    # leaves a loaded machine room for both, where 0.05 s had a slow scrape leave gpu0 unread
    gw = make_gateway(upstreams=[upstream_cfg(f"gpu{i}", app.url + "/v1", models=["m"], metrics_url=app.url + "/metrics",
                                              metrics_interval_s=0.5) for i, app in enumerate(apps)])
    deadline = time.monotonic() + 60
    while min(rec.metrics_gets for rec in recs) < 2:  # the second scrape starts once the first is stored
        assert time.monotonic() < deadline, [rec.metrics_gets for rec in recs]
        time.sleep(0.05)
    for i in range(8):
        r = httpx.post(gw.url + "/v1/chat/completions", json=_short(i), timeout=30)
        assert r.status_code == 200
        assert r.headers["x-tierlane-upstream"] == "gpu1"  # ten requests queued there: never the first choice
    recs[0].metrics = "<html>a proxy's error page</html>"  # unreadable: its last reading goes stale, no error
    # Polled, not slept: once the last reading is stale gpu0 counts as idle again and is chosen
    # (half the time; never, were a stale reading kept).
    served: set[str] = set()
    deadline = time.monotonic() + 60
    for i in itertools.count():
        if served == {"gpu0", "gpu1"}:
            break
        assert time.monotonic() < deadline, served
        r = httpx.post(gw.url + "/v1/chat/completions", json=_short(i), timeout=30)
        assert r.status_code == 200, r.text
        served.add(r.headers["x-tierlane-upstream"])


def test_the_session_goes_as_prompt_cache_key_to_an_upstream_that_takes_one(bg, make_gateway):
    takes, plain = Recorder(), Recorder()
    apps = [RunningApp(bg, fault_app("ok", rec, text="ok")) for rec in (takes, plain)]
    gw = make_gateway(upstreams=[
        upstream_cfg("hosted", apps[0].url + "/v1", models=["hosted-m"], prompt_cache_key=True),
        upstream_cfg("self", apps[1].url + "/v1", models=["self-m"]),
    ])
    headers = {"x-tierlane-session": "agent-7"}
    for model in ("hosted-m", "self-m"):
        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                       headers=headers, timeout=30)
        assert r.status_code == 200, r.text
    assert takes.bodies[-1]["prompt_cache_key"] == "agent-7"
    assert "prompt_cache_key" not in plain.bodies[-1]
    # the client's own key is its session, and goes as sent
    body = {"model": "hosted-m", "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "mine"}
    assert httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30).status_code == 200
    assert takes.bodies[-1]["prompt_cache_key"] == "mine"


def test_a_tenant_salt_goes_as_cache_salt_to_an_upstream_that_keeps_prefixes_apart_by_it(bg, make_gateway):
    from gateway.upstream.adapt import tenant_salt

    salted, plain = Recorder(), Recorder()
    apps = [RunningApp(bg, fault_app("ok", rec, text="ok")) for rec in (salted, plain)]
    keys = [{"sha256": hash_key("key-a"), "tenant": "acme"}, {"sha256": hash_key("key-b"), "tenant": "globex"}]
    gw = make_gateway(auth={"mode": "keys", "keys": keys}, upstreams=[
        upstream_cfg("vllm", apps[0].url + "/v1", models=["vllm-m"], cache_salt=True),
        upstream_cfg("self", apps[1].url + "/v1", models=["self-m"]),
    ])

    def ask(key: str, model: str, **extra: Any) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text

    ask("key-a", "vllm-m")
    ask("key-b", "vllm-m")
    salts = [b["cache_salt"] for b in salted.bodies]
    assert salts == [tenant_salt("acme"), tenant_salt("globex")] and salts[0] != salts[1]
    assert "acme" not in salts[0]  # a digest: the tenant's name never leaves the gateway
    ask("key-a", "self-m")
    assert "cache_salt" not in plain.bodies[-1]
    ask("key-a", "vllm-m", cache_salt="mine")  # the client's own goes as sent
    assert salted.bodies[-1]["cache_salt"] == "mine"
