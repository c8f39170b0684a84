"""Gateway throughput with metering and tracing on vs off, side by side in one run.

Three processes: a fake OpenAI upstream (also the OTLP sink), and two gateways started with
`create_app` — one with telemetry fully on (ledger, budgets counting, OTel spans and metrics
exported over OTLP/HTTP, Prometheus), one with it off. The load generator (this process)
alternates rounds between the two, so drift on a shared machine hits both alike.

Writes bench/results/metering_overhead.json. Run: .venv/bin/python bench/metering_overhead.py
With BENCH_TRACE_RATIO=0.1 the traces are head-sampled at 10% (results/metering_overhead_sampled_0.1.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench._verdicts import verdicts  # noqa: E402

TARGET_RATIO = 0.90
ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "model": "gpt-4o-mini",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_upstream(port: int) -> None:
    """A fixed answer for chat; 200 for OTLP traces and metrics."""
    from aiohttp import web

    body = json.dumps(ANSWER).encode()

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def sink(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/traces", sink)
    app.router.add_post("/v1/metrics", sink)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def run_gateway(port: int, upstream_port: int, mode: str, state_dir: str, parts: set[str]) -> None:
    """A gateway from create_app, with telemetry wired the way the gateway core wires it."""
    from aiohttp import web

    from gateway import components
    from gateway.app import create_app
    from gateway.keys import SERVICES
    from gateway.pipeline import order
    from gateway.settings import Settings
    from telemetry import Telemetry, TelemetryConfig

    on = mode == "on"
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{upstream_port}",
        "OTEL_METRIC_EXPORT_INTERVAL": "5000",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": os.environ.get("BENCH_TRACE_RATIO", "1.0"),
    }

    async def build(settings: Any, policy: Any) -> Telemetry:
        config = TelemetryConfig(
            state_dir=Path(state_dir),
            tenants=("default",),
            apps=("default",),
            tracing=on and "tracing" in parts,
            metrics=on and "metrics" in parts,
            metering=on and "metering" in parts,
        )
        telemetry = Telemetry(config, policy, env=env)
        await telemetry.start()
        return telemetry

    if not any(c.attribute == "telemetry" for c in components.COMPONENTS):
        components.COMPONENTS.append(components.Component("telemetry", lambda s, p: True, build))
    if not any(m == "gateway.pipeline.budget" for m, _ in order.STAGES):
        order.STAGES.insert(0, ("gateway.pipeline.budget", "budgets"))
    if not any(m == "gateway.pipeline.meter" for m, _ in order.HOOKS):
        order.HOOKS.append(("gateway.pipeline.meter", None))
    settings = Settings.load(
        env={},
        overrides={
            "state_dir": state_dir,
            "edge": {"enabled": False},
            "embedder": {"enabled": False},
            "upstreams": [{"name": "u", "base_url": f"http://127.0.0.1:{upstream_port}/v1"}],
            "policy": {
                "cache": {"enabled": False},
                "router": {"enabled": False},
                "trim": {"enabled": False},
                # Limits far above the load, so every request walks the counting path.
                "budgets": {"enabled": True, "tenant": {"requests_per_minute": 10**9, "tokens_per_minute": 10**12}},
            },
        },
    )
    app = create_app(settings)

    @web.middleware
    async def server_span(request: web.Request, handler: Any) -> web.StreamResponse:
        services = request.app.get(SERVICES)
        telemetry = services.telemetry if services is not None else None
        if telemetry is None:
            return await handler(request)
        with telemetry.server_span(request) as span:
            response = await handler(request)
            span.set_status_code(response.status)
            return response

    app.middlewares.insert(0, server_span)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def wait_up(url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            try:
                async with session.get(url) as resp:
                    if resp.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def load(url: str, requests: int, concurrency: int) -> dict[str, float]:
    """Send `requests` chat completions with `concurrency` in flight; throughput and latency percentiles."""
    import aiohttp

    payload = json.dumps(
        {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    ).encode()
    latencies: list[float] = []
    errors = 0
    remaining = requests

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                if resp.status != 200:
                    errors += 1
            latencies.append(time.perf_counter() - started)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        began = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    latencies.sort()
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "errors": errors,
    }


async def bench(rounds: int, requests: int, concurrency: int, parts: str) -> dict[str, Any]:
    from tqdm import tqdm

    up_port, on_port, off_port = free_port(), free_port(), free_port()
    me = [sys.executable, str(Path(__file__).resolve())]
    procs = [subprocess.Popen([*me, "--role", "upstream", "--port", str(up_port)])]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for mode, port in (("on", on_port), ("off", off_port)):
                state = os.path.join(tmp, mode)
                procs.append(
                    subprocess.Popen(
                        [*me, "--role", "gateway", "--mode", mode, "--port", str(port),
                         "--upstream-port", str(up_port), "--state-dir", state, "--on-parts", parts]  # fmt: skip
                    )
                )
            ports = {"on": on_port, "off": off_port}
            for port in (up_port, on_port, off_port):
                await wait_up(f"http://127.0.0.1:{port}/healthz" if port != up_port else f"http://127.0.0.1:{port}/")
            urls = {m: f"http://127.0.0.1:{p}/v1/chat/completions" for m, p in ports.items()}
            for url in urls.values():  # warm-up: connections, imports, first ledger commit
                await load(url, requests // 4, concurrency)
            results: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
            for r in tqdm(range(rounds), desc="rounds (on/off alternating)"):
                order = ("on", "off") if r % 2 == 0 else ("off", "on")
                for mode in order:
                    results[mode].append(await load(urls[mode], requests, concurrency))
            ledger_rows = _ledger_rows(Path(tmp) / "on")
        finally:
            for proc in reversed(procs):  # gateways first, so their last exports still find the sink
                proc.terminate()
                proc.wait(timeout=30)
        ledger_rows_after_sigterm = _ledger_rows(Path(tmp) / "on")

    def summary(runs: list[dict[str, float]]) -> dict[str, float]:
        return {
            "rps_median": statistics.median(x["rps"] for x in runs),
            "p50_ms_median": statistics.median(x["p50_ms"] for x in runs),
            "p99_ms_median": statistics.median(x["p99_ms"] for x in runs),
            "errors": sum(x["errors"] for x in runs),
        }

    on, off = summary(results["on"]), summary(results["off"])
    ratio = on["rps_median"] / off["rps_median"]
    sent_on = rounds * requests + requests // 4
    return {
        "benchmark": "metering_overhead",
        "setup": {
            "rounds": rounds,
            "requests_per_round": requests,
            "concurrency": concurrency,
            "cpus": os.cpu_count(),
            "on": "ledger + budgets counting + OTel spans (OTLP/HTTP batch) + OTel metrics (OTLP, 5 s) + Prometheus",
            "on_parts": parts,
            "trace_sampling_ratio": float(os.environ.get("BENCH_TRACE_RATIO", "1.0")),
            "off": "telemetry switched off (no-op spans, no budget stage, no meter hook)",
        },
        "on": on,
        "off": off,
        "throughput_ratio_on_over_off": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "ledger_rows_on": {"sent": sent_on, "while_running": ledger_rows, "after_sigterm": ledger_rows_after_sigterm},
        "rounds": results,
    }


def _ledger_rows(state: Path) -> int | None:
    import sqlite3

    path = state / "ledger.sqlite3"
    if not path.exists():
        return None
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
    finally:
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("bench", "upstream", "gateway"), default="bench")
    parser.add_argument("--mode", choices=("on", "off"), default="on")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream-port", type=int, default=0)
    parser.add_argument("--state-dir", default="")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--on-parts", default="tracing,metrics,metering", help="what 'on' switches on (for profiling)")
    args = parser.parse_args()
    if args.role == "upstream":
        run_upstream(args.port)
        return 0
    if args.role == "gateway":
        run_gateway(args.port, args.upstream_port, args.mode, args.state_dir, set(args.on_parts.split(",")))
        return 0
    result = asyncio.run(bench(args.rounds, args.requests, args.concurrency, args.on_parts))
    ratio = os.environ.get("BENCH_TRACE_RATIO")
    suffix = "" if ratio in (None, "1.0", "1") else f"_sampled_{ratio}"
    out = REPO / "bench" / "results" / f"metering_overhead{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result["verdicts"] = verdicts("metering_overhead", result)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
