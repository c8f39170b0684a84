"""Proxy overhead: direct to a fast upstream vs through tierlane in pass-through mode, side by side.

Writes bench/results/proxy_overhead.json. Three processes on loopback: the fixed-answer
upstream, the gateway (no cache, no router, no trim, no edge, no telemetry) and this load
generator. Runs alternate direct/gateway rounds so drift on a noisy machine hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import free_port, gateway_cmd, load, start, stop, summary_ms, write
from bench._verdicts import verdicts

BODY = {"model": "fast-model", "messages": [{"role": "user", "content": "What is six times seven?"}], "max_tokens": 16}

PASS_THROUGH: dict[str, Any] = {
    "edge": {"enabled": False},
    "embedder": {"enabled": False},
    "telemetry": {"tracing": False, "metrics": False, "metering": False},
    "policy": {k: {"enabled": False} for k in ("cache", "router", "trim", "budgets")},
}


def pass_through_config(upstream_url: str, state_dir: str) -> dict[str, Any]:
    return {
        **PASS_THROUGH,
        "state_dir": state_dir,
        "upstreams": [{"name": "fast", "base_url": upstream_url, "models": ["fast-model"], "max_connections": 256}],
    }


async def measure(targets: dict[str, str], concurrency: int, requests: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    lat: dict[str, list[float]] = {k: [] for k in targets}
    self_reported: list[float] = []
    walls: dict[str, float] = {k: 0.0 for k in targets}
    errors: dict[str, int] = {k: 0 for k in targets}
    per_round = max(1, requests // rounds)
    with tqdm(total=per_round * rounds * len(targets), desc=f"concurrency {concurrency}", unit="req") as bar:
        for url in targets.values():  # warm-up: connections, caches
            await load(url, BODY, concurrency=concurrency, requests=min(200, per_round))
        for _ in range(rounds):
            for name, url in targets.items():
                got, wall, err = await load(
                    url, BODY, concurrency=concurrency, requests=per_round, progress=bar,
                    overheads=self_reported if name == "tierlane" else None,
                )
                lat[name] += got
                walls[name] += wall
                errors[name] += err
    for name in targets:
        out[name] = {**summary_ms(lat[name]), "rps": round(len(lat[name]) / walls[name], 1), "errors": errors[name]}
    # What the gateway measured of itself (x-tierlane-overhead-ms): excludes the extra process
    # hop, which on a loaded 2-core machine is mostly scheduler wait.
    out["gateway_self_reported"] = summary_ms([x / 1000 for x in self_reported])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000, help="requests per target and concurrency")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tierlane-bench-"))
    up_port, gw_port = free_port(), free_port()
    upstream = start([sys.executable, str(Path(__file__).with_name("fast_upstream.py")), "--port", str(up_port)],
                     f"http://127.0.0.1:{up_port}/v1/models", tmp / "upstream.log")
    config = pass_through_config(f"http://127.0.0.1:{up_port}/v1", str(tmp / "state"))
    gateway = start(gateway_cmd(config, tmp / "gateway.yaml", gw_port), f"http://127.0.0.1:{gw_port}/healthz", tmp / "gateway.log")
    try:
        targets = {
            "direct": f"http://127.0.0.1:{up_port}/v1/chat/completions",
            "tierlane": f"http://127.0.0.1:{gw_port}/v1/chat/completions",
        }
        results: dict[str, Any] = {}
        for c in args.concurrency:
            r = asyncio.run(measure(targets, c, args.requests, args.rounds))
            r["added_p50_ms"] = round(r["tierlane"]["p50_ms"] - r["direct"]["p50_ms"], 3)
            r["added_p99_ms"] = round(r["tierlane"]["p99_ms"] - r["direct"]["p99_ms"], 3)
            r["throughput_ratio"] = round(r["tierlane"]["rps"] / r["direct"]["rps"], 3)
            results[f"concurrency_{c}"] = r
            print(f"concurrency {c}: added p50 {r['added_p50_ms']} ms, added p99 {r['added_p99_ms']} ms, "
                  f"rps direct {r['direct']['rps']} vs tierlane {r['tierlane']['rps']} ({r['throughput_ratio']:.0%})")
    finally:
        stop(gateway)
        stop(upstream)
    result = {
        "what": "added latency and throughput of tierlane pass-through vs direct, same fixed-answer upstream",
        "targets": {"added_p50_ms_at_1": "<= 1", "added_p99_ms_at_1": "<= 5", "throughput_ratio_at_64": ">= 0.6"},
        "requests_per_target": args.requests,
        "results": results,
    }
    path = write("proxy_overhead", {**result, "verdicts": verdicts("proxy_overhead", result)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
