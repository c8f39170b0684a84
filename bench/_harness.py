"""Shared pieces of the benchmarks: processes on loopback, load loops, percentiles, result files."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout}s")


def start(cmd: list[str], health_url: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    wait_http(health_url, proc)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def gateway_cmd(config: dict[str, Any], path: Path, port: int) -> list[str]:
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port), "--log-level", "warning"]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary_ms(latencies_s: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in latencies_s]
    return {
        "p50_ms": round(pct(ms, 0.5), 3),
        "p99_ms": round(pct(ms, 0.99), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "n": len(ms),
    }


async def load(
    url: str,
    body: dict[str, Any],
    *,
    concurrency: int,
    requests: int,
    headers: dict[str, str] | None = None,
    progress: Any = None,
    overheads: list[float] | None = None,
) -> tuple[list[float], float, int]:
    """Send `requests` POSTs with `concurrency` in flight; return (latencies, wall seconds, errors).

    With `overheads`, the gateway's own `x-tierlane-overhead-ms` of each answer is collected.
    """
    latencies: list[float] = []
    errors = 0
    todo = iter(range(requests))
    payload = json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        for _ in todo:
            t0 = time.perf_counter()
            async with session.post(url, data=payload, headers=hdrs) as resp:
                await resp.read()
                if resp.status != 200:
                    errors += 1
                if overheads is not None and "x-tierlane-overhead-ms" in resp.headers:
                    overheads.append(float(resp.headers["x-tierlane-overhead-ms"]))
            latencies.append(time.perf_counter() - t0)
            if progress is not None:
                progress.update(1)

    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return latencies, wall, errors


async def load_at_rate(
    url: str, body: dict[str, Any], *, rate: float, requests: int, concurrency: int, progress: Any = None
) -> tuple[list[float], float, int]:
    """Send `requests` POSTs due every 1/`rate` s, at most `concurrency` in flight; return (latencies,
    wall seconds, errors). Latency counts from when a request was due, so a request that had to
    wait for a free connection counts its wait (no coordinated omission)."""
    latencies: list[float] = []
    errors = 0
    todo = iter(range(requests))
    payload = json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    started = time.perf_counter()

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        for i in todo:
            due = started + i / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            async with session.post(url, data=payload, headers=hdrs) as resp:
                await resp.read()
                errors += resp.status != 200
            latencies.append(time.perf_counter() - due)
            if progress is not None:
                progress.update(1)

    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return latencies, time.perf_counter() - started, errors


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}


def write(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), **data}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
