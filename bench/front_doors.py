"""Front doors: the added latency of /v1/messages and /v1/responses over /v1/chat/completions.

Writes bench/results/front_doors.json. One gateway in pass-through mode (no cache, router,
trim, edge or telemetry) before the fixed-answer upstream; the same question asked through the
three APIs, interleaved request by request in every round so drift on a noisy machine hits all
alike (whole rounds per API, alternated, showed differences of several ms at concurrency 16 that
vanished when the same requests were interleaved). `responses_stored` is
the Responses API with its default `store: true` (one SQLite write per request on the
gateway's worker thread); `responses` sends `store: false` and measures the translation alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import free_port, gateway_cmd, start, stop, summary_ms, write
from bench._verdicts import verdicts
from bench.proxy_overhead import pass_through_config

QUESTION = "What is six times seven?"
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions",
             {"model": "fast-model", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16}),
    "messages": ("/v1/messages",
                 {"model": "fast-model", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16}),
    "responses": ("/v1/responses", {"model": "fast-model", "input": QUESTION, "max_output_tokens": 16, "store": False}),
    "responses_stored": ("/v1/responses", {"model": "fast-model", "input": QUESTION, "max_output_tokens": 16}),
}
TARGET_ADDED_P50_MS = 0.3


async def mixed(base: str, concurrency: int, requests: int, lat: dict[str, list[float]],
                overheads: dict[str, list[float]], errors: dict[str, int], progress: Any = None) -> None:
    """`requests` per API with `concurrency` in flight, the APIs interleaved request by request: every
    API meets the same moment of the machine (a shared one drifts faster than rounds can follow)."""
    names = list(BODIES)
    payloads = {name: (base + path, json.dumps(body).encode()) for name, (path, body) in BODIES.items()}
    todo = iter(range(requests * len(names)))
    headers = {"Content-Type": "application/json"}

    async def worker(session: aiohttp.ClientSession, offset: int) -> None:
        for i in todo:
            name = names[(i + offset) % len(names)]
            url, data = payloads[name]
            t0 = time.perf_counter()
            async with session.post(url, data=data, headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    errors[name] += 1
                overheads[name].append(float(resp.headers.get("x-tierlane-overhead-ms", "nan")))
            lat[name].append(time.perf_counter() - t0)
            if progress is not None:
                progress.update(1)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(worker(session, w) for w in range(concurrency)))


async def measure(base: str, concurrency: int, requests: int, rounds: int) -> dict[str, Any]:
    lat: dict[str, list[float]] = {k: [] for k in BODIES}
    overheads: dict[str, list[float]] = {k: [] for k in BODIES}
    errors = dict.fromkeys(BODIES, 0)
    per_round = max(1, requests // rounds)
    await mixed(base, concurrency, min(200, per_round), {k: [] for k in BODIES}, {k: [] for k in BODIES},
                dict.fromkeys(BODIES, 0))  # warm-up: connections, imports, the store's first writes
    with tqdm(total=per_round * rounds * len(BODIES), desc=f"concurrency {concurrency}", unit="req") as bar:
        for _ in range(rounds):
            await mixed(base, concurrency, per_round, lat, overheads, errors, bar)
    out: dict[str, Any] = {}
    for name in BODIES:
        out[name] = {**summary_ms(lat[name]), "errors": errors[name],
                     # what the gateway measured of itself (x-tierlane-overhead-ms): no client or scheduler wait
                     "self_reported": summary_ms([x / 1000 for x in overheads[name]])}
    chat = out["chat"]
    for name in ("messages", "responses", "responses_stored"):
        mine = out[name]
        mine["added_p50_ms"] = round(mine["p50_ms"] - chat["p50_ms"], 3)
        mine["added_p99_ms"] = round(mine["p99_ms"] - chat["p99_ms"], 3)
        mine["added_self_p50_ms"] = round(mine["self_reported"]["p50_ms"] - chat["self_reported"]["p50_ms"], 3)
        mine["added_self_p99_ms"] = round(mine["self_reported"]["p99_ms"] - chat["self_reported"]["p99_ms"], 3)
    return out


EDGE_QUESTION = "Name three colours."
EDGE_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "edge", "messages": [{"role": "user", "content": EDGE_QUESTION}],
                                      "max_tokens": 8, "temperature": 0, "stream": True}),
    "messages": ("/v1/messages", {"model": "edge", "messages": [{"role": "user", "content": EDGE_QUESTION}],
                                  "max_tokens": 8, "temperature": 0, "stream": True}),
    "responses": ("/v1/responses", {"model": "edge", "input": EDGE_QUESTION, "max_output_tokens": 8, "temperature": 0,
                                    "stream": True, "store": False}),
}
TARGET_TTFB_RATIO = 1.05


async def edge_ttfb(base: str, requests: int) -> dict[str, Any]:
    """Time to the first byte of a streamed edge answer through each API, interleaved one by one."""
    ttfb: dict[str, list[float]] = {k: [] for k in EDGE_BODIES}
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        for i in range(requests * len(EDGE_BODIES) + len(EDGE_BODIES)):
            name = list(EDGE_BODIES)[i % len(EDGE_BODIES)]
            path, body = EDGE_BODIES[name]
            t0 = time.perf_counter()
            async with session.post(base + path, data=json.dumps(body).encode(), headers=headers) as resp:
                await resp.content.readany()
                first = time.perf_counter() - t0
                await resp.read()
            if i >= len(EDGE_BODIES):  # the first of each is a warm-up
                ttfb[name].append(first)
    out: dict[str, Any] = {name: summary_ms(values) for name, values in ttfb.items()}
    for name in ("messages", "responses"):
        out[name]["p50_ratio_to_chat"] = round(out[name]["p50_ms"] / out["chat"]["p50_ms"], 3)
    return out


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for level, r in results.items():
        if level == "edge_stream_ttfb":
            out[level] = {name: {"p50_ratio_to_chat": r[name]["p50_ratio_to_chat"],
                                 "met": r[name]["p50_ratio_to_chat"] <= TARGET_TTFB_RATIO} for name in ("messages", "responses")}
            continue
        out[level] = {name: {"added_p50_ms": r[name]["added_p50_ms"], "added_self_p50_ms": r[name]["added_self_p50_ms"],
                             "met": r[name]["added_p50_ms"] <= TARGET_ADDED_P50_MS,
                             "met_by_the_gateways_own_time": r[name]["added_self_p50_ms"] <= TARGET_ADDED_P50_MS}
                      for name in ("messages", "responses")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2400, help="requests per API and concurrency")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--edge-requests", type=int, default=40, help="streamed edge answers per API (0: skip)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tierlane-bench-"))
    up_port, gw_port = free_port(), free_port()
    upstream = start([sys.executable, str(Path(__file__).with_name("fast_upstream.py")), "--port", str(up_port)],
                     f"http://127.0.0.1:{up_port}/v1/models", tmp / "upstream.log")
    config = pass_through_config(f"http://127.0.0.1:{up_port}/v1", str(tmp / "state"))
    gateway = start(gateway_cmd(config, tmp / "gateway.yaml", gw_port), f"http://127.0.0.1:{gw_port}/healthz", tmp / "gateway.log")
    load_before = [round(x, 2) for x in os.getloadavg()]
    try:
        results: dict[str, Any] = {}
        for c in args.concurrency:
            r = asyncio.run(measure(f"http://127.0.0.1:{gw_port}", c, args.requests, args.rounds))
            results[f"concurrency_{c}"] = r
            for name in ("messages", "responses", "responses_stored"):
                m = r[name]
                print(f"concurrency {c} {name}: added p50 {m['added_p50_ms']} ms, p99 {m['added_p99_ms']} ms "
                      f"(chat p50 {r['chat']['p50_ms']} ms); gateway's own added p50 {m['added_self_p50_ms']} ms, "
                      f"p99 {m['added_self_p99_ms']} ms")
    finally:
        stop(gateway)
        stop(upstream)
    if args.edge_requests:
        edge_port = free_port()
        edge_config = {**config, "upstreams": [], "edge": {"enabled": True, "n_ctx": 1024, "slots": 2}}
        edge_gateway = start(gateway_cmd(edge_config, tmp / "edge.yaml", edge_port), f"http://127.0.0.1:{edge_port}/healthz",
                             tmp / "edge.log")
        try:
            r = asyncio.run(edge_ttfb(f"http://127.0.0.1:{edge_port}", args.edge_requests))
        finally:
            stop(edge_gateway)
        results["edge_stream_ttfb"] = r
        print(f"edge stream time to first byte p50: chat {r['chat']['p50_ms']} ms, messages {r['messages']['p50_ms']} ms "
              f"({r['messages']['p50_ratio_to_chat']}x), responses {r['responses']['p50_ms']} ms "
              f"({r['responses']['p50_ratio_to_chat']}x)")
    result = {
        "what": "added latency of /v1/messages and /v1/responses over /v1/chat/completions, same question, same "
                "fixed-answer upstream, one pass-through gateway",
        "targets": {"added_p50_ms": f"<= {TARGET_ADDED_P50_MS} (messages, responses; at every concurrency)",
                    "edge_stream_ttfb_p50_ratio_to_chat": f"<= {TARGET_TTFB_RATIO}"},
        "requests_per_api": args.requests,
        "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
        "note": "client-side percentiles on a shared 2-core machine carry the scheduler's noise of every process on "
                "it; self_reported (x-tierlane-overhead-ms) is the gateway's own time per request, lane excluded",
        "results": results,
        "verdict": verdict(results),
    }
    path = write("front_doors", {**result, "verdicts": verdicts("front_doors", result)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
