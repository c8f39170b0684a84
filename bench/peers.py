"""Proxy overhead next to a peer: direct, tierlane pass-through, tierlane full pipeline, LiteLLM proxy.

Writes bench/results/peers.json. All four sit in front of the same fixed-answer upstream
(bench/fast_upstream.py) on loopback and get the same load, target after target in
alternating rounds (at least three; the order turns each round), at each concurrency. Every
request carries a unique prompt, so the full pipeline never answers from its cache.
Measured per round: added latency (p50/p99 over direct in the same round), requests per
second, and the ratios to LiteLLM; reported as the median over the rounds with the spread
(min, max). Also: the peak RSS (VmHWM) of each proxy's processes, the load average, and the
full pipeline's event-loop stalls (its /metrics) at each concurrency.

LiteLLM is installed by this script into its own virtualenv under bench/.peers/litellm
(reused when the pinned version is already there).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
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
MIN_ROUNDS = 3  # rounds run even past the time budget
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


FIGURES = ("p50_ms", "p99_ms", "rps", "added_p50_ms", "added_p99_ms")


def round_figures(latencies: list[float], wall: float, errors: int) -> dict[str, Any]:
    return {**summary_ms(latencies), "rps": round(len(latencies) / wall, 1), "errors": errors}


def median_and_spread(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's figures over the rounds: the median of each, its spread [min, max], errors summed."""
    out: dict[str, Any] = {}
    spread: dict[str, list[float]] = {}
    for name in FIGURES:
        values = [r[name] for r in rounds if r.get(name) is not None]
        if values:
            out[name] = round(statistics.median(values), 3)
            spread[name] = [min(values), max(values)]
    out["n"] = sum(r["n"] for r in rounds)
    out["errors"] = sum(r["errors"] for r in rounds)
    out["spread"] = spread
    return out


async def measure(targets: dict[str, tuple[str, str]], concurrency: int, requests: int, rounds: int,
                  deadline: float) -> dict[str, Any]:
    """`rounds` rounds, each sending every target `requests // rounds` requests in turn.

    The order of the targets turns by one each round, so no target always follows the same
    one. Each figure is computed per round (added latency against `direct` of the same round),
    then reported as the median over the rounds with its spread (min, max).
    """
    per_round = max(1, requests // rounds)
    names = list(targets)
    done: list[dict[str, dict[str, Any]]] = []
    with tqdm(total=per_round * rounds * len(targets), desc=f"concurrency {concurrency}", unit="req") as bar:
        for url, model in targets.values():  # warm-up: connections, lazy imports, JIT-ish caches
            await load(url, model, concurrency=concurrency, requests=min(100, per_round))
        # NOTE: the load generator's own heap out of its full collections, so that none of its GC
        # pauses lands inside one target's measurement more than another's.
        gc.collect()
        gc.freeze()
        for i in range(rounds):
            if time.monotonic() > deadline and len(done) >= MIN_ROUNDS:
                break
            this: dict[str, dict[str, Any]] = {}
            for name in names[i % len(names):] + names[: i % len(names)]:
                url, model = targets[name]
                got, wall, err = await load(url, model, concurrency=concurrency, requests=per_round, bar=bar)
                this[name] = round_figures(got, wall, err)
            for name, r in this.items():
                if name != "direct":
                    r["added_p50_ms"] = round(r["p50_ms"] - this["direct"]["p50_ms"], 3)
                    r["added_p99_ms"] = round(r["p99_ms"] - this["direct"]["p99_ms"], 3)
            done.append(this)
        gc.unfreeze()
    out: dict[str, Any] = {"rounds": len(done), "requests_per_round": per_round}
    for name in names:
        out[name] = median_and_spread([r[name] for r in done])
    out["per_round"] = [{name: {k: r[name][k] for k in (*FIGURES, "errors") if k in r[name]} for name in names}
                        for r in done]
    out["ratios"] = round_ratios(done)
    return out


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 3) if den > 0 else None


def round_ratios(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Each round's tierlane-to-LiteLLM ratios (the same round: the same load on the machine), as median and spread."""
    per: dict[str, list[float]] = {"passthrough_added_p99_vs_litellm": [], "passthrough_rps_vs_litellm": [],
                                   "full_pipeline_rps_vs_litellm": [], "full_pipeline_added_p50_vs_litellm": [],
                                   "full_pipeline_fp32_rps_vs_litellm": []}
    for r in rounds:
        ll, pt, full = r["litellm"], r["tierlane_passthrough"], r["tierlane_full"]
        for name, value in (
            ("passthrough_added_p99_vs_litellm", _ratio(pt["added_p99_ms"], ll["added_p99_ms"])),
            ("passthrough_rps_vs_litellm", _ratio(pt["rps"], ll["rps"])),
            ("full_pipeline_rps_vs_litellm", _ratio(full["rps"], ll["rps"])),
            ("full_pipeline_added_p50_vs_litellm", _ratio(full["added_p50_ms"], ll["added_p50_ms"])),
            ("full_pipeline_fp32_rps_vs_litellm",
             _ratio(r["tierlane_full_fp32"]["rps"], ll["rps"]) if "tierlane_full_fp32" in r else None),
        ):
            if value is not None:
                per[name].append(value)
    return {name: {"median": round(statistics.median(v), 3), "spread": [min(v), max(v)]} if v else None
            for name, v in per.items() if v or name != "full_pipeline_fp32_rps_vs_litellm"}


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


def loop_stats(metrics_url: str, since: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gateway's event-loop stall figures from its /metrics (the largest lag since the previous read).

    With `since`, the stall count is the number added since that read.
    """
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("tierlane_event_loop_stalls_total", "tierlane_event_loop_lag_max_seconds"):
            values[name] = float(value)
    stalls = values.get("tierlane_event_loop_stalls_total", 0.0)
    out = {"stalls_total": stalls, "max_lag_ms": round(values.get("tierlane_event_loop_lag_max_seconds", 0.0) * 1000, 1)}
    if since is not None:
        out["stalls"] = stalls - since["stalls_total"]
    return out


def _median(ratios: dict[str, Any], name: str) -> float | None:
    found = ratios.get(name)
    return None if found is None else float(found["median"])


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """Per concurrency: the median over the rounds of each round's ratio, and whether it meets its target."""
    out: dict[str, Any] = {}
    for level, r in results.items():
        p99, pt_rps, full_rps = (_median(r["ratios"], name) for name in (
            "passthrough_added_p99_vs_litellm", "passthrough_rps_vs_litellm", "full_pipeline_rps_vs_litellm"))
        out[level] = {
            "passthrough_added_p99_vs_litellm": p99,
            "passthrough_rps_vs_litellm": pt_rps,
            "full_pipeline_rps_vs_litellm": full_rps,
            "met": {
                "passthrough_added_p99": p99 is not None and p99 <= 0.1,
                "passthrough_rps": pt_rps is not None and pt_rps >= 10,
                "full_pipeline_rps": full_rps is not None and full_rps >= 3,
            },
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests per target and concurrency, over all rounds")
    parser.add_argument("--rounds", type=int, default=5, help=f"alternating rounds per concurrency (at least {MIN_ROUNDS})")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--budget-s", type=float, default=900,
                        help=f"stop starting new rounds after this long (each concurrency still gets {MIN_ROUNDS})")
    parser.add_argument("--litellm-version", default=LITELLM_VERSION)
    parser.add_argument("--no-fp32", action="store_true",
                        help="leave out the full pipeline with embedder.precision fp32 (a fifth target, for comparison)")
    args = parser.parse_args()
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}")
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
        if not args.no_fp32:
            fp32_port = free_port()
            fp32_config = full_pipeline_config(up_url, str(tmp / "fp32-state")) | {"embedder": {"precision": "fp32"}}
            procs["tierlane_full_fp32"] = start(
                gateway_cmd(fp32_config, tmp / "fp32.yaml", fp32_port),
                f"http://127.0.0.1:{fp32_port}/healthz", tmp / "fp32.log", env={"HF_HUB_OFFLINE": "1"})
        print("starting the LiteLLM proxy (its start-up takes a while)")
        procs["litellm"] = start_litellm(exe, up_url, ll_port, tmp)
        targets = {
            "direct": (f"{up_url}/chat/completions", "fast-model"),
            "tierlane_passthrough": (f"http://127.0.0.1:{pt_port}/v1/chat/completions", "fast-model"),
            "tierlane_full": (f"http://127.0.0.1:{full_port}/v1/chat/completions", "auto"),
            "litellm": (f"http://127.0.0.1:{ll_port}/v1/chat/completions", "fast-model"),
        }
        if not args.no_fp32:
            targets["tierlane_full_fp32"] = (f"http://127.0.0.1:{fp32_port}/v1/chat/completions", "auto")
        full_metrics = f"http://127.0.0.1:{full_port}/metrics"
        loop_before = loop_stats(full_metrics)
        results: dict[str, Any] = {}
        for c in args.concurrency:
            load_at_start = os.getloadavg()[0]
            loop_stats(full_metrics)  # empties the gauge of the largest lag: what follows is this level's
            r = asyncio.run(measure(targets, c, args.requests, args.rounds, deadline))
            r["load_average_1m_at_start"] = round(load_at_start, 2)
            r["tierlane_full_loop"] = loop_stats(full_metrics, since=loop_before)
            loop_before = loop_stats(full_metrics)
            results[f"concurrency_{c}"] = r
            print(f"concurrency {c} ({r['rounds']} rounds, medians): " + "; ".join(
                f"{n} +{r[n]['added_p50_ms']}/+{r[n]['added_p99_ms']} ms p50/p99, {r[n]['rps']} rps"
                for n in targets if n != "direct") + f"; direct {r['direct']['rps']} rps; ratios {r['ratios']}")
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
            "config": "embedded defaults (embedder.precision int8) + the upstream (models '*'), model 'auto', edge engine "
                      "disabled so the router always sends upstream",
            "pipeline": pipeline_description(),
        },
        "tierlane_full_fp32": None if args.no_fp32 else {
            "config": "tierlane_full's, with embedder.precision fp32 (the default is int8, "
                      "bench/results/embedding_precision.json); for comparison, no target",
        },
        "targets": TARGETS,
        "calibration": CALIBRATION,
        "requests_per_target": args.requests,
        "rounds": args.rounds,
        "figures": "per concurrency, each target's figures are the median over the rounds, `spread` their [min, max]; "
                   "added latency is against `direct` in the same round; the ratios are taken within each round, "
                   "then their median and spread",
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
