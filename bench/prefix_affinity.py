"""Prefix and session affinity on a real fleet: three llama.cpp servers behind the gateway's pool.

    .venv/bin/python bench/prefix_affinity.py --llama-server bench/.peers/llama.cpp/build/bin/llama-server [--quick]

The fleet: three `llama-server` processes (SmolLM2-135M Q4_1, the GGUF's own template), each with
two slots of 4,096 tokens, its prompt cache on (slots reused by longest common prefix, plus
`--cache-ram` MiB of host memory for prompts moved out of a slot, a slot taken over only by a prompt
sharing 0.8 of it: see SERVER_ARGS) and `--metrics` (the gateway scrapes them); one server holds
about four conversations, not all twelve. The servers are started
afresh for every run, so each run starts cold.

The workload is agent-like: twelve sessions, each with a system prompt of a tool list shared by
half the sessions (about 900 tokens) and its own instructions (about 600), then turns that add the
model's answer, a tool result and a follow-up; session lengths are skewed (10 turns down to 3). The
sessions run interleaved, 4 and then 8 at a time, every request streamed, its session named in
`x-tierlane-session` as agents' own keys do. Compared, side by side in one run:
`least_outstanding` (the pool before) and `prefix_affinity` (the default), `--repeats` times each in
turn (2; each repeat on its own sessions, seed+r) with the figures pooled over the repeats (one run
has 12 first turns, too few for a p90, and least-outstanding's throughput moved from 0.33 to 0.47
req/s between two single runs), `round_robin` once, and at 4 in
flight also prefix affinity without session keys and two gateway replicas taking a session's
turns in turn (sharing the session placement table through Valkey, `state.backend: redis`). Reported per run: TTFT p50/p90 (to the first content), overall and apart for
sessions' first turns (a cold prompt wherever it lands) and their later turns (what affinity keeps
warm), requests per second, the
servers' own cached-prompt share (their `llamacpp:prompt_tokens_cached_total` against the tokens
they processed), requests per member (`x-tierlane-upstream`).

A no-shared-prefix workload (single-turn prompts of unique text) checks that affinity costs nothing
where there is nothing to reuse. Reconciliation: each run's billed cost (the gateway's ledger) is
compared with the cost of the servers' own token counters at the same prices; and, for cache
writes, a loopback server replaying Anthropic-shaped usage (cache reads, 5-minute and 1-hour
writes: Anthropic itself is out of reach here) is billed through the Messages API and compared with
the same prices applied to what it reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sqlite3
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import free_port, gateway_cmd, pct, start, stop, write
from bench._verdicts import verdicts

FLEET = 3
# NOTE: --slot-prompt-similarity 0.8 (the server's default is 0.1). llama-server hands a request the idle
# slot whose prompt shares the largest part of its own above that share, and keeps the part they share
# without saving the rest to --cache-ram when that part is at least half the slot's prompt: at 0.1 two
# sessions sharing their 880-token tool list took each other's slot, each turn dropped the other
# session's conversation and the next prefilled it again (measured: 600-1,000 tokens prefilled per
# later turn on a server holding three sessions, 0.66 cached share). A session's own slot shares 0.92
# or more of its next prompt here, another session's at most 0.65: above that, a turn takes its own
# slot or an idle one, whose prompt is saved to the host cache and its own conversation loaded back.
# The same flags for every balancer compared.
SERVER_ARGS = ["-c", "8192", "-np", "2", "-t", "1", "-fa", "on", "--metrics", "--cache-ram", "160",
               "--slot-prompt-similarity", "0.8", "-a", "smollm2"]
KV_CAPACITY_TOKENS = 12_288  # two slots of 4,096 tokens and ~160 MiB of host cache at ~23 KB a token
MODEL = "smollm2"
PRICE = {"input": 0.5, "cached_input": 0.05, "output": 1.5}  # USD per million tokens
ANSWER_TOKENS = 12
TURNS = [10, 8, 6, 5, 4, 4, 3, 3, 3, 3, 3, 3]  # skewed session lengths
WORDS = ("read write patch grep shell exec python file path line test build run diff commit branch config parse "
         "token cache model server request answer error retry timeout limit stream chunk json schema field value "
         "index query table column row key store load save open close list map filter sort merge split join").split()
POLICIES = ("least_outstanding", "round_robin", "prefix_affinity")
COMPARED = ("least_outstanding", "prefix_affinity")  # run `--repeats` times each, in turn, and pooled


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def session_plan(seed: int, turns: list[int]) -> list[dict[str, Any]]:
    """Each session's fixed text: its group's tool list, its own instructions, tool results and follow-ups."""
    rng = random.Random(seed)
    tools = [f"# Tools (set {g})\n" + "\n".join(f"- tool_{g}_{i}({words(rng, 4)}): {words(rng, 22)}" for i in range(24))
             for g in range(2)]
    plans = []
    for s, n in enumerate(turns):
        plans.append({
            "session": f"agent-{seed}-{s}",
            "system": tools[s % 2] + f"\n# Session {s}\n" + words(rng, 420),
            "task": f"Task {s}: " + words(rng, 40),
            "tool_results": [f"tool output {t}: " + words(rng, 90) for t in range(n)],
        })
    return plans


async def stream_turn(http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """One streamed request: time to the first content, the whole answer, the member, the status."""
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    async with http.post(url, json=body, headers=headers) as resp:
        member = resp.headers.get("x-tierlane-upstream", "?")
        if resp.status != 200:
            await resp.read()
            return {"status": resp.status, "member": member, "ttft_s": None, "seconds": time.perf_counter() - t0, "text": ""}
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    return {"status": 200, "member": member, "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
            "seconds": time.perf_counter() - t0, "text": "".join(text)}


async def run_sessions(urls: list[str], plans: list[dict[str, Any]], in_flight: int, with_session: bool,
                       bar: tqdm) -> dict[str, Any]:
    """Every session's turns, `in_flight` sessions at a time; turn t of a session goes to urls[t % len(urls)]."""
    gate = asyncio.Semaphore(in_flight)
    results: list[dict[str, Any]] = []

    async def session(plan: dict[str, Any]) -> None:
        async with gate:
            messages: list[dict[str, Any]] = [{"role": "system", "content": plan["system"]},
                                              {"role": "user", "content": plan["task"]}]
            headers = {"x-tierlane-session": plan["session"]} if with_session else {}
            for t, tool in enumerate(plan["tool_results"]):
                body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": ANSWER_TOKENS,
                        "temperature": 0, "stream_options": {"include_usage": True}}
                out = await stream_turn(http, urls[t % len(urls)] + "/v1/chat/completions", body, headers)
                out["turn"] = t
                results.append(out)
                bar.update(1)
                messages = [*messages, {"role": "assistant", "content": out["text"] or "ok"},
                            {"role": "user", "content": tool + "\nWhat next?"}]

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        started = time.perf_counter()
        await asyncio.gather(*(session(p) for p in plans))
        wall = time.perf_counter() - started
    return {"results": results, "wall_s": wall}


async def run_single(urls: list[str], prompts: list[str], in_flight: int, bar: tqdm) -> dict[str, Any]:
    gate = asyncio.Semaphore(in_flight)
    results: list[dict[str, Any]] = []

    async def one(i: int, prompt: str) -> None:
        async with gate:
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True,
                    "max_tokens": ANSWER_TOKENS, "temperature": 0}
            results.append(await stream_turn(http, urls[i % len(urls)] + "/v1/chat/completions", body, {}))
            bar.update(1)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        started = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - started
    return {"results": results, "wall_s": wall}


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^llamacpp:(\w+) ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


class Fleet:
    """Three fresh llama-server processes."""

    def __init__(self, binary: Path, tmp: Path, tag: str) -> None:
        from edge_engine import bundled_model_path

        self.ports = [free_port() for _ in range(FLEET)]
        self.procs = []
        try:
            for i, port in enumerate(self.ports):
                self.procs.append(start([str(binary), "-m", str(bundled_model_path()), "--host", "127.0.0.1", "--port",
                                         str(port), *SERVER_ARGS], f"http://127.0.0.1:{port}/health",
                                        tmp / f"llama-{tag}-{i}.log"))
        except BaseException:
            self.close()
            raise

    def counters(self) -> list[dict[str, float]]:
        return [scrape(port) for port in self.ports]

    def close(self) -> None:
        for proc in self.procs:
            stop(proc)


def gateway_config(fleet: Fleet, balance: str, state: Path, store_url: str | None = None) -> dict[str, Any]:
    """One replica's settings; `store_url`: the replicas share state (the session placement table) in Valkey."""
    shared = {"state": {"backend": "redis", "url": store_url, "op_timeout_ms": 500}} if store_url else {}
    return {**shared,
        "edge": {"enabled": False},
        "embedder": {"enabled": False},
        "telemetry": {"tracing": False, "metrics": False, "metering": True},
        "policy": {**{k: {"enabled": False} for k in ("cache", "router", "trim", "budgets", "cascade")},
                   "pricing": {"models": {MODEL: PRICE}}},
        "state_dir": str(state),
        "upstreams": [{"name": f"gpu{i}", "base_url": f"http://127.0.0.1:{port}/v1", "models": [MODEL],
                       "kv_capacity_tokens": KV_CAPACITY_TOKENS, "metrics_url": f"http://127.0.0.1:{port}/metrics",
                       "metrics_interval_s": 0.5, "read_timeout_s": 900, "total_timeout_s": 1800, "retries": 0}
                      for i, port in enumerate(fleet.ports)],
        "pools": {"default": {"balance": balance}},
    }


def ledger_cost(state: Path) -> dict[str, Any]:
    conn = sqlite3.connect(state / "ledger.sqlite3")
    try:
        n, cost, errors, inp, cached, out = conn.execute(
            "SELECT COUNT(*), SUM(cost), SUM(status >= 400), SUM(input_tokens), SUM(cached_input_tokens), "
            "SUM(output_tokens) FROM requests").fetchone()
    finally:
        conn.close()
    return {"requests": n, "cost_usd": cost or 0.0, "errors": errors or 0, "input_tokens": inp or 0,
            "cached_input_tokens": cached or 0, "output_tokens": out or 0}


def run_one(binary: Path, tmp: Path, name: str, balance: str, work: Any, *, replicas: int = 1) -> dict[str, Any]:
    """A fresh fleet and `replicas` fresh gateways; `work(urls)` drives them; the run's figures."""
    fleet = Fleet(binary, tmp, name)
    gateways, states = [], []
    store = None
    try:
        if replicas > 1:  # replicas share the session placement table, as a fleet with state.backend redis does
            from tests.support.valkey import ValkeyServer

            (tmp / f"valkey-{name}").mkdir()
            store = ValkeyServer(tmp / f"valkey-{name}")
        for r in range(replicas):
            port = free_port()
            state = tmp / f"state-{name}-{r}"
            config = gateway_config(fleet, balance, state, store.url if store is not None else None)
            gateways.append((start(gateway_cmd(config, tmp / f"gw-{name}-{r}.yaml", port),
                                   f"http://127.0.0.1:{port}/healthz", tmp / f"gw-{name}-{r}.log",
                                   env={"HF_HUB_OFFLINE": "1"}), port))
            states.append(state)
        time.sleep(1.5)  # the first metrics scrape
        before = fleet.counters()
        out = asyncio.run(work([f"http://127.0.0.1:{port}" for _, port in gateways]))
        after = fleet.counters()
    finally:
        for proc, _ in gateways:
            stop(proc)
        fleet.close()
        if store is not None:
            store.stop()
    return summarise(out, before, after, [ledger_cost(s) for s in states])


def summarise(out: dict[str, Any], before: list[dict[str, float]], after: list[dict[str, float]],
              ledgers: list[dict[str, Any]]) -> dict[str, Any]:
    results = out["results"]
    ok = [r for r in results if r["status"] == 200]
    ttft = [r["ttft_s"] * 1000 for r in ok]
    # a session's first turn (a cold prompt, wherever it goes) apart from its later turns (what affinity can keep
    # warm): single-turn workloads carry no turn, and count as neither
    first = [r["ttft_s"] * 1000 for r in ok if r.get("turn") == 0]
    later = [r["ttft_s"] * 1000 for r in ok if r.get("turn", 0) > 0]
    members = Counter(r["member"] for r in ok)
    delta = [{k: a.get(k, 0.0) - b.get(k, 0.0) for k in a} for a, b in zip(after, before, strict=True)]
    processed = sum(d.get("prompt_tokens_total", 0.0) for d in delta)
    cached = sum(d.get("prompt_tokens_cached_total", 0.0) for d in delta)
    predicted = sum(d.get("tokens_predicted_total", 0.0) for d in delta)
    reported_cost = (processed * PRICE["input"] + cached * PRICE["cached_input"] + predicted * PRICE["output"]) / 1e6
    billed = sum(led["cost_usd"] for led in ledgers)
    counts = [members.get(f"gpu{i}", 0) for i in range(FLEET)]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "samples": [[r.get("turn", -1), round(r["ttft_s"] * 1000, 1)] for r in ok],  # [turn, TTFT ms]: pooled over runs
        "wall_s": round(out["wall_s"], 2),
        "requests_per_s": round(len(ok) / out["wall_s"], 4),
        "ttft_p50_ms": round(pct(ttft, 0.5), 1),
        "ttft_p90_ms": round(pct(ttft, 0.9), 1),
        "ttft_mean_ms": round(statistics.fmean(ttft), 1) if ttft else None,
        "first_turns": len(first),
        "first_turns_ttft_p50_ms": round(pct(first, 0.5), 1) if first else None,
        "first_turns_ttft_p90_ms": round(pct(first, 0.9), 1) if first else None,
        "later_turns": len(later),
        "later_turns_ttft_p50_ms": round(pct(later, 0.5), 1) if later else None,
        "later_turns_ttft_p90_ms": round(pct(later, 0.9), 1) if later else None,
        "server_prompt_tokens": int(processed + cached),
        "server_cached_prompt_share": round(cached / (processed + cached), 4) if processed + cached else None,
        "requests_per_member": counts,
        "member_max_min_ratio": round(max(counts) / min(counts), 3) if min(counts) > 0 else None,
        "reconciliation": {
            "billed_usd": round(billed, 9), "from_server_counters_usd": round(reported_cost, 9),
            "relative_error": round(abs(billed - reported_cost) / reported_cost, 6) if reported_cost else None,
            "ledger_rows": sum(led["requests"] for led in ledgers), "ledger_errors": sum(led["errors"] for led in ledgers),
        },
    }


# -- cache writes: Anthropic-shaped usage replayed ---------------------------------------------
ANTHROPIC_PRICE = {"input": 3.0, "output": 15.0, "cached_input": 0.3}  # writes: the defaults, 1.25x and 2x input


def replay_app(reported: list[dict[str, int]], seed: int) -> web.Application:
    rng = random.Random(seed)

    async def messages(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        written_1h = rng.choice([0, 0, rng.randint(1, 3000)])
        usage = {"input_tokens": rng.randint(1, 400), "output_tokens": rng.randint(1, 300),
                 "cache_read_input_tokens": rng.choice([0, rng.randint(100, 60_000)]),
                 "cache_creation_input_tokens": 0, "cache_creation": {}}
        written_5m = rng.choice([0, rng.randint(1, 8000)])
        usage["cache_creation_input_tokens"] = written_5m + written_1h
        usage["cache_creation"] = {"ephemeral_5m_input_tokens": written_5m, "ephemeral_1h_input_tokens": written_1h}
        reported.append({k: v for k, v in usage.items() if isinstance(v, int)} | {"written_1h": written_1h})
        message = {"id": f"msg_{len(reported)}", "type": "message", "role": "assistant", "model": body["model"],
                   "content": [{"type": "text", "text": "done"}], "stop_reason": "end_turn", "stop_sequence": None,
                   "usage": usage}
        if not body.get("stream"):
            return web.json_response(message)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(data: dict[str, Any]) -> None:
            await resp.write(b"event: " + data["type"].encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n")

        await event({"type": "message_start", "message": {**message, "content": [], "stop_reason": None,
                                                          "usage": {**usage, "output_tokens": 1}}})
        await event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        await event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "done"}})
        await event({"type": "content_block_stop", "index": 0})
        await event({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                     "usage": {"output_tokens": usage["output_tokens"]}})
        await event({"type": "message_stop"})
        return resp

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    return app


def reconcile_cache_writes(tmp: Path, requests: int) -> dict[str, Any]:
    from tests.support.background import BackgroundLoop, RunningApp

    reported: list[dict[str, int]] = []
    bg = BackgroundLoop()
    up = RunningApp(bg, replay_app(reported, seed=7))
    port, state = free_port(), tmp / "state-writes"
    config = {"edge": {"enabled": False}, "embedder": {"enabled": False},
              "telemetry": {"tracing": False, "metrics": False, "metering": True},
              "policy": {**{k: {"enabled": False} for k in ("cache", "router", "trim", "budgets", "cascade")},
                         "pricing": {"models": {"claude-model": ANTHROPIC_PRICE}}},
              "state_dir": str(state),
              "upstreams": [{"name": "anthropic-replay", "base_url": up.url + "/v1", "models": ["claude-model"],
                             "apis": ["chat", "messages"]}]}
    gw = start(gateway_cmd(config, tmp / "gw-writes.yaml", port), f"http://127.0.0.1:{port}/healthz", tmp / "gw-writes.log",
               env={"HF_HUB_OFFLINE": "1"})
    statuses: Counter[int] = Counter()
    try:
        for i in tqdm(range(requests), desc="cache writes: Anthropic-shaped usage", unit="req"):
            body = {"model": "claude-model", "max_tokens": 64, "stream": i % 2 == 1,
                    "system": [{"type": "text", "text": "tools", "cache_control": {"type": "ephemeral"}}],
                    "messages": [{"role": "user", "content": f"turn {i}"}]}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/messages", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.read()
                statuses[resp.status] += 1
    finally:
        stop(gw)
        up.stop()
        bg.close()
    price = {k: v / 1e6 for k, v in ANTHROPIC_PRICE.items()}
    expected = sum(u["input_tokens"] * price["input"] + u["cache_read_input_tokens"] * price["cached_input"]
                   + (u["cache_creation_input_tokens"] - u["written_1h"]) * price["input"] * 1.25
                   + u["written_1h"] * price["input"] * 2 + u["output_tokens"] * price["output"] for u in reported)
    led = ledger_cost(state)
    conn = sqlite3.connect(state / "ledger.sqlite3")
    try:
        written = conn.execute("SELECT SUM(cache_write_tokens) FROM requests").fetchone()[0] or 0
    finally:
        conn.close()
    return {
        "requests": requests, "statuses": {str(k): v for k, v in statuses.items()}, "streamed_share": 0.5,
        "reported_cache_read_tokens": sum(u["cache_read_input_tokens"] for u in reported),
        "reported_cache_write_tokens": sum(u["cache_creation_input_tokens"] for u in reported),
        "ledger_cache_read_tokens": led["cached_input_tokens"], "ledger_cache_write_tokens": written,
        "billed_usd": round(led["cost_usd"], 9), "from_reported_usage_usd": round(expected, 9),
        "relative_error": round(abs(led["cost_usd"] - expected) / expected, 9) if expected else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", type=Path, required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--quick", action="store_true", help="six sessions, 4 in flight only (a smoke run)")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of least-outstanding and prefix affinity at each level, in turn, each on its own "
                             "sessions (seed, seed+1, ...), pooled: a run has only 12 first turns for a p90")
    args = parser.parse_args()
    turns = TURNS[:6] if args.quick else TURNS
    levels = (4,) if args.quick else (4, 8)
    plan_sets = [session_plan(args.seed + r, turns) for r in range(args.repeats)]
    plans = plan_sets[0]
    rng = random.Random(args.seed + 1)
    unique = [f"Question {i}: " + words(rng, 260) for i in range(16 if args.quick else 24)]
    runs: dict[str, Any] = {}
    total = sum(turns)
    steps = [(run_name(policy, n, r), policy, n, True, 1, r) for n in levels for r in range(args.repeats)
             for policy in (POLICIES if r == 0 else COMPARED)]
    steps += [(f"prefix_affinity_no_session@{levels[0]}", "prefix_affinity", levels[0], False, 1, 0),
              (f"prefix_affinity_two_replicas@{levels[0]}", "prefix_affinity", levels[0], True, 2, 0)]
    with tempfile.TemporaryDirectory(prefix="tierlane-affinity-") as tmp_name:
        tmp = Path(tmp_name)
        for name, policy, n, with_session, replicas, r in steps:
            with tqdm(total=total, desc=name, unit="req") as bar:
                runs[name] = run_one(args.llama_server, tmp, re.sub(r"\W", "-", name), policy,
                                     lambda urls, n=n, s=with_session, bar=bar, ps=plan_sets[r]:
                                     run_sessions(urls, ps, n, s, bar),
                                     replicas=replicas)
            r = runs[name]
            tqdm.write(f"{name}: ttft p50 {r['ttft_p50_ms']} ms p90 {r['ttft_p90_ms']} ms (first turns "
                       f"{r['first_turns_ttft_p50_ms']}/{r['first_turns_ttft_p90_ms']}, later turns "
                       f"{r['later_turns_ttft_p50_ms']}/{r['later_turns_ttft_p90_ms']}), {r['requests_per_s']} req/s, "
                       f"cached share {r['server_cached_prompt_share']}, per member {r['requests_per_member']}")
        no_shared: dict[str, Any] = {}
        for policy in ("least_outstanding", "prefix_affinity", "least_outstanding", "prefix_affinity"):
            with tqdm(total=len(unique), desc=f"no shared prefix: {policy}", unit="req") as bar:
                r = run_one(args.llama_server, tmp, f"unique-{policy}-{len(no_shared)}", policy,
                            lambda urls, bar=bar: run_single(urls, unique, 4, bar))
            no_shared.setdefault(policy, []).append(r)
        writes = reconcile_cache_writes(tmp, 40 if args.quick else 200)
    data = summarise_all(runs, no_shared, writes, levels, plans, len(unique), args.repeats)
    data["verdicts"] = verdicts("prefix_affinity", data)
    path = write("prefix_affinity", data)
    print(json.dumps({k: data[k] for k in ("comparison", "no_shared_prefix", "two_replicas")}, indent=2))
    print(f"wrote {path}")
    return 0


def run_name(policy: str, level: int, repeat: int) -> str:
    return f"{policy}@{level}" + (f"#{repeat + 1}" if repeat else "")


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's runs at one level as one sample: percentiles over every request, requests per second
    over the runs' summed wall time, the worst balance of any run."""
    samples = [s for r in runs for s in r["samples"]]
    ttft = [t for _, t in samples]
    first = [t for turn, t in samples if turn == 0]
    later = [t for turn, t in samples if turn > 0]
    ok = sum(r["requests"] - r["errors"] for r in runs)
    return {
        "runs": len(runs), "requests": sum(r["requests"] for r in runs), "errors": sum(r["errors"] for r in runs),
        "requests_per_s": round(ok / sum(r["wall_s"] for r in runs), 4),
        "ttft_p50_ms": round(pct(ttft, 0.5), 1), "ttft_p90_ms": round(pct(ttft, 0.9), 1),
        "first_turns": len(first), "first_turns_ttft_p50_ms": round(pct(first, 0.5), 1),
        "first_turns_ttft_p90_ms": round(pct(first, 0.9), 1),
        "later_turns": len(later), "later_turns_ttft_p50_ms": round(pct(later, 0.5), 1),
        "later_turns_ttft_p90_ms": round(pct(later, 0.9), 1),
        "server_cached_prompt_share": round(statistics.fmean(r["server_cached_prompt_share"] for r in runs), 4),
        # a run that left a member without a request has no ratio: then neither has the pool
        "member_max_min_ratio": (None if any(r["member_max_min_ratio"] is None for r in runs)
                                 else max(r["member_max_min_ratio"] for r in runs)),
    }


def summarise_all(runs: dict[str, Any], no_shared: dict[str, list[dict[str, Any]]], writes: dict[str, Any],
                  levels: tuple[int, ...], plans: list[dict[str, Any]], unique: int, repeats: int) -> dict[str, Any]:
    comparison, pooled_runs = {}, {}
    for n in levels:
        pooled_runs[str(n)] = {policy: pool_runs([runs[run_name(policy, n, r)] for r in range(repeats)])
                               for policy in COMPARED}
        base, pa = pooled_runs[str(n)]["least_outstanding"], pooled_runs[str(n)]["prefix_affinity"]
        rr = runs[f"round_robin@{n}"]
        comparison[str(n)] = {
            "runs_per_policy": repeats, "requests": pa["requests"], "first_turns": pa["first_turns"],
            "ttft_p90_ratio_vs_least_outstanding": round(pa["ttft_p90_ms"] / base["ttft_p90_ms"], 4),
            "ttft_p50_ratio_vs_least_outstanding": round(pa["ttft_p50_ms"] / base["ttft_p50_ms"], 4),
            "first_turns_ttft_p50_ratio_vs_least_outstanding": round(pa["first_turns_ttft_p50_ms"] / base["first_turns_ttft_p50_ms"], 4),
            "first_turns_ttft_p90_ratio_vs_least_outstanding": round(pa["first_turns_ttft_p90_ms"] / base["first_turns_ttft_p90_ms"], 4),
            "later_turns_ttft_p50_ratio_vs_least_outstanding": round(pa["later_turns_ttft_p50_ms"] / base["later_turns_ttft_p50_ms"], 4),
            "later_turns_ttft_p90_ratio_vs_least_outstanding": round(pa["later_turns_ttft_p90_ms"] / base["later_turns_ttft_p90_ms"], 4),
            "throughput_ratio_vs_least_outstanding": round(pa["requests_per_s"] / base["requests_per_s"], 4),
            "throughput_ratio_vs_round_robin": round(runs[f"prefix_affinity@{n}"]["requests_per_s"] / rr["requests_per_s"], 4),
            "member_max_min_ratio": pa["member_max_min_ratio"],
        }
    one, two = runs[f"prefix_affinity@{levels[0]}"], runs[f"prefix_affinity_two_replicas@{levels[0]}"]

    def pooled(policy: str, key: str) -> float:
        return statistics.median(r[key] for r in no_shared[policy])

    lo_p50, pa_p50 = pooled("least_outstanding", "ttft_p50_ms"), pooled("prefix_affinity", "ttft_p50_ms")
    recon = [r["reconciliation"]["relative_error"] for r in runs.values() if r["reconciliation"]["relative_error"] is not None]
    return {
        "what": "prefix and session affinity on three real llama.cpp servers: agent-like sessions, TTFT, throughput, "
                "the servers' cached-prompt share, balance, replicas, and billing against the servers' counters",
        "fleet": {"servers": FLEET, "server": "llama.cpp llama-server (SmolLM2-135M Q4_1)", "args": SERVER_ARGS,
                  "kv_capacity_tokens_configured": KV_CAPACITY_TOKENS},
        "workload": {"sessions": len(plans), "turns_per_session": [len(p["tool_results"]) for p in plans],
                     "requests": sum(len(p["tool_results"]) for p in plans), "answer_tokens": ANSWER_TOKENS,
                     "in_flight": list(levels), "shared_tool_lists": 2,
                     "runs_per_compared_policy": repeats, "session_sets": "seed, seed+1, ...: one per repeat",
                     "first_turn_prompt_tokens": "about 1,500 (900 shared by half the sessions)"},
        "runs": runs,
        "pooled": pooled_runs,
        "comparison": comparison,
        "two_replicas": {
            "cached_share_one": one["server_cached_prompt_share"], "cached_share_two": two["server_cached_prompt_share"],
            "ratio": round(two["server_cached_prompt_share"] / one["server_cached_prompt_share"], 4),
            "ttft_ms": {which: {f"{part}_p{q}": run[f"{part}_ttft_p{q}_ms"] for part in ("first_turns", "later_turns")
                                for q in (50, 90)} for which, run in (("one", one), ("two", two))},
            "how": "one session placement table for both replicas (state.backend redis, Valkey): a session's first "
                   "turn goes to the member holding most of its prompt's prefix weighed against load (nothing matched: "
                   "the least loaded; ties: the fewest live sessions), its later turns where it was "
                   "placed unless that member is over the load bound read from the servers' scraped load (then a "
                   "move, kept for both); one replica keeps the same table in its own process",
        },
        "no_shared_prefix": {
            "requests_per_run": unique, "in_flight": 4, "runs_per_policy": len(no_shared["least_outstanding"]),
            "ttft_p50_ms": {"least_outstanding": lo_p50, "prefix_affinity": pa_p50},
            "p50_ratio": round(pa_p50 / lo_p50, 4),
            "runs": no_shared,
        },
        "reconciliation": {
            "fleet_max_relative_error": max(recon) if recon else None, "fleet_runs": len(recon),
            "cache_writes": writes,
        },
    }


if __name__ == "__main__":
    raise SystemExit(main())
