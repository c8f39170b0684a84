"""The soak: an hour of mixed traffic at 65 % of the measured maximum, reported minute by minute.

A gateway process on its shipped defaults (keys mode with 20 tenants, budgets on five of them;
the edge lane off unless --edge, as every request names the upstream model) in front of a local upstream that
answers in 5-50 ms with 0.5 % 503s and 0.5 % cut connections (bench/soak_upstream.py). The mix:
unique, repeated and paraphrased chat questions, streams, Responses chains with `store`, Messages
with tools, session headers, 2 % clients that leave mid-stream and 1 % malformed bodies. Arrivals
are open-loop (a request is due every 1/rate s, its latency counted from when it was due).

First the maximum: the same mix closed-loop at 64 in flight for `--max-s` seconds on a fresh
gateway (skip with --rate). Then a fresh gateway (state and all) is hit at once at 65 % of it
for `--minutes`, and every minute records p50/p99, statuses, the gateway's RSS, its state
directory by part, and the event loop's stalls (from /metrics). At the end the gateway is
stopped (so the ledger is committed) and the ledger's per-tenant request totals are compared
with what each tenant sent.

To reach the configured bounds within an hour, the soak shortens two retention periods and says
so in the result: the ledger keeps raw rows `--ledger-retention-h` hours (rolled up after), and
stored responses expire after `--responses-ttl-s`. The cache's own bounds are the shipped ones.

Verdicts: p50 and p99 of the last 10 minutes within 1.2x of minutes 2-11; RSS and the state
directory flat over the last 20 minutes (growth <= 5 %); no 5xx, every request answered or refused
with an error body, the ledger exact per tenant.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/soak.py                  # an hour (plus the maximum)
    HF_HUB_OFFLINE=1 .venv/bin/python bench/soak.py --minutes 3 --rate 100 --out soak_smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sqlite3
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import free_port, gateway_cmd, pct, start, stop, write
from bench._verdicts import verdicts
from gateway.auth import hash_key

TENANTS = [f"t{i:02d}" for i in range(20)]
BUDGETED = TENANTS[:5]
MODEL = "soak-model"
KINDS = {  # kind -> share of requests
    "chat_unique": 0.20, "chat_repeat": 0.18, "chat_paraphrase": 0.10, "chat_stream": 0.14, "responses_chain": 0.10,
    "messages_tools": 0.10, "chat_session": 0.15, "disconnect": 0.02, "malformed": 0.01,
}
TOPICS = ["boil water", "reset a router", "bake bread", "learn Python", "plant tomatoes", "fix a flat tyre",
          "write a cover letter", "train for a 5k", "brew coffee", "clean a cast iron pan", "save for a house",
          "tie a bowline", "care for a cactus", "sleep better", "paint a wall", "change a lightbulb", "store onions",
          "start a compost heap", "learn chess openings", "negotiate a salary"]
REPEATS = [f"How do I {topic}?" for topic in TOPICS] + [f"What is the best way to {t}?" for t in TOPICS]
PARAPHRASES = ["Could you tell me how to {t}?", "What are the steps to {t}?", "Explain how one would {t}.",
               "I want to {t}. How?", "Any tips on how to {t}?"]
TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
STALLS = re.compile(r"^tierlane_event_loop_stalls_total (\S+)$", re.M)


def key_of(tenant: str) -> str:
    return f"sk-soak-{tenant}"


def config(work: Path, up_port: int, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "auth": {"mode": "keys", "keys": [{"sha256": hash_key(key_of(t)), "tenant": t, "app": "soak"} for t in TENANTS]},
        "state_dir": str(work / "state"),
        "edge": {"enabled": bool(getattr(args, "edge", False))},
        "upstreams": [{"name": "soak", "base_url": f"http://127.0.0.1:{up_port}/v1", "models": [MODEL]}],
        "telemetry": {"ledger_retention_hours": args.ledger_retention_h, "metrics_auth": "none"},  # the stall counter
        "responses": {"ttl_s": args.responses_ttl_s},
        "policy": {"budgets": {"overrides": [{"match": {"tenant": t}, "set": {"tenant": {"requests_per_minute": args.budget_rpm}}}
                                             for t in BUDGETED]}},
    }


@dataclass
class Tally:
    """What the clients saw: per minute latencies and statuses, per tenant what they sent."""

    started: float
    latencies: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    sent: Counter[str] = field(default_factory=Counter)  # tenant -> requests that reached the gateway's pipeline
    unclear: list[str] = field(default_factory=list)  # answers that were neither a success nor a clear error
    outstanding: int = 0
    overflow: int = 0  # requests never sent: too many in flight at the client

    def record(self, due: float, kind: str, status: str, latency: float | None) -> None:
        minute = int((due - self.started) // 60)
        self.statuses[minute][status] += 1
        if latency is not None and kind not in ("disconnect", "malformed"):
            self.latencies[minute].append(latency)


class Mix:
    """The requests, drawn from a seeded generator."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.kinds, self.weights = zip(*KINDS.items(), strict=True)
        self.chains: dict[str, tuple[str, int]] = {}  # tenant -> (last response id, chain length)
        self.serial = 0

    def draw(self) -> tuple[str, str]:
        return self.rng.choices(self.kinds, self.weights)[0], self.rng.choice(TENANTS)

    def question(self, kind: str) -> str:
        rng = self.rng
        if kind == "chat_repeat":
            return rng.choice(REPEATS)
        if kind == "chat_paraphrase":
            return rng.choice(PARAPHRASES).format(t=rng.choice(TOPICS))
        self.serial += 1
        return f"Question {self.serial}: how do I {rng.choice(TOPICS)} when it is {rng.randint(1, 10**6)} degrees?"


async def one(session: aiohttp.ClientSession, url: str, mix: Mix, tally: Tally, due: float) -> None:
    kind, tenant = mix.draw()
    headers = {"Authorization": f"Bearer {key_of(tenant)}"}
    question = mix.question(kind)
    stream = kind in ("chat_stream", "disconnect")
    path, body = "/v1/chat/completions", {"model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": question}]}
    if stream:
        body["stream"] = True
    if kind == "chat_session":
        headers["x-tierlane-session"] = f"{tenant}-s{mix.rng.randrange(50)}"
    elif kind == "responses_chain":
        path, body = "/v1/responses", {"model": MODEL, "input": question, "max_output_tokens": 32}
        chain = mix.chains.get(tenant)
        if chain is not None and chain[1] < 5 and mix.rng.random() < 0.7:
            body["previous_response_id"] = chain[0]
    elif kind == "messages_tools":
        path = "/v1/messages"
        headers = {"x-api-key": key_of(tenant), "anthropic-version": "2023-06-01"}
        body = {"model": MODEL, "max_tokens": 32, "tools": TOOLS, "messages": [{"role": "user", "content": question}]}
    data = b'{"model": "soak-model", "messages": [' if kind == "malformed" else json.dumps(body).encode()
    tally.outstanding += 1
    status = "transport_error"
    try:
        async with session.post(url + path, data=data, headers={**headers, "Content-Type": "application/json"}) as resp:
            status = str(resp.status)
            if kind == "disconnect":
                await resp.content.readline()  # the first event, then the client leaves
                status = "left"
                resp.close()
            else:
                payload = await resp.read()
                if resp.status >= 400:
                    error = json.loads(payload) if payload[:1] == b"{" else None
                    if not (isinstance(error, dict) and isinstance(error.get("error"), dict) and error["error"].get("message")):
                        tally.unclear.append(f"{kind} {resp.status} {payload[:120]!r}")
                elif kind == "responses_chain":
                    made = json.loads(payload)
                    length = (mix.chains.get(tenant, ("", 0))[1] + 1) if "previous_response_id" in body else 1
                    mix.chains[tenant] = (made["id"], length)
                elif stream and b"[DONE]" not in payload:
                    status = "stream_error"  # ended with an error event (the upstream cut it): a clear error
    except (TimeoutError, aiohttp.ClientError) as exc:
        tally.unclear.append(f"{kind} {type(exc).__name__}")
    finally:
        tally.outstanding -= 1
    if kind != "malformed":  # refused at the door before the pipeline: not metered
        tally.sent[tenant] += 1
    tally.record(due, kind, status, time.perf_counter() - due)


async def drive(url: str, rate: float, seconds: float, seed: int, *, max_outstanding: int = 2000,
                on_minute: Any = None, closed_loop: int = 0, tally: Tally | None = None) -> Tally:
    """Open-loop arrivals at `rate` for `seconds` (or, with `closed_loop`, that many in flight);
    `on_minute(m)` is called as minute m (from 0) ends, while `tally` fills."""
    mix = Mix(seed)
    connector = aiohttp.TCPConnector(limit=max_outstanding, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tally = tally or Tally(started=time.perf_counter())
        tally.started = time.perf_counter()
        end = tally.started + seconds
        if closed_loop:
            async def worker() -> None:
                while time.perf_counter() < end:
                    await one(session, url, mix, tally, time.perf_counter())

            await asyncio.gather(*(worker() for _ in range(closed_loop)))
            return tally
        tasks: set[asyncio.Task[None]] = set()
        minute, i = 0, 0
        bar = tqdm(total=int(rate * seconds), desc="soak", unit="req", mininterval=5)
        while True:
            due = tally.started + i / rate
            if due >= end:
                break
            now = time.perf_counter()
            if due > now:
                await asyncio.sleep(due - now)
            if int((due - tally.started) // 60) > minute:
                minute = int((due - tally.started) // 60)
                if on_minute is not None:
                    asyncio.ensure_future(on_minute(minute - 1))
            if tally.outstanding >= max_outstanding:
                tally.overflow += 1
            else:
                task = asyncio.ensure_future(one(session, url, mix, tally, due))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            i += 1
            bar.update(1)
        bar.close()
        if tasks:
            await asyncio.wait(tasks)
        if on_minute is not None:
            await on_minute(minute)
        return tally


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def dir_mb(path: Path) -> dict[str, float]:
    parts: dict[str, float] = defaultdict(float)
    for file in path.rglob("*"):
        if file.is_file():
            rel = file.relative_to(path).parts
            parts[rel[0] if len(rel) > 1 else file.name.split(".")[0]] += file.stat().st_size / 2**20
    return {k: round(v, 2) for k, v in sorted(parts.items())}


def stalls(url: str) -> float | None:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            found = STALLS.search(r.read().decode())
    except OSError:
        return None
    return float(found.group(1)) if found else None


def ledger_totals(path: Path) -> dict[str, int]:
    """Requests per tenant, rolled up and raw alike (what /v1/usage totals)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        through = conn.execute("SELECT value FROM ledger_meta WHERE key = 'rollup_through'").fetchone()[0]
        rolled = dict(conn.execute("SELECT tenant, SUM(requests) FROM rollup_lane WHERE level = 86400 GROUP BY tenant"))
        raw = dict(conn.execute("SELECT tenant, COUNT(*) FROM requests WHERE operation != 'judge' AND id > ? GROUP BY tenant",
                                (through,)))
    finally:
        conn.close()
    return {t: int(rolled.get(t, 0)) + int(raw.get(t, 0)) for t in set(rolled) | set(raw)}


def gateway(work: Path, args: argparse.Namespace) -> tuple[Any, Any, str]:
    up_port, gw_port = free_port(), free_port()
    upstream = start([sys.executable, str(Path(__file__).with_name("soak_upstream.py")), "--port", str(up_port)],
                     f"http://127.0.0.1:{up_port}/v1/models", work / "upstream.log")
    proc = start(gateway_cmd(config(work, up_port, args), work / "gateway.yaml", gw_port),
                 f"http://127.0.0.1:{gw_port}/readyz", work / "gateway.log", env={"HF_HUB_OFFLINE": "1"})
    return upstream, proc, f"http://127.0.0.1:{gw_port}"


def maximum(args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        upstream, proc, url = gateway(Path(tmp), args)
        try:
            tally = asyncio.run(drive(url, 0, args.max_s, args.seed + 1, closed_loop=64))
        finally:
            stop(proc)
            stop(upstream)
    done = sum(sum(c.values()) for c in tally.statuses.values())
    return done / args.max_s


def soak(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        upstream, proc, url = gateway(work, args)
        minutes: list[dict[str, Any]] = []
        tally = Tally(started=time.perf_counter())
        last_stalls = [stalls(url) or 0.0]

        async def on_minute(minute: int) -> None:
            lat = [x * 1000 for x in tally.latencies.get(minute, [])]
            now_stalls = await asyncio.to_thread(stalls, url)
            row = {"minute": minute + 1, "n": sum(tally.statuses[minute].values()), "p50_ms": round(pct(lat, 0.5), 1),
                   "p99_ms": round(pct(lat, 0.99), 1), "statuses": dict(tally.statuses[minute]),
                   "rss_mb": rss_mb(proc.pid), "state_mb": await asyncio.to_thread(dir_mb, work / "state"),
                   "loop_stalls": None if now_stalls is None else now_stalls - last_stalls[0]}
            last_stalls[0] = now_stalls if now_stalls is not None else last_stalls[0]
            minutes.append(row)
            tqdm.write(f"minute {row['minute']:>3}: n {row['n']:>6}  p50 {row['p50_ms']:>7} ms  p99 {row['p99_ms']:>8} ms  "
                       f"rss {row['rss_mb']:>7} MB  state {sum(row['state_mb'].values()):>8.1f} MB  stalls {row['loop_stalls']}")

        try:
            asyncio.run(drive(url, rate, args.minutes * 60, args.seed, on_minute=on_minute, tally=tally))
        finally:
            proc.send_signal(signal.SIGTERM)  # a clean stop commits the ledger
            try:
                proc.wait(60)
            except Exception:  # noqa: BLE001 - stop() below kills it
                pass
            stop(proc)
            stop(upstream)
        totals = ledger_totals(work / "state" / "ledger.sqlite3")
    minutes.sort(key=lambda r: r["minute"])
    return {"tally": tally, "minutes": minutes, "ledger": totals}


def window(minutes: list[dict[str, Any]], first: int, last: int, key: str) -> float | None:
    rows = [m[key] for m in minutes if first <= m["minute"] <= last and m[key] == m[key]]
    return round(pct(rows, 0.5), 1) if rows else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=int, default=60)
    parser.add_argument("--rate", type=float, default=None, help="requests/s (default: 0.65 x the measured maximum)")
    parser.add_argument("--share", type=float, default=0.65)
    parser.add_argument("--max-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--budget-rpm", type=int, default=600, help="requests/min of each of the five budgeted tenants")
    parser.add_argument("--ledger-retention-h", type=float, default=0.25)
    parser.add_argument("--responses-ttl-s", type=float, default=600.0)
    parser.add_argument("--out", default="soak")
    parser.add_argument("--edge", action="store_true", help="start the edge engine too (no request names it)")
    parser.add_argument("--max-rps", type=float, default=None, help="a maximum measured before (skips measuring it)")
    args = parser.parse_args()
    measured = None
    if args.rate is None:
        measured = args.max_rps or maximum(args)
        print(f"maximum: {measured:.1f} requests/s (64 in flight, {args.max_s:g} s)")
    rate = args.rate if args.rate is not None else round(args.share * (measured or 0), 1)
    result = soak(args, rate)
    tally, minutes, ledger = result["tally"], result["minutes"], result["ledger"]
    statuses: Counter[str] = Counter()
    for c in tally.statuses.values():
        statuses.update(c)
    five_xx = sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500)
    mismatched = {t: {"sent": tally.sent[t], "ledger": ledger.get(t, 0)} for t in TENANTS if tally.sent[t] != ledger.get(t, 0)}
    last = max((m["minute"] for m in minutes), default=0)
    base = (2, min(11, max(2, last - 10)))
    tail = (max(base[1] + 1, last - 9), last)
    flat_from = max(1, last - 19)

    def growth(key: str) -> float | None:
        rows = [m for m in minutes if m["minute"] >= flat_from]
        if len(rows) < 2:
            return None
        value = (lambda m: sum(m[key].values())) if key == "state_mb" else (lambda m: m[key])
        return round(value(rows[-1]) / max(1e-9, value(rows[0])), 4)

    figures = {
        "rate_rps": rate, "measured_max_rps": measured, "minutes": args.minutes, "mix": KINDS,
        "settings": {"tenants": len(TENANTS), "budgeted_tenants": len(BUDGETED), "budget_rpm": args.budget_rpm,
                     "ledger_retention_hours": args.ledger_retention_h, "responses_ttl_s": args.responses_ttl_s,
                     "edge": "off (every request names the upstream model)",
                     "upstream": "5-50 ms, 0.5 % 503, 0.5 % cut connections"},
        "requests": sum(statuses.values()), "statuses": dict(statuses), "responses_5xx": five_xx,
        "unclear": len(tally.unclear), "unclear_examples": tally.unclear[:10], "client_overflow": tally.overflow,
        "ledger_mismatched_tenants": mismatched, "ledger_requests": sum(ledger.values()), "sent_metered": sum(tally.sent.values()),
        "baseline_minutes": list(base), "tail_minutes": list(tail),
        "p50_ms": {"baseline": window(minutes, *base, "p50_ms"), "tail": window(minutes, *tail, "p50_ms")},
        "p99_ms": {"baseline": window(minutes, *base, "p99_ms"), "tail": window(minutes, *tail, "p99_ms")},
        "rss_growth_last_20_min": growth("rss_mb"), "state_growth_last_20_min": growth("state_mb"),
        "per_minute": minutes,
    }
    for key in ("p50_ms", "p99_ms"):
        b, t = figures[key]["baseline"], figures[key]["tail"]
        figures[key]["ratio"] = round(t / b, 3) if b and t else None
    data = {"what": "bench/soak.py", **figures}
    data["verdicts"] = verdicts("soak", data)
    path = write(args.out, data)
    print(json.dumps({k: v for k, v in data.items() if k not in ("per_minute", "verdicts")}, indent=1))
    for v in data["verdicts"]:
        print(f"{'met' if v['met'] else 'NOT MET' if v['met'] is False else 'n/a':>8}  {v['figure']}: {v['value']} ({v['target']})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
