"""Batch when idle, interactive first when busy: priority classes, flow control and the Batch API on a real fleet.

    .venv/bin/python bench/scheduling.py --llama-server bench/.peers/llama.cpp/build/bin/llama-server
    .venv/bin/python bench/scheduling.py --simulate     # only the GPU-fleet simulation, into the same file

The fleet is bench/prefix_affinity.py's: three `llama-server` processes (SmolLM2-135M, two slots
each, its SERVER_ARGS), started afresh for every run. Interactive sessions (three streamed turns
each, half a second apart, a session key each) arrive as a Poisson process at a rate that keeps
the fleet about 30 % busy (30 % of the requests a second the fleet answered with every slot busy,
in the batch-alone run: on two shared cores a lone request's time says little of capacity); a batch job of
`--lines` small lines (a short unique question each, `max_tokens` 16) is submitted at the start.
Side by side, each on a fresh fleet and gateway, the same arrivals and the same lines:

- `batch_alone`: the job through the Batch API on an idle fleet (the 1.25x reference);
- `interactive_alone`: the sessions only;
- `naive`: the sessions, and the job's lines sent at once as ordinary chat requests (what a user
  does today; the pool as before flow control: no member budgets, every request goes to its
  server at once and waits in llama-server's own FIFO queue);
- `batch_api`: the sessions, and the job through the Batch API with flow control (each member's
  budget its two slots, `upstreams[].max_concurrency`; the shipped `pools.default.flow` settings;
  `batches.concurrency` 64 so the runner keeps lines waiting at the members for idle slots).

Utilisation is the servers' own: busy slot-seconds (the growth of llama.cpp's
`llamacpp:prompt_seconds_total` and `tokens_predicted_seconds_total`, which each slot adds its time
to) over slot-seconds (6 slots times the window), read from `/metrics` every second; the window is
the batch's (its start to its last line) where there is one, else the arrivals' span. The mean of
`llamacpp:requests_processing` sampled over the same window is reported beside it. Interactive TTFT
is the client's, to the first content of a streamed turn, for the turns that arrived while the batch
had work (all of them when alone). Money per line is the ledger's cost of the job's lines (batch
priority pays `pricing.batch_discount` off) over the lines.

The simulation (bench/scheduling_sim.py) is the same scheduler, the gateway's own flow-control
classes, in front of 24 simulated GPU members whose decode step costs little more for 32 requests
than for one; its predictions go into the same file under `simulation`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sqlite3
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import RESULTS, free_port, gateway_cmd, pct, start, stop, write
from bench._verdicts import verdicts
from bench.prefix_affinity import FLEET, MODEL, PRICE, SERVER_ARGS, WORDS, Fleet, gateway_config, stream_turn
from bench.scheduling_sim import simulate

SLOTS = FLEET * int(SERVER_ARGS[SERVER_ARGS.index("-np") + 1])
MAX_TOKENS = 16
TURNS = 3
THINK_S = 0.5
TARGET_BUSY = 0.3
BATCH_CONCURRENCY = 64
SAMPLE_S = 1.0
BUSY_COUNTERS = ("prompt_seconds_total", "tokens_predicted_seconds_total")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the workload -------------------------------------------------------------------------------
def batch_lines(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
                 {"role": "user", "content": f"Item {i}: in a few words, what do '{rng.choice(WORDS)} {rng.choice(WORDS)}' "
                                             f"and '{rng.choice(WORDS)}' have in common?"}]}}
            for i in range(n)]  # fmt: skip


def session_plan(seed: int, rate: float, duration_s: float) -> list[tuple[float, str, list[str]]]:
    """(start, session key, its turns' questions) of each session arriving in `duration_s` at `rate` per second."""
    rng = random.Random(seed)
    out: list[tuple[float, str, list[str]]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        topic = " ".join(rng.choice(WORDS) for _ in range(40))
        turns = [f"About {topic}: question {k}, what is a {rng.choice(WORDS)}?" for k in range(TURNS)]
        out.append((t, f"person-{seed}-{len(out)}", turns))


# -- the fleet's own counters ---------------------------------------------------------------------
class Sampler:
    """Every server's busy counters and processing gauge, read from /metrics each SAMPLE_S."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.samples: list[tuple[float, float, float]] = []  # (monotonic, busy slot-seconds so far, slots processing)
        self._task: asyncio.Task[None] | None = None

    async def read(self, http: aiohttp.ClientSession) -> tuple[float, float, float]:
        busy = processing = 0.0
        for port in self.ports:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
            for line in text.splitlines():
                m = re.match(r"^llamacpp:(\w+) ([0-9.eE+-]+)$", line)
                if m and m.group(1) in BUSY_COUNTERS:
                    busy += float(m.group(2))
                elif m and m.group(1) == "requests_processing":
                    processing += float(m.group(2))
        return time.monotonic(), busy, processing

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            while True:
                self.samples.append(await self.read(http))
                await asyncio.sleep(SAMPLE_S)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            self.samples.append(await self.read(http))  # the counters once every request has ended

    def utilisation(self, start: float, end: float) -> dict[str, Any]:
        """Busy slot-seconds over slot-seconds between the samples around [start, end], and the sampled gauge's mean."""
        before = [s for s in self.samples if s[0] <= start] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= end] or self.samples[-1:]
        a, b = before[-1], after[0]
        seconds = b[0] - a[0]
        inside = [s[2] for s in self.samples if start <= s[0] <= end]
        return {"utilisation": round((b[1] - a[1]) / (SLOTS * seconds), 4) if seconds > 0 else None,
                "window_s": round(seconds, 2),
                "busy_slot_s": round(b[1] - a[1], 2),
                "processing_sampled_mean": round(sum(inside) / (SLOTS * len(inside)), 4) if inside else None,
                "samples": len(inside)}  # fmt: skip


# -- clients ------------------------------------------------------------------------------------------
async def person(
    http: aiohttp.ClientSession, url: str, t0: float, plan: tuple[float, str, list[str]], out: list[dict[str, Any]]
) -> None:
    at, key, turns = plan
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    messages: list[dict[str, Any]] = []
    for k, question in enumerate(turns):
        messages = [*messages, {"role": "user", "content": question}]
        body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0}
        arrived = time.monotonic()
        r = await stream_turn(http, url + "/v1/chat/completions", body, {"x-tierlane-session": key})
        out.append({"arrived": arrived - t0, "turn": k, "status": r["status"], "ttft_s": r["ttft_s"], "seconds": r["seconds"]})
        messages = [*messages, {"role": "assistant", "content": r["text"] or "ok"}]
        await asyncio.sleep(THINK_S)


async def submit_batch(http: aiohttp.ClientSession, url: str, lines: list[dict[str, Any]]) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field(
        "file",
        b"".join(json.dumps(line).encode() + b"\n" for line in lines),
        filename="lines.jsonl",
        content_type="application/jsonl",
    )
    async with http.post(url + "/v1/files", data=form) as resp:
        uploaded = await resp.json()
        assert resp.status == 200, uploaded
    async with http.post(
        url + "/v1/batches",
        json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ) as resp:
        job = await resp.json()
        assert resp.status == 200, job
    return str(job["id"])


async def wait_batch(http: aiohttp.ClientSession, url: str, job_id: str, t0: float, tag: str) -> dict[str, Any]:
    """Poll the job until it ends; its output checked line by line (each custom_id once, none missing)."""
    last_log = 0.0
    while True:
        async with http.get(f"{url}/v1/batches/{job_id}") as resp:
            job = await resp.json()
        counts = job.get("request_counts") or {}
        now = time.monotonic()
        if job["status"] in ("completed", "failed", "expired", "cancelled"):
            break
        if now - last_log >= 10:
            last_log = now
            log(
                f"{tag}: batch {counts.get('completed', 0) + counts.get('failed', 0)}/{counts.get('total')} lines at "
                f"{now - t0:.0f} s"
            )
        await asyncio.sleep(0.25)
    done_at = time.monotonic() - t0
    ids: list[str] = []
    for key in ("output_file_id", "error_file_id"):
        if job.get(key):
            async with http.get(f"{url}/v1/files/{job[key]}/content") as resp:
                ids += [json.loads(line)["custom_id"] for line in (await resp.text()).splitlines() if line.strip()]
    return {
        "status": job["status"],
        "completion_s": round(done_at, 2),
        "completed": counts.get("completed"),
        "failed": counts.get("failed"),
        "output_lines": len(ids),
        "distinct_custom_ids": len(set(ids)),
    }


async def naive_lines(http: aiohttp.ClientSession, url: str, lines: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """Every line at once as an ordinary request (a 429 or 503 is asked again after its Retry-After, as the SDKs do)."""
    statuses: list[int] = []
    retries = 0

    async def one(line: dict[str, Any]) -> None:
        nonlocal retries
        while True:
            async with http.post(
                url + "/v1/chat/completions", json=line["body"], headers={"x-request-id": f"naive-{line['custom_id']}"}
            ) as resp:
                await resp.read()
                if resp.status in (429, 503):
                    retries += 1
                    await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                    continue
                statuses.append(resp.status)
                return

    await asyncio.gather(*(one(line) for line in lines))
    return {
        "status": "completed",
        "completion_s": round(time.monotonic() - t0, 2),
        "completed": statuses.count(200),
        "failed": len(statuses) - statuses.count(200),
        "retried_429_503": retries,
    }


def ledger(state: Path) -> dict[str, dict[str, Any]]:
    """The ledger's rows by kind: batch lines, naive lines, interactive turns."""
    conn = sqlite3.connect(state / "ledger.sqlite3")
    try:
        rows = conn.execute("SELECT request_id, cost, status FROM requests").fetchall()
    finally:
        conn.close()
    out: dict[str, dict[str, Any]] = {}
    for request_id, cost, status in rows:
        kind = "batch" if request_id.startswith("batch_req_") else "naive" if request_id.startswith("naive-") else "interactive"
        k = out.setdefault(kind, {"rows": 0, "cost_usd": 0.0, "errors": 0})
        k["rows"] += 1
        k["cost_usd"] += cost or 0.0
        k["errors"] += int(status >= 400)
    return out


# -- one run ------------------------------------------------------------------------------------------
def config_for(fleet: Fleet, state: Path, budgets: bool) -> dict[str, Any]:
    config = gateway_config(fleet, "prefix_affinity", state)
    config["batches"] = {"concurrency": BATCH_CONCURRENCY}
    for upstream in config["upstreams"]:
        if budgets:
            upstream["max_concurrency"] = SLOTS // FLEET
    config["pools"]["default"]["flow"] = {} if budgets else {"from_metrics": False}
    return config


def run(
    binary: Path,
    tmp: Path,
    name: str,
    *,
    budgets: bool,
    work: Callable[[str, aiohttp.ClientSession, float], Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    """A fresh fleet and gateway; `work(url, http, t0)` drives them and says its window; the run's figures."""
    log(f"{name}: starting the fleet and the gateway")
    fleet = Fleet(binary, tmp, name)
    state = tmp / f"state-{name}"
    port = free_port()
    gw = None
    try:
        gw = start(
            gateway_cmd(config_for(fleet, state, budgets), tmp / f"gw-{name}.yaml", port),
            f"http://127.0.0.1:{port}/healthz",
            tmp / f"gw-{name}.log",
            env={"HF_HUB_OFFLINE": "1"},
        )
        time.sleep(1.5)  # the first metrics scrape

        async def go() -> dict[str, Any]:
            sampler = Sampler(fleet.ports)
            sampler.start()
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as http:
                t0 = time.monotonic()
                out = await work(f"http://127.0.0.1:{port}", http, t0)
            await sampler.stop()
            out["fleet"] = sampler.utilisation(t0 + out.pop("window")[0], t0 + out["window_end"])
            return out

        out = asyncio.run(go())
    finally:
        if gw is not None:
            stop(gw)
        fleet.close()
    out["ledger"] = ledger(state)
    return out


def ttft_figures(turns: list[dict[str, Any]], until: float | None) -> dict[str, Any]:
    ok = [t for t in turns if t["status"] == 200]
    inside = [t["ttft_s"] * 1000 for t in ok if until is None or t["arrived"] < until]
    return {"turns": len(turns), "errors": len(turns) - len(ok), "measured": len(inside),
            "ttft_p50_ms": round(pct(inside, 0.5), 1) if inside else None,
            "ttft_p99_ms": round(pct(inside, 0.99), 1) if inside else None,
            "ttft_max_ms": round(max(inside), 1) if inside else None}  # fmt: skip


def measure(binary: Path, tmp: Path, lines: int, seed: int, duration: float | None) -> dict[str, Any]:
    work_lines = batch_lines(lines, seed)

    async def batch_only(url: str, http: aiohttp.ClientSession, t0: float) -> dict[str, Any]:
        job = await submit_batch(http, url, work_lines)
        batch = await wait_batch(http, url, job, t0, "batch_alone")
        return {"batch": batch, "window": (0.0,), "window_end": batch["completion_s"]}

    alone = run(binary, tmp, "batch_alone", budgets=True, work=batch_only)
    log(f"batch_alone: {alone['batch']} utilisation {alone['fleet']['utilisation']}")

    # the fleet's capacity in small requests a second, all slots busy (what the job alone got): the sessions' turns
    # come at TARGET_BUSY of it
    capacity = lines / alone["batch"]["completion_s"]
    rate = TARGET_BUSY * capacity / TURNS  # sessions per second
    span = duration if duration is not None else min(180.0, max(60.0, 1.5 * alone["batch"]["completion_s"]))
    plan = session_plan(seed, rate, span)
    log(f"capacity {capacity:.2f} requests/s: {rate:.3f} sessions/s over {span:.0f} s ({len(plan)} sessions)")

    def with_people(
        extra: Callable[[str, aiohttp.ClientSession, float], Awaitable[dict[str, Any]]] | None, tag: str
    ) -> Callable[[str, aiohttp.ClientSession, float], Awaitable[dict[str, Any]]]:
        async def work(url: str, http: aiohttp.ClientSession, t0: float) -> dict[str, Any]:
            turns: list[dict[str, Any]] = []
            people = [asyncio.ensure_future(person(http, url, t0, p, turns)) for p in plan]
            batch = await extra(url, http, t0) if extra is not None else None
            await asyncio.gather(*people)
            log(f"{tag}: {len(turns)} interactive turns done at {time.monotonic() - t0:.0f} s")
            end = batch["completion_s"] if batch is not None else span
            return {"batch": batch, "turns": turns, "window": (0.0,), "window_end": end}

        return work

    async def through_api(url: str, http: aiohttp.ClientSession, t0: float) -> dict[str, Any]:
        return await wait_batch(http, url, await submit_batch(http, url, work_lines), t0, "batch_api")

    async def at_once(url: str, http: aiohttp.ClientSession, t0: float) -> dict[str, Any]:
        return await naive_lines(http, url, work_lines, t0)

    runs = {"batch_alone": alone}
    for name, budgets, extra in (("interactive_alone", True, None), ("naive", False, at_once), ("batch_api", True, through_api)):
        r = run(binary, tmp, name, budgets=budgets, work=with_people(extra, name))
        turns = r.pop("turns")
        r["interactive"] = ttft_figures(turns, r["batch"]["completion_s"] if r["batch"] else None)
        r["interactive_all_turns"] = ttft_figures(turns, None)
        runs[name] = r
        log(f"{name}: fleet {r['fleet']} interactive {r['interactive']} batch {r['batch']}")
    return summarise(runs, lines, rate, span, len(plan), capacity)


def summarise(runs: dict[str, Any], lines: int, rate: float, span: float, sessions: int, capacity: float) -> dict[str, Any]:
    alone, people, naive, api = (runs[k] for k in ("batch_alone", "interactive_alone", "naive", "batch_api"))

    def per_line(r: dict[str, Any], kind: str) -> float | None:
        k = r["ledger"].get(kind)
        return round(k["cost_usd"] / lines, 9) if k else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    api_batch, naive_batch = api["batch"], naive["batch"]
    return {
        "workload": {"fleet": f"{FLEET} llama-server ({MODEL}), {SLOTS} slots", "server_args": SERVER_ARGS, "lines": lines,
                     "max_tokens": MAX_TOKENS, "sessions": sessions, "turns_per_session": TURNS, "think_s": THINK_S,
                     "session_rate_per_s": round(rate, 4), "arrivals_span_s": round(span, 1),
                     "fleet_capacity_requests_per_s": round(capacity, 3), "target_busy": TARGET_BUSY,
                     "batches_concurrency": BATCH_CONCURRENCY, "member_budget": SLOTS // FLEET,
                     "prices_usd_per_mtok": PRICE},
        "runs": runs,
        "comparison": {
            "utilisation_interactive_alone": people["fleet"]["utilisation"],
            "utilisation_while_batch_has_work": api["fleet"]["utilisation"],
            "utilisation_naive": naive["fleet"]["utilisation"],
            "utilisation_batch_alone": alone["fleet"]["utilisation"],
            "ttft_p50_ms": {k: runs[k]["interactive"]["ttft_p50_ms"] for k in ("interactive_alone", "naive", "batch_api")},
            "ttft_p99_ms": {k: runs[k]["interactive"]["ttft_p99_ms"] for k in ("interactive_alone", "naive", "batch_api")},
            "ttft_p99_ratio_vs_alone": ratio(api["interactive"]["ttft_p99_ms"], people["interactive"]["ttft_p99_ms"]),
            "ttft_p99_ratio_vs_naive": ratio(api["interactive"]["ttft_p99_ms"], naive["interactive"]["ttft_p99_ms"]),
            "batch_completion_s": {"batch_alone": alone["batch"]["completion_s"], "naive": naive_batch["completion_s"],
                                   "batch_api": api_batch["completion_s"]},
            "batch_lines_per_s": {k: round(lines / runs[k]["batch"]["completion_s"], 3) for k in ("batch_alone", "naive", "batch_api")},
            "batch_completion_ratio_vs_alone": ratio(api_batch["completion_s"], alone["batch"]["completion_s"]),
            "money_per_line_usd": {"batch_alone": per_line(alone, "batch"), "naive": per_line(naive, "naive"),
                                   "batch_api": per_line(api, "batch")},
            "lines_lost_or_doubled": (lines - api_batch["distinct_custom_ids"]) + (api_batch["output_lines"] - api_batch["distinct_custom_ids"]),
            "lines_failed": api_batch["failed"],
        },
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary")
    parser.add_argument("--lines", type=int, default=600, help="the batch job's lines (at least 500 for the figures)")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--duration", type=float, help="seconds of interactive arrivals (default: 1.6x the batch alone)")
    parser.add_argument("--simulate", action="store_true", help="only the GPU-fleet simulation, kept with the measured runs")
    args = parser.parse_args()
    path = RESULTS / "scheduling.json"
    if args.simulate:
        data = json.loads(path.read_text()) if path.exists() else {}
        for key in ("generated_at", "machine", "verdicts"):
            data.pop(key, None)
    else:
        if args.llama_server is None:
            parser.error("--llama-server is needed for the measured runs (or --simulate)")
        with tempfile.TemporaryDirectory(prefix="tierlane-scheduling-") as tmp:
            data = measure(args.llama_server, Path(tmp), args.lines, args.seed, args.duration)
    started = time.perf_counter()
    data["simulation"] = simulate(progress=log)
    data["simulation"]["wall_s"] = round(time.perf_counter() - started, 1)
    data["what"] = (
        "priority classes, flow control and the Batch API on three llama.cpp servers: interactive alone, "
        "the batch's lines sent at once, the Batch API; and a simulated GPU fleet from the same scheduler"
    )
    data["verdicts"] = verdicts("scheduling", data)
    log(f"wrote {write('scheduling', data)}")
    for v in data["verdicts"]:
        log(f"  {v['figure']}: {v['value']} (target {v['target']}): {v['met']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
