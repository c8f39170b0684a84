"""Proxy overhead next to a peer: direct, tierlane pass-through, tierlane full pipeline, LiteLLM proxy.

Writes bench/results/peers.json. All four sit in front of the same fixed-answer upstream
(bench/fast_upstream.py) on loopback and get the same load, target after target in
alternating rounds, at each concurrency. Every request carries a unique prompt, so the full
pipeline never answers from its cache. Measured: added latency (p50/p99 over direct),
requests per second, and the peak RSS (VmHWM) of each proxy's processes.

LiteLLM is installed by this script into its own virtualenv under bench/.peers/litellm
(reused when the pinned version is already there).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import REPO, free_port, gateway_cmd, start, stop, summary_ms, wait_http, write
from bench._verdicts import verdicts
from bench.proxy_overhead import pass_through_config

LITELLM_VERSION = "1.100.0"
PEERS = REPO / "bench" / ".peers"
LITELLM_VENV = PEERS / "litellm"
# Calibration from the issue: LiteLLM 1.100.0, one worker, a 2-core machine.
CALIBRATION = {"litellm_added_p50_ms_at_1": 14.5, "litellm_rps_any_concurrency": [67, 78]}
TARGETS = {
    "passthrough_added_p99_vs_litellm": "<= 0.1",
    "passthrough_rps_vs_litellm": ">= 10",
    "full_pipeline_rps_vs_litellm": ">= 3",
}
# Access log off, like the other targets (tierlane serves with access_log=None).
LITELLM_LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
    "handlers": {"err": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}},
    "loggers": {
        "uvicorn": {"handlers": ["err"], "level": "WARNING"},
        "uvicorn.error": {"level": "WARNING"},
        "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
    },
}


def ensure_litellm(version: str = LITELLM_VERSION) -> Path:
    """The `litellm` executable of bench/.peers/litellm, installing the pinned version if needed."""
    exe = LITELLM_VENV / "bin" / "litellm"
    python = LITELLM_VENV / "bin" / "python"
    if exe.exists():
        probe = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True, text=True,
        )
        if probe.returncode == 0 and probe.stdout.strip() == version:
            print(f"reusing LiteLLM {version} in {LITELLM_VENV}")
            return exe
    print(f"installing litellm[proxy]=={version} into {LITELLM_VENV} (takes minutes the first time)")
    if not python.exists():
        subprocess.run(["python3.11", "-m", "venv", str(LITELLM_VENV)], check=True)
    cmd = [str(LITELLM_VENV / "bin" / "pip"), "install", "--progress-bar", "off", f"litellm[proxy]=={version}"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc, \
            tqdm(desc="pip install litellm", unit=" lines") as bar:
        assert proc.stdout is not None
        for line in proc.stdout:
            bar.update(1)
            bar.set_postfix_str(line.strip()[:60], refresh=False)
    if proc.returncode != 0:
        raise SystemExit(f"pip install of litellm failed ({proc.returncode}); rerun to see pip's output")
    return exe


def tree_pids(pid: int) -> list[int]:
    """The process and all its descendants (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def peak_rss_mb(pid: int) -> float | None:
    """Sum of VmHWM (peak resident set) over a process tree, in MiB."""
    total, seen = 0, False
    for p in tree_pids(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
                    seen = True
        except OSError:
            pass
    return round(total / 1024, 1) if seen else None


_counter = itertools.count()


def body_for(model: str) -> bytes:
    n = next(_counter)
    return json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": f"Request {n}: what is {n % 97} times seven?"}],
        "max_tokens": 16,
    }).encode()


async def load(url: str, model: str, *, concurrency: int, requests: int, bar: Any = None) -> tuple[list[float], float, int]:
    """`requests` POSTs with unique prompts, `concurrency` in flight; (latencies, wall seconds, errors)."""
    latencies: list[float] = []
    errors = 0
    todo = iter(range(requests))
    headers = {"Content-Type": "application/json", "Authorization": "Bearer x"}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        for _ in todo:
            payload = body_for(model)
            t0 = time.perf_counter()
            try:
                async with session.post(url, data=payload, headers=headers) as resp:
                    await resp.read()
                    errors += resp.status != 200
            except (TimeoutError, aiohttp.ClientError):
                errors += 1
            latencies.append(time.perf_counter() - t0)
            if bar is not None:
                bar.update(1)

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return latencies, time.perf_counter() - started, errors


async def measure(targets: dict[str, tuple[str, str]], concurrency: int, requests: int, rounds: int,
                  deadline: float) -> dict[str, Any]:
    lat: dict[str, list[float]] = {k: [] for k in targets}
    walls = dict.fromkeys(targets, 0.0)
    errors = dict.fromkeys(targets, 0)
    per_round = max(1, requests // rounds)
    done_rounds = 0
    with tqdm(total=per_round * rounds * len(targets), desc=f"concurrency {concurrency}", unit="req") as bar:
        for url, model in targets.values():  # warm-up: connections, lazy imports, JIT-ish caches
            await load(url, model, concurrency=concurrency, requests=min(100, per_round))
        for _ in range(rounds):
            if time.monotonic() > deadline and done_rounds:
                break
            for name, (url, model) in targets.items():
                got, wall, err = await load(url, model, concurrency=concurrency, requests=per_round, bar=bar)
                lat[name] += got
                walls[name] += wall
                errors[name] += err
            done_rounds += 1
    out: dict[str, Any] = {"rounds": done_rounds}
    for name in targets:
        out[name] = {**summary_ms(lat[name]), "rps": round(len(lat[name]) / walls[name], 1), "errors": errors[name]}
    for name in targets:
        if name != "direct":
            out[name]["added_p50_ms"] = round(out[name]["p50_ms"] - out["direct"]["p50_ms"], 3)
            out[name]["added_p99_ms"] = round(out[name]["p99_ms"] - out["direct"]["p99_ms"], 3)
    return out


def full_pipeline_config(upstream_url: str, state_dir: str) -> dict[str, Any]:
    """The embedded defaults plus one upstream; the edge engine off so `auto` always goes upstream."""
    return {
        "state_dir": state_dir,
        "edge": {"enabled": False},
        "upstreams": [{"name": "fast", "base_url": upstream_url, "models": ["*"], "max_connections": 256}],
    }


def pipeline_description() -> dict[str, Any]:
    from gateway.pipeline import order

    return {"stages": [m for m, _ in order.STAGES], "hooks": [m for m, _ in order.HOOKS]}


def start_litellm(exe: Path, upstream_url: str, port: int, tmp: Path) -> subprocess.Popen[bytes]:
    config = {
        "model_list": [{"model_name": "fast-model",
                        "litellm_params": {"model": "openai/fast-model", "api_base": upstream_url, "api_key": "x"}}],
        "litellm_settings": {
            "telemetry": False, "set_verbose": False, "json_logs": False, "turn_off_message_logging": True,
            "callbacks": [], "success_callback": [], "failure_callback": [], "cache": False,
        },
        "general_settings": {"disable_spend_logs": True, "disable_error_logs": True, "background_health_checks": False},
    }
    (tmp / "litellm.yaml").write_text(yaml.safe_dump(config))
    (tmp / "litellm-log.json").write_text(json.dumps(LITELLM_LOG_CONFIG))
    cmd = [str(exe), "--config", str(tmp / "litellm.yaml"), "--host", "127.0.0.1", "--port", str(port),
           "--num_workers", "1", "--telemetry", "False", "--log_config", str(tmp / "litellm-log.json")]
    env = {"LITELLM_LOG": "ERROR", "LITELLM_MODE": "PRODUCTION", "LITELLM_TELEMETRY": "False"}
    proc = subprocess.Popen(cmd, stdout=open(tmp / "litellm.log", "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, **env}, cwd=tmp)
    wait_http(f"http://127.0.0.1:{port}/health/liveliness", proc, timeout=180)
    return proc


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for level, r in results.items():
        ll, pt, full = r["litellm"], r["tierlane_passthrough"], r["tierlane_full"]
        p99_ratio = pt["added_p99_ms"] / ll["added_p99_ms"] if ll["added_p99_ms"] > 0 else None
        out[level] = {
            "passthrough_added_p99_vs_litellm": None if p99_ratio is None else round(p99_ratio, 3),
            "passthrough_rps_vs_litellm": round(pt["rps"] / ll["rps"], 2),
            "full_pipeline_rps_vs_litellm": round(full["rps"] / ll["rps"], 2),
        }
        out[level]["met"] = {
            "passthrough_added_p99": p99_ratio is not None and p99_ratio <= 0.1,
            "passthrough_rps": pt["rps"] >= 10 * ll["rps"],
            "full_pipeline_rps": full["rps"] >= 3 * ll["rps"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600, help="requests per target and concurrency")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--budget-s", type=float, default=420, help="stop starting new rounds after this long")
    parser.add_argument("--litellm-version", default=LITELLM_VERSION)
    args = parser.parse_args()
    began = time.monotonic()
    exe = ensure_litellm(args.litellm_version)
    deadline = time.monotonic() + args.budget_s
    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="tierlane-peers-"))
    up_port, pt_port, full_port, ll_port = (free_port() for _ in range(4))
    up_url = f"http://127.0.0.1:{up_port}/v1"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["upstream"] = start([sys.executable, str(Path(__file__).with_name("fast_upstream.py")), "--port", str(up_port)],
                                  f"{up_url}/models", tmp / "upstream.log")
        procs["tierlane_passthrough"] = start(
            gateway_cmd(pass_through_config(up_url, str(tmp / "pt-state")), tmp / "pt.yaml", pt_port),
            f"http://127.0.0.1:{pt_port}/healthz", tmp / "pt.log", env={"HF_HUB_OFFLINE": "1"})
        procs["tierlane_full"] = start(
            gateway_cmd(full_pipeline_config(up_url, str(tmp / "full-state")), tmp / "full.yaml", full_port),
            f"http://127.0.0.1:{full_port}/healthz", tmp / "full.log", env={"HF_HUB_OFFLINE": "1"})
        print("starting the LiteLLM proxy (its start-up takes a while)")
        procs["litellm"] = start_litellm(exe, up_url, ll_port, tmp)
        targets = {
            "direct": (f"{up_url}/chat/completions", "fast-model"),
            "tierlane_passthrough": (f"http://127.0.0.1:{pt_port}/v1/chat/completions", "fast-model"),
            "tierlane_full": (f"http://127.0.0.1:{full_port}/v1/chat/completions", "auto"),
            "litellm": (f"http://127.0.0.1:{ll_port}/v1/chat/completions", "fast-model"),
        }
        results: dict[str, Any] = {}
        for c in args.concurrency:
            if time.monotonic() > deadline:
                print(f"time budget spent: concurrency {c} not measured")
                continue
            r = asyncio.run(measure(targets, c, args.requests, args.rounds, deadline))
            results[f"concurrency_{c}"] = r
            print(f"concurrency {c}: " + "; ".join(
                f"{n} +{r[n]['added_p50_ms']}/+{r[n]['added_p99_ms']} ms p50/p99, {r[n]['rps']} rps"
                for n in targets if n != "direct") + f"; direct {r['direct']['rps']} rps")
        rss = {name: peak_rss_mb(p.pid) for name, p in procs.items() if name != "upstream"}
    finally:
        for p in procs.values():
            stop(p)
    load_after = os.getloadavg()
    cpus = os.cpu_count() or 1
    noisy = max(load_before[0], load_after[0]) > cpus * 0.75
    result: dict[str, Any] = {
        "what": "added latency, throughput and peak RSS of tierlane (pass-through, full pipeline) and LiteLLM's "
                "proxy in front of the same fixed-answer upstream, unique prompts, side by side",
        "litellm": {
            "version": args.litellm_version,
            "command": "litellm --config cfg.yaml --host 127.0.0.1 --port P --num_workers 1 --telemetry False --log_config log.json",
            "switches_off": ["--telemetry False", "LITELLM_TELEMETRY=False", "LITELLM_LOG=ERROR", "uvicorn access log (log_config)",
                             "litellm_settings: telemetry false, set_verbose false, turn_off_message_logging, no callbacks, cache false",
                             "general_settings: disable_spend_logs, disable_error_logs, background_health_checks false",
                             "no database, no master key"],
        },
        "tierlane_full": {
            "config": "embedded defaults + the upstream (models '*'), model 'auto', edge engine disabled so the router always sends upstream",
            "pipeline": pipeline_description(),
        },
        "targets": TARGETS,
        "calibration": CALIBRATION,
        "requests_per_target": args.requests,
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after], "cpus": cpus},
        "noisy": noisy,
        "note": ("the machine was loaded by other work during the run (load average above its core count): "
                 "absolute numbers are noisy; the load generator, upstream and proxies share the same cores")
                if noisy else "load generator, upstream and proxies share the same cores",
        "peak_rss_mb": rss,
        "results": results,
        "verdict": verdict(results) if results else {},
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    path = write("peers", {**result, "verdicts": verdicts("peers", result)})
    print(json.dumps(json.loads(path.read_text())["verdict"], indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
