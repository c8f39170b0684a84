"""The dashboard over a large ledger: page load (HTML + JSON) and the JSON endpoint's query time.

1. builds a ledger of --rows requests (default 1,000,000) spread over the last --days days
   through the real writer (rows and their rollups, as metering writes them), with a progress bar;
2. starts the gateway on that state directory (`tierlane serve`, keys auth, an admin key);
3. times page loads: GET /dashboard then GET /v1/dashboard, as the page does, for several views
   (the default last 7 days, 30 days in UTC and in Asia/Kolkata, one day by hour, one tenant);
   p50/p95 of the whole load and of the server's own query time (`query_ms` in the JSON);
4. with Playwright and Debian's chromium: the load in a real browser until the page has drawn
   the figures, and a screenshot (--screenshot);
5. writes bench/results/dashboard.json.

    .venv/bin/python bench/dashboard.py                        # 1M rows, writes bench/results/dashboard.json
    .venv/bin/python bench/dashboard.py --rows 100000 --out /tmp/r
    # the screenshot of a real run: keep the demo's state and point this script at it
    .venv/bin/python bench/demo.py --keep                      # prints "(logs: /tmp/tierlane-demo-XXXX)"
    .venv/bin/python bench/dashboard.py --state-dir /tmp/tierlane-demo-XXXX/state --screenshot bench/results/dashboard.png --no-bench
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import RESULTS, free_port, gateway_cmd, pct, start, stop, write
from bench._verdicts import verdicts

ADMIN_KEY = "tl-bench-dashboard-admin"
CHROMIUM = os.environ.get("TIERLANE_CHROMIUM", "/usr/bin/chromium")
TENANTS = ["acme", "globex", "initech", "umbrella"]
APPS = ["web", "batch", "support"]
MODELS = ["gpt-4o", "gpt-4o-mini", "claude-sonnet", "llama-70b"]


def seed(state_dir: Path, rows: int, days: float, seed_value: int = 0) -> dict[str, Any]:
    """Write `rows` ledger rows through the real writer; returns timings and table sizes."""
    from tqdm import tqdm

    from telemetry.ledger import FILENAME, Ledger, LedgerRow

    rnd = random.Random(seed_value)
    now = time.time()
    start_ts = now - days * 86400
    ledger = Ledger(state_dir / FILENAME)
    ledger.start()
    began = time.perf_counter()
    # time-ordered, as metering writes them
    stamps = sorted(start_ts + rnd.random() * (now - start_ts) for _ in range(rows))
    with tqdm(total=rows, desc="ledger rows", unit="row", mininterval=1.0) as bar:
        for i, ts in enumerate(stamps):
            lane = rnd.choices(("upstream", "cache", "edge"), (0.55, 0.3, 0.15))[0]
            status = rnd.choices((200, 429, 500, 502), (0.965, 0.02, 0.01, 0.005))[0]
            tokens_in, tokens_out = rnd.randint(20, 2000), rnd.randint(5, 400)
            upstream_cost = (tokens_in * 2.5 + tokens_out * 10.0) / 1e6
            escalated = lane == "upstream" and rnd.random() < 0.08
            checked = lane == "edge" or escalated
            stream = rnd.random() < 0.4
            row = LedgerRow(
                request_id=f"req_{i:08d}", ts=ts, tenant=rnd.choice(TENANTS), app=rnd.choice(APPS),
                lane=lane, model="smollm2" if lane == "edge" else rnd.choice(MODELS), requested_model="auto",
                operation="chat", stream=stream, input_tokens=tokens_in, output_tokens=tokens_out,
                cached_input_tokens=0, estimated=False, trimmed_tokens=rnd.randint(0, 80) if lane == "upstream" else 0,
                cost=upstream_cost if lane == "upstream" and status == 200 else (upstream_cost / 50 if lane == "edge" else 0.0),
                saved_cache=upstream_cost if lane == "cache" and status == 200 else 0.0,
                saved_edge=upstream_cost * 0.98 if lane == "edge" and status == 200 else 0.0,
                saved_trim=rnd.random() * 1e-4 if lane == "upstream" else 0.0,
                status=status, complete=status == 200,
                error_code=None if status == 200 else ("rate_limit_exceeded" if status == 429 else "upstream_error"),
                latency_ms=rnd.lognormvariate(2.0 if lane == "cache" else 6.0, 0.7), ttft_ms=rnd.lognormvariate(5.0, 0.6) if stream else None,
                cache_status="hit" if lane == "cache" else rnd.choice(("miss", "bypass")), route_score=rnd.random(),
                route_reason=rnd.choice(("router", "router", "router", "explicit_model", "forced")),
                confidence=rnd.betavariate(5, 2) if checked else None, escalated=escalated,
                edge_tokens=tokens_in + tokens_out if checked else 0,
                escalation_reason=rnd.choice(("low_confidence", "low_confidence", "loop", "json_invalid")) if escalated else None,
                cache_similarity=0.9 + rnd.random() * 0.1 if lane == "cache" else None,
                trace_id=f"{rnd.getrandbits(128):032x}" if status != 200 else None,
            )  # fmt: skip
            ledger.append(row)
            if i % 20_000 == 19_999:
                ledger.flush(timeout=None)  # keep the queue (memory) bounded
                bar.update(20_000)
        ledger.flush(timeout=None)
        bar.update(rows - bar.n)
    ledger.close()
    seconds = time.perf_counter() - began
    sizes = {table: ledger.read(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"] for table in ("requests", "rollup_lane", "rollup", "rollup_hist")}
    return {"rows": rows, "days": days, "seed_s": round(seconds, 1), "rows_per_s": round(rows / seconds),
            "ledger_mb": round((state_dir / FILENAME).stat().st_size / 2**20, 1), "table_rows": sizes}  # fmt: skip


def start_gateway(state_dir: Path, tmp: Path, port: int, *, budgets: bool = True) -> Any:
    from gateway.auth import hash_key

    config = {
        "state_dir": str(state_dir),
        "edge": {"enabled": False},
        "embedder": {"enabled": False},
        "telemetry": {"tracing": False, "metrics": False},
        "auth": {"mode": "keys", "keys": [{"sha256": hash_key(ADMIN_KEY), "tenant": "ops", "admin": True}]},
        "upstreams": [{"name": "unused", "base_url": "http://127.0.0.1:9/v1"}],
        "policy": {
            "cache": {"enabled": False},
            "router": {"enabled": False},
            "trim": {"enabled": False},
            # limits for the budgets panel of the seeded ledger; none for someone else's state
            "budgets": {"enabled": True, "tenant": {"daily_spend_usd": 500.0, "monthly_spend_usd": 10000.0}} if budgets else {"enabled": False},
        },
    }
    cmd = gateway_cmd(config, tmp / "gateway.yaml", port)
    return start(cmd, f"http://127.0.0.1:{port}/healthz", tmp / "gateway.log", env={"HF_HUB_OFFLINE": "1"})


def get(url: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def time_views(base: str, repeat: int) -> dict[str, Any]:
    """Per view: HTML + JSON page load, and the server's query time, p50 and p95 over `repeat` loads."""
    views = {
        "default (last 7 days, UTC)": "",
        "30 days, UTC": "from={d30}&to={today}&tz=UTC",
        "30 days, Asia/Kolkata": "from={d30}&to={today}&tz=Asia/Kolkata",
        "1 day by hour, America/New_York": "from={d1}&to={d1}&tz=America/New_York",
        "30 days, one tenant": "from={d30}&to={today}&tenant=acme",
    }
    today = time.strftime("%Y-%m-%d", time.gmtime())
    d30 = time.strftime("%Y-%m-%d", time.gmtime(time.time() - 29 * 86400))
    d1 = time.strftime("%Y-%m-%d", time.gmtime(time.time() - 2 * 86400))
    out: dict[str, Any] = {}
    for name, template in views.items():
        query = template.format(today=today, d30=d30, d1=d1)
        loads, queries, json_ms = [], [], []
        status, _ = get(f"{base}/v1/dashboard?{query}")  # warm the page cache and the OS file cache
        assert status == 200, f"{name}: GET /v1/dashboard answered {status}"
        for _ in range(repeat):
            t0 = time.perf_counter()
            status, html = get(f"{base}/dashboard?{query}")
            t1 = time.perf_counter()
            status2, body = get(f"{base}/v1/dashboard?{query}")
            t2 = time.perf_counter()
            assert status == 200 and status2 == 200 and b"/v1/dashboard" in html
            loads.append((t2 - t0) * 1000)
            json_ms.append((t2 - t1) * 1000)
            queries.append(json.loads(body)["query_ms"])
        data = json.loads(body)
        out[name] = {
            "loads": repeat, "page_load_p50_ms": round(pct(loads, 0.5), 1), "page_load_p95_ms": round(pct(loads, 0.95), 1),
            "json_p50_ms": round(pct(json_ms, 0.5), 1),
            "query_p50_ms": round(pct(queries, 0.5), 1), "query_p95_ms": round(pct(queries, 0.95), 1),
            "requests_in_range": data["headline"]["requests"], "buckets": len(data["series"]["labels"]),
            "rollups": data["rollups"], "percentiles": data["headline"]["percentiles"], "json_kb": round(len(body) / 1024, 1),
        }  # fmt: skip
        print(f"  {name:<34} load p50 {out[name]['page_load_p50_ms']:>7} ms   query p50 {out[name]['query_p50_ms']:>7} ms   "
              f"({out[name]['requests_in_range']} requests)")  # fmt: skip
    return out


def raw_baseline(state_dir: Path, repeat: int = 1) -> dict[str, Any]:
    """The 30-day UTC report with the rollups ignored (raw rows over the ts index): what they save."""
    from telemetry import dashboard
    from telemetry.ledger import FILENAME, Ledger

    ledger = Ledger(state_dir / FILENAME)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    d30 = time.strftime("%Y-%m-%d", time.gmtime(time.time() - 29 * 86400))
    query = dashboard.DashboardQuery.parse({"from": d30, "to": today, "tz": "UTC"})
    current = dashboard.rollups_current
    try:
        dashboard.rollups_current = lambda conn: False  # type: ignore[assignment]
        times = [dashboard.read_report(ledger, query, budgets=None, now=time.time())["query_ms"] for _ in range(repeat)]
    finally:
        dashboard.rollups_current = current  # type: ignore[assignment]
    return {"view": "30 days, UTC", "query_p50_ms": round(pct(times, 0.5), 1), "runs": repeat}


def browser(base: str, repeat: int, screenshot: Path | None, query: str = "") -> dict[str, Any] | None:
    """Loads in headless chromium until the figures are drawn; a screenshot of the last one."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("playwright is not installed: no browser timing, no screenshot", file=sys.stderr)
        return None
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing (make install puts Debian's chromium there): no browser timing", file=sys.stderr)
        return None
    times = []
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = chromium.new_context(viewport={"width": 1400, "height": 1000}, extra_http_headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        page = context.new_page()
        for _ in range(repeat):
            t0 = time.perf_counter()
            page.goto(f"{base}/dashboard?{query}")
            page.wait_for_selector("body[data-state=ready]", timeout=60_000)
            times.append((time.perf_counter() - t0) * 1000)
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
            print(f"wrote {screenshot}")
        chromium.close()
    return {"loads": repeat, "until_drawn_p50_ms": round(pct(times, 0.5), 1), "until_drawn_p95_ms": round(pct(times, 0.95), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--repeat", type=int, default=30, help="page loads per view")
    parser.add_argument("--state-dir", type=Path, help="serve this state directory (its ledger) instead of seeding one")
    parser.add_argument("--screenshot", type=Path, nargs="?", const=RESULTS / "dashboard.png", help="write a screenshot (default bench/results/dashboard.png)")
    parser.add_argument("--view", default="", help="query string of the page the browser loads and screenshots")
    parser.add_argument("--no-bench", action="store_true", help="only the screenshot (with --screenshot)")
    parser.add_argument("--budgets", action="store_true", help="with --state-dir: serve it with the benchmark's budget limits too")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where dashboard.json goes")
    parser.add_argument("--keep", action="store_true", help="keep the seeded state directory")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tierlane-dashboard-"))
    state_dir = args.state_dir or tmp / "state"
    state_dir.mkdir(parents=True, exist_ok=True)
    seeded: dict[str, Any] = {}
    proc = None
    try:
        if args.state_dir is None:
            print(f"seeding {args.rows} ledger rows over {args.days} days in {state_dir} ...", flush=True)
            seeded = seed(state_dir, args.rows, args.days)
            print(f"  {seeded['seed_s']} s ({seeded['rows_per_s']} rows/s), {seeded['ledger_mb']} MB, tables {seeded['table_rows']}")
        port = free_port()
        proc = start_gateway(state_dir, tmp, port, budgets=args.state_dir is None or args.budgets)
        base = f"http://127.0.0.1:{port}"
        views = None if args.no_bench else time_views(base, args.repeat)
        baseline = None if args.no_bench else raw_baseline(state_dir)
        if baseline is not None:
            print(f"  without rollups (raw rows), 30 days UTC: query p50 {baseline['query_p50_ms']} ms")
        in_browser = browser(base, 1 if args.no_bench else 10, args.screenshot, args.view)
        if in_browser:
            print(f"  in chromium, until drawn: p50 {in_browser['until_drawn_p50_ms']} ms")
    finally:
        if proc is not None:
            stop(proc)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if views is None:
        return 0
    target = 300.0
    worst = max(v["page_load_p50_ms"] for v in views.values())
    result = {
        "what": "GET /dashboard + GET /v1/dashboard over a seeded ledger, sequential loads on loopback; query = the server's own time",
        "ledger": seeded or {"state_dir": str(args.state_dir)},
        "views": views,
        # flat copies, for the results page's table (docs/results/)
        "page_load_p50_ms": {name: v["page_load_p50_ms"] for name, v in views.items()},
        "query_p50_ms": {name: v["query_p50_ms"] for name, v in views.items()},
        "browser": in_browser,
        "without_rollups": baseline,
        "target_page_load_p50_ms": target,
        "worst_page_load_p50_ms": worst,
        "meets_target": worst <= target,
    }
    result["verdicts"] = verdicts("dashboard", result)
    if args.out == RESULTS:
        path = write("dashboard", result)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "dashboard.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}  (worst page-load p50 {worst} ms; target {target} ms)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
