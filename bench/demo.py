"""`make demo`: a real upstream, the gateway on its embedded defaults, a generated workload, a replay.

1. starts llama-cpp-python's OpenAI-compatible server on loopback with the bundled SmolLM2
   (the "upstream pool": a 135M model on the CPU stands in for a GPU server);
2. starts the gateway on its embedded defaults plus that upstream (TIERLANE_UPSTREAM_URL),
   state in a temporary directory, with shadow sampling turned on;
3. writes a workload from ../shared/data (bench/make_workload.py) and replays it;
4. prints the report and the shadow agreement, writes bench/results/demo.json and demo.png,
   and stops both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import RESULTS, free_port, start, stop
from bench.make_workload import DEFAULT_DATA, DataMissing, generate

UPSTREAM_MODEL = "smollm2-upstream"


def start_upstream(tmp: Path, port: int, threads: int) -> Any:
    from edge_engine import bundled_model_path

    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(bundled_model_path()),
           "--model_alias", UPSTREAM_MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", "2048", "--n_threads", str(threads), "--verbose", "False"]
    return start(cmd, f"http://127.0.0.1:{port}/v1/models", tmp / "upstream.log")


def start_gateway(tmp: Path, port: int, upstream_url: str, shadow_rate: float) -> Any:
    policy = tmp / "policy.yaml"
    policy.write_text(json.dumps({"shadow": {"enabled": True, "sample_rate": shadow_rate, "seed": 0}}))
    env = {
        "TIERLANE_UPSTREAM_URL": upstream_url,
        "TIERLANE_STATE_DIR": str(tmp / "state"),
        "TIERLANE_PORT": str(port),
        "TIERLANE_POLICY": str(policy),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--log-level", "warning"]
    return start(cmd, f"http://127.0.0.1:{port}/healthz", tmp / "gateway.log", env=env)


def preflight(proc: Any, base_url: str) -> None:
    """One small completion straight to the upstream, so a broken llama.cpp build fails fast and clearly."""
    body = json.dumps({"model": UPSTREAM_MODEL, "messages": [{"role": "user", "content": "Say hi."}],
                       "max_tokens": 4}).encode()
    request = urllib.request.Request(base_url + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            resp.read()
    except OSError as exc:
        code = proc.wait(5) if proc.poll() is None else proc.returncode
        raise RuntimeError(f"the upstream failed its first completion ({exc}; exit status {code}). "
                           "A negative status -11 is a segfault inside llama.cpp: a build with AMX kernels "
                           "crashes in containers; rebuild with `make install LLAMA_REBUILD=1`") from None


def get_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except OSError as exc:
        return 0, str(exc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rate", type=float, default=4.0, help="workload arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--shadow-rate", type=float, default=0.25, help="share of cache/edge answers shadowed")
    parser.add_argument("--upstream-threads", type=int, default=1)
    parser.add_argument("--upstream-url", help="use this running OpenAI-compatible upstream (.../v1) instead of starting one")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where demo.json and demo.png go")
    parser.add_argument("--keep", action="store_true", help="keep the temporary state directory")
    args = parser.parse_args()

    from gateway.replay.chart import write_chart
    from gateway.replay.report import format_report
    from gateway.replay.run import replay
    from gateway.replay.workload import read_workload, write_workload

    tmp = Path(tempfile.mkdtemp(prefix="tierlane-demo-"))
    try:
        records = list(generate(args.data, requests=args.requests, rate=args.rate, max_tokens=args.max_tokens))
    except (DataMissing, ValueError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    workload = tmp / "workload.jsonl"
    write_workload(workload, records)
    print(f"workload: {len(records)} requests in {workload}")
    procs = []
    try:
        up_port, gw_port = free_port(), free_port()
        upstream_url = args.upstream_url or f"http://127.0.0.1:{up_port}/v1"
        if not args.upstream_url:
            print("starting the upstream (llama_cpp.server, SmolLM2-135M on the CPU) ...", flush=True)
            procs.append(start_upstream(tmp, up_port, args.upstream_threads))
            preflight(procs[0], upstream_url)
        print("starting the gateway on its embedded defaults ...", flush=True)
        procs.append(start_gateway(tmp, gw_port, upstream_url, args.shadow_rate))
        url = f"http://127.0.0.1:{gw_port}"
        report = asyncio.run(replay(read_workload(workload), url, concurrency=args.concurrency,
                                    meta={"workload": "bench/make_workload.py defaults", "demo": True}))
        # Shadow calls run in the background: give the last ones a moment before reading.
        asyncio.run(asyncio.sleep(3))
        status, body = get_json(url + "/v1/shadow")
        report["shadow"] = body["data"] if status == 200 else {"unavailable": f"GET /v1/shadow answered {status}"}
        # the dashboard as an operator sees it after the replay (headless Debian chromium)
        from bench.dashboard import browser

        args.out.mkdir(parents=True, exist_ok=True)
        browser(url, 1, args.out / "dashboard.png")
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead[0].args[2]} exited during the replay (status {dead[0].returncode})")
    except RuntimeError as exc:
        print(f"demo: {exc}; logs in {tmp}", file=sys.stderr)
        return 1
    finally:
        for proc in reversed(procs):
            stop(proc)
        if not args.keep:
            shutil.rmtree(tmp / "state", ignore_errors=True)
    print()
    print(format_report(report), end="")
    shadow = report["shadow"]
    if isinstance(shadow, list):
        print("shadow agreement with the upstream (cosine of answer embeddings):")
        for row in shadow or [{"lane": "(none sampled)", "count": 0, "mean": None, "p10": None, "share_above_0_8": None}]:
            print(f"  {row['lane']:<14} n={row['count']:<4} mean={row['mean']}  p10={row['p10']}  "
                  f">0.8: {row['share_above_0_8']}")
    else:
        print(f"shadow: {shadow['unavailable']}")
    if not report["totals"]["ok"]:
        print(f"demo: no request succeeded; nothing written (logs: {tmp})", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    chart = write_chart(report, tmp)
    shutil.copyfile(chart, args.out / "demo.png")
    print(f"wrote {args.out / 'demo.json'} and {args.out / 'demo.png'}  (logs: {tmp})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
