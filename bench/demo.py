"""`make demo`: a real upstream, the gateway on its embedded defaults, two workloads, a replay each.

1. starts llama-cpp-python's OpenAI-compatible server on loopback with the bundled SmolLM2
   (the "upstream pool": a 135M model on the CPU stands in for a GPU server);
2. writes a workload from ../shared/data (bench/make_workload.py: everyday prompts mixed with
   repeats, paraphrases, hard and checkable ones) and replays it, each time through a fresh
   gateway on its embedded defaults plus that upstream (TIERLANE_UPSTREAM_URL), state in a
   temporary directory, shadow sampling on: with the edge off, with the edge and its learnt gate
   off (`cascade.learn.enabled: false`), and as shipped. The shipped run is the report; the three
   side by side say what the edge saves, how often it escalates once the gate has learnt (after
   the first 50 requests) and what it does to the upstream's time to first byte (`--no-compare`:
   the shipped run only);
3. the tiers workload: two replay upstreams (bench/replay_upstream.py) answer as the recorded
   cost and strong models did, behind a gateway with `lanes.upstream.tiers`, on the router's
   held-out MMLU subjects (a fixed-seed sample of `--tiers-mmlu` rows) and AlpacaEval sources (all),
   as bench/tiers.py measures them: cost and quality beside all-strong and random routing;
4. prints the reports, writes bench/results/demo.json, demo.png (the shipped replay),
   demo_edge.png (the three edge runs) and demo_tiers.png (the cost-quality curves), and stops
   the servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import RESULTS, free_port, start, stop
from bench._verdicts import verdicts
from bench.make_workload import DEFAULT_DATA, DataMissing, generate

UPSTREAM_MODEL = "smollm2-upstream"
# The edge runs, in the order they are made: (name, gateway environment, policy beside shadow).
EDGE_RUNS: tuple[tuple[str, dict[str, str], dict[str, Any]], ...] = (
    ("edge_off", {"TIERLANE_EDGE": "off"}, {}),
    ("learning_off", {}, {"cascade": {"learn": {"enabled": False}}}),
    ("shipped", {}, {}),
    # The semantic cache as it shipped before the cross-encoder: the embedding-feature verifier at
    # its own gate and threshold (before/after for the cache on the same workload).
    ("cache_before", {}, {"cache": {"threshold": 0.82, "verify": {"verifier": "bundled", "min_probability": 0.96}}}),
)
TARGETS = {
    "edge_net_saving_usd": ">= 0 (shipped)",
    "escalated_share_after_first_50": "<= 0.25 of the edge's attempts (shipped)",
    "upstream_ttft_p50_vs_edge_off": "<= 1.10 (shipped; upstream-served requests, streams)",
}


def start_upstream(tmp: Path, port: int, threads: int) -> Any:
    from edge_engine import bundled_model_path

    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(bundled_model_path()),
           "--model_alias", UPSTREAM_MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", "2048", "--n_threads", str(threads), "--verbose", "False",
           # A GPU server finishes the requests it has; llama_cpp.server by default drops a
           # running one when the next arrives, which empties concurrent answers.
           "--interrupt_requests", "False"]
    return start(cmd, f"http://127.0.0.1:{port}/v1/models", tmp / "upstream.log")


def start_gateway(tmp: Path, port: int, upstream_url: str, shadow_rate: float, *, name: str = "shipped",
                  env_extra: dict[str, str] | None = None, policy_extra: dict[str, Any] | None = None) -> Any:
    policy = tmp / f"policy-{name}.yaml"
    policy.write_text(json.dumps({"shadow": {"enabled": True, "sample_rate": shadow_rate, "seed": 0}, **(policy_extra or {})}))
    env = {
        **(env_extra or {}),
        "TIERLANE_UPSTREAM_URL": upstream_url,
        "TIERLANE_STATE_DIR": str(tmp / f"state-{name}"),
        "TIERLANE_PORT": str(port),
        "TIERLANE_POLICY": str(policy),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--log-level", "warning"]
    return start(cmd, f"http://127.0.0.1:{port}/healthz", tmp / f"gateway-{name}.log", env=env)


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


def edge_summary(report: dict[str, Any], load: list[float]) -> dict[str, Any]:
    """One edge run's figures: what the edge saved, tried and kept, and the upstream's time to first byte."""
    cost = report["cost"]
    upstream = report["lanes"].get("upstream") or {}
    return {
        "edge_net_saving_usd": cost["saved_by_reason_usd"]["edge"] if cost.get("source") else None,
        "saved_usd": cost.get("saved_usd"),
        "cost_usd": cost.get("cost_usd"),
        "edge": report["edge"],
        "cache": {
            "hit_rate": (report["lanes"].get("cache") or {}).get("share"),
            "hits": (report["lanes"].get("cache") or {}).get("requests", 0),
            "saved_usd": cost["saved_by_reason_usd"]["cache"] if cost.get("source") else None,
            "checked": (report["lanes"].get("cache") or {}).get("checked", 0),
            "correct": (report["lanes"].get("cache") or {}).get("correct", 0),
            "hit_rate_by_kind": {kind: block.get("cache_hit_rate") for kind, block in (report.get("kinds") or {}).items()},
        },
        "lanes": {lane: block["requests"] for lane, block in report["lanes"].items()},
        "route_reasons": report["route_reasons"],
        "upstream_ttft_ms": upstream.get("ttft_ms"),
        "upstream_latency_ms": upstream.get("latency_ms"),
        "quality": report["quality"],
        "wall_s": report["window"]["wall_s"],
        "load_average": {"before": load, "after": [round(x, 2) for x in os.getloadavg()]},
    }


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The shipped run beside the edge-off and learning-off runs of the same workload."""
    def ttft_ratio(name: str) -> float | None:
        off = ((runs.get("edge_off") or {}).get("upstream_ttft_ms") or {}).get("p50")
        run = ((runs.get(name) or {}).get("upstream_ttft_ms") or {}).get("p50")
        return round(run / off, 4) if off and run else None

    return {name: {"upstream_ttft_p50_vs_edge_off": ttft_ratio(name)} for name in runs if name != "edge_off"}


def run_tiers(mmlu_rows: int, seed: int, concurrency: int) -> dict[str, Any]:
    """bench/tiers.py's replay on a fixed-seed sample of its held-out MMLU rows (AlpacaEval: all)."""
    from unittest import mock

    import numpy as np

    from bench import tiers

    full = tiers.held_out

    def sampled(data_dir: Path, router: Any) -> dict[str, Any]:
        data = full(data_dir, router)
        mmlu = data["mmlu"]
        if 0 < mmlu_rows < len(mmlu.prompts):
            pick = np.sort(np.random.default_rng(seed).choice(len(mmlu.prompts), mmlu_rows, replace=False))
            data["mmlu"] = mmlu.take(pick)
        return data

    with mock.patch.object(tiers, "held_out", sampled):
        body = asyncio.run(tiers.run(None, concurrency))
    body["setup"]["sample"] = {"mmlu_rows": mmlu_rows, "seed": seed, "alpaca": "all held-out rows"}
    return body


def edge_chart(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    saving = [(runs[n]["edge_net_saving_usd"] or 0.0) * 1e6 for n in names]
    axes[0].bar(names, saving, color=["C2" if v >= 0 else "C3" for v in saving])
    axes[0].axhline(0, color="black", lw=0.8)
    axes[0].set_title("edge net saving (micro-USD)")
    after = [runs[n]["edge"]["after_first"] for n in names]
    xs = range(len(names))
    axes[1].bar([x - 0.2 for x in xs], [a["kept"] for a in after], width=0.4, label="kept")
    axes[1].bar([x + 0.2 for x in xs], [a["escalated"] for a in after], width=0.4, label="escalated", color="C3")
    axes[1].set_xticks(list(xs), names)
    axes[1].set_title(f"edge attempts after the first {runs[names[0]]['edge']['after']} requests")
    axes[1].legend()
    ttft = [(runs[n]["upstream_ttft_ms"] or {}).get("p50") or 0.0 for n in names]
    axes[2].bar(names, ttft, color="C0")
    axes[2].set_title("upstream-served time to first byte p50 (ms)")
    fig.suptitle("the demo workload with the edge off, the edge without its learnt gate, and as shipped")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tiers_chart(body: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pricing = "per_token_cost_1_10"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for ax, source in zip(axes, ("mmlu", "alpaca")):
        d = body[source]
        curve = d["curve"]
        ax.plot([p["cost_vs_all_strong"][pricing]["router"] for p in curve], [p["quality_vs_all_strong"] for p in curve],
                "o-", label="router, across share targets")
        ax.plot([p["cost_vs_all_strong"][pricing]["random"] for p in curve],
                [p["random_quality_vs_all_strong"] for p in curve], "--", color="grey", label="random, same share")
        at = d["at_shipped_target"]
        ax.plot([at["cost_vs_all_strong"][pricing]["router"]], [at["served_quality_vs_all_strong"]], "*", ms=16,
                color="C3", label=f"through the gateway (share {at['strong_share']:.2f})")
        ax.plot([1.0], [1.0], "s", ms=9, color="black", label="all-strong")
        ax.axhline(0.95, color="C2", lw=0.8, ls=":")
        ax.set_xlabel("cost / all-strong (per token, cost tier 1/10)")
        ax.set_ylabel("quality / all-strong")
        ax.set_title(f"{source}: {d['rows']} held-out rows")
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("upstream tiers through the gateway: cost and quality beside all-strong")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rate", type=float, default=4.0, help="workload arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--shadow-rate", type=float, default=0.25, help="share of cache/edge answers shadowed")
    parser.add_argument("--upstream-threads", type=int, default=1)
    parser.add_argument("--upstream-url", help="use this running OpenAI-compatible upstream (.../v1) instead of starting one")
    parser.add_argument("--no-compare", action="store_true", help="the shipped run only (no edge-off and learning-off runs)")
    parser.add_argument("--runs", default=",".join(name for name, _, _ in EDGE_RUNS),
                        help="the edge runs to make, comma-separated, of: " + ", ".join(name for name, _, _ in EDGE_RUNS))
    parser.add_argument("--tiers-mmlu", type=int, default=600, help="held-out MMLU rows sampled for the tiers workload (0: all)")
    parser.add_argument("--tiers-seed", type=int, default=0)
    parser.add_argument("--no-tiers", action="store_true", help="skip the tiers workload")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where demo.json and the charts go")
    parser.add_argument("--keep", action="store_true", help="keep the temporary state directories")
    args = parser.parse_args()

    from gateway.replay.chart import write_chart
    from gateway.replay.report import format_report
    from gateway.replay.run import replay
    from gateway.replay.workload import read_workload, write_workload

    began = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="tierlane-demo-"))
    try:
        records = list(generate(args.data, requests=args.requests, rate=args.rate, max_tokens=args.max_tokens))
    except (DataMissing, ValueError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    workload = tmp / "workload.jsonl"
    write_workload(workload, records)
    print(f"workload: {len(records)} requests in {workload}")
    wanted = {"shipped"} if args.no_compare else {name.strip() for name in args.runs.split(",")} | {"shipped"}
    plan = [run for run in EDGE_RUNS if run[0] in wanted]
    runs: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {}
    upstream = None
    try:
        up_port = free_port()
        upstream_url = args.upstream_url or f"http://127.0.0.1:{up_port}/v1"
        if not args.upstream_url:
            print("starting the upstream (llama_cpp.server, SmolLM2-135M on the CPU) ...", flush=True)
            upstream = start_upstream(tmp, up_port, args.upstream_threads)
            preflight(upstream, upstream_url)
        for name, env_extra, policy_extra in plan:
            print(f"[{name}] starting the gateway on its embedded defaults ...", flush=True)
            gw_port = free_port()
            gateway = start_gateway(tmp, gw_port, upstream_url, args.shadow_rate, name=name, env_extra=env_extra,
                                    policy_extra=policy_extra)
            try:
                url = f"http://127.0.0.1:{gw_port}"
                load = [round(x, 2) for x in os.getloadavg()]
                result = asyncio.run(replay(read_workload(workload), url, concurrency=args.concurrency,
                                            meta={"workload": "bench/make_workload.py defaults", "demo": True}))
                runs[name] = edge_summary(result, load)
                if name == "shipped":
                    report = result
                    # Shadow calls run in the background: give the last ones a moment before reading.
                    asyncio.run(asyncio.sleep(3))
                    status, body = get_json(url + "/v1/shadow")
                    report["shadow"] = body["data"] if status == 200 else {"unavailable": f"GET /v1/shadow answered {status}"}
                    # the dashboard as an operator sees it after the replay (headless Debian chromium)
                    from bench.dashboard import browser

                    args.out.mkdir(parents=True, exist_ok=True)
                    browser(url, 1, args.out / "dashboard.png")
                dead = [p for p in (upstream, gateway) if p is not None and p.poll() is not None]
                if dead:
                    raise RuntimeError(f"{dead[0].args[2]} exited during the replay (status {dead[0].returncode})")
            finally:
                stop(gateway)
                if not args.keep:
                    shutil.rmtree(tmp / f"state-{name}", ignore_errors=True)
    except RuntimeError as exc:
        print(f"demo: {exc}; logs in {tmp}", file=sys.stderr)
        return 1
    finally:
        if upstream is not None:
            stop(upstream)
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
    print("\nthe edge, run by run (same workload; attempts after the first 50 requests):")
    for name, run in runs.items():
        after = run["edge"]["after_first"]
        print(f"  {name:<13} edge saving ${run['edge_net_saving_usd']:.7f}  attempts {run['edge']['all']['attempts']} "
              f"(after 50: {after['attempts']}, escalated {after['escalated']}, kept {after['kept']})  "
              f"upstream TTFB p50 {(run['upstream_ttft_ms'] or {}).get('p50')} ms (escalated "
              f"{run['edge']['upstream_ttft_ms']['escalated']['p50']} ms)")
    report["edge_runs"] = runs
    report["edge_comparison"] = compare(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    chart = write_chart(report, tmp)
    shutil.copyfile(chart, args.out / "demo.png")
    if len(runs) > 1:
        edge_chart(runs, args.out / "demo_edge.png")
    if not args.no_tiers:
        print("\ntiers workload: two replay upstreams behind a gateway with lanes.upstream.tiers ...", flush=True)
        tiers_body = run_tiers(args.tiers_mmlu, args.tiers_seed, 8)
        report["tiers"] = {k: v for k, v in tiers_body.items() if k not in ("targets", "verdicts")}
        tiers_chart(tiers_body, args.out / "demo_tiers.png")
        for source in ("mmlu", "alpaca"):
            at = tiers_body[source]["at_shipped_target"]
            print(f"  {source:<7} rows {tiers_body[source]['rows']}: strong share {at['strong_share']}, quality "
                  f"{at['served_quality_vs_all_strong']} of all-strong at {at['cost_vs_all_strong']['per_token_cost_1_10']['router']} "
                  f"of its cost (per token, cost tier 1/10; random at that share: {at['random_quality_vs_all_strong']})")
    report["seconds"] = round(time.perf_counter() - began, 1)
    report["targets"] = TARGETS
    report["verdicts"] = verdicts("demo", report)
    (args.out / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out / 'demo.json'} and the charts in {args.out}  ({report['seconds']} s; logs: {tmp})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
