"""Edge engine vs two baselines, side by side: sequential llama_cpp.Llama and a naive locked server.

Writes bench/results/edge_engine.json. Same model (the bundled SmolLM2-135M-Instruct Q4_1),
same threads (n_threads=2), greedy sampling, fixed max_tokens, prompts of varied length.
Three worker processes hold one model each, so their peak memory is measured apart:

* engine:     EdgeEngine(EdgeSettings(n_ctx=2048, n_threads=2)), requests submitted in-process
* sequential: one llama_cpp.Llama, create_chat_completion one request after another
* naive:      an aiohttp server, one asyncio.Lock around create_chat_completion(stream=True) run
              in a thread executor; this process sends it streaming requests over loopback

Measured, for two workloads (everyday: one-line questions, decode-dominated like the calibration
figures; essay: 40-400-token prompts, prefill-heavy): aggregate completion tokens/s at 1, 4, 8,
16 concurrent requests and TTFT at 8 concurrent streams (engine vs naive); TTFT of short requests while a 1,500-token prompt is prefilled vs
alone (engine); peak resident memory per process and KV cells per active sequence. Each
concurrency level runs the three systems back to back (order rotated per level) so drift on a
shared machine hits all of them; the load average and the CPU share taken by other processes
are recorded per run. llama.cpp's own server joins as a fourth system with --llama-server PATH
(bench/build_llama_server.sh builds it from the llama.cpp that llama-cpp-python vendors).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import free_port, pct, write
from bench._verdicts import verdicts
from edge_engine.settings import EdgeSettings as EdgeSettingsDefaults

N_THREADS = 2
N_CTX = 2048
MAX_TOKENS = 64
LEVELS = (1, 4, 8, 16)
REQUESTS = {1: 3, 4: 8, 8: 16, 16: 16}  # per system and level (~6 min on a quiet 2-core machine)

TOPICS = [
    "the history of the printing press", "how volcanoes form", "the water cycle", "the life of honeybees",
    "how compilers turn source code into machine code", "the causes of the French Revolution",
    "photosynthesis in plants", "the design of suspension bridges", "how vaccines train the immune system",
    "the rules and strategy of chess", "the migration of monarch butterflies", "how the internet routes packets",
    "the formation of the Moon", "the economics of coffee farming", "how lithium batteries store energy",
    "the architecture of Gothic cathedrals", "plate tectonics and earthquakes", "the invention of the telephone",
    "how glaciers shape valleys", "the role of mitochondria in cells", "the Silk Road trade routes",
    "how airplanes stay in the air", "the life cycle of stars", "the origins of the Olympic Games",
    "how bread rises", "the history of the bicycle", "coral reefs and their ecosystems",
    "how refrigerators keep food cold", "the Roman aqueducts", "how tides work", "the discovery of penicillin",
    "how rainbows form", "the invention of paper money", "the behaviour of octopuses", "how solar panels work",
    "the history of the Great Wall of China", "how the human heart pumps blood", "the spread of the potato",
    "how lighthouses guided ships", "the ecology of deserts",
]
NOTES = [
    "The team met on Monday to review the quarterly figures and agreed to revisit the budget in June.",
    "Several readers asked for more examples, so each section now ends with a short worked case.",
    "The archive holds letters, maps and ledgers from three centuries, most of them still uncatalogued.",
    "Field measurements were taken at dawn, when the wind was weakest and the water was calm.",
    "A later survey found that the original estimate had been too low by roughly a fifth.",
    "The committee preferred plain language, short paragraphs and a clear summary at the top.",
    "Local guides say the trail is easiest in early autumn, after the rains and before the frost.",
    "Costs rose steadily during the decade, driven mostly by labour, transport and insurance.",
    "The prototype worked in the lab but failed twice in the field because of moisture.",
    "Historians still disagree about the date, though most accept a window of about ten years.",
    "Students in the pilot class wrote one page a week and discussed it in small groups.",
    "The bridge was closed for repairs in spring and reopened with a new pedestrian lane.",
    "Most of the samples were stored at four degrees and analysed within two days of collection.",
    "The new schedule adds an evening service on weekdays and removes the early Sunday run.",
    "In the second edition the author corrected several figures and added a chapter on sources.",
    "Interviews with farmers showed that weather, prices and credit mattered more than technology.",
]


def chat(i: int) -> list[dict[str, str]]:
    """Request i: an essay prompt with 0 to 15 note sentences before it (~40 to ~400 tokens)."""
    n_notes = (i * 7) % 16
    notes = " ".join(NOTES[(i + k) % len(NOTES)] for k in range(n_notes))
    topic = TOPICS[i % len(TOPICS)]
    head = f"Request {i}. "
    body = f"Background notes: {notes}\n\n" if notes else ""
    return [{"role": "user", "content": f"{head}{body}Write a detailed, multi-paragraph essay about {topic}."}]


def everyday_chat(i: int) -> list[dict[str, str]]:
    """Request i: a one-line everyday question (~15-25 tokens after the shared system prompt)."""
    topic = TOPICS[(i * 3) % len(TOPICS)]
    return [{"role": "user", "content": f"Request {i}. Explain {topic} in a short paragraph."}]


WORKLOADS = {
    # What the router sends to the edge lane, and the shape of the calibration
    # (sequential ~78 tok/s, decode-dominated): short questions, 64 completion tokens.
    "everyday": everyday_chat,
    # Prefill-heavy: prompt tokens outnumber completion tokens, so prompt ingestion (~230
    # tokens/s on 2 threads with this Q4_1 model) sets the pace for every system.
    "essay": chat,
}


def short_chat(i: int) -> list[dict[str, str]]:
    topic = TOPICS[(i * 11) % len(TOPICS)]
    return [{"role": "user", "content": f"Question {i}: in one sentence, what is {topic}?"}]


def long_chat(round_: int, target_tokens: int, count: Any) -> list[dict[str, str]]:
    """A prompt of about `target_tokens` tokens (as the engine counts them, chat template included)."""
    sentences: list[str] = [f"Document {round_} of the archive, read carefully before answering."]
    k = round_ * 5
    while True:
        msgs = [{"role": "user", "content": " ".join(sentences) + "\n\nSummarise these notes in three sentences."}]
        if count(msgs) >= target_tokens:
            return msgs
        sentences.append(f"Note {len(sentences)}: " + NOTES[k % len(NOTES)] + " " + TOPICS[k % len(TOPICS)].capitalize() + ".")
        k += 1


def memory_kb() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(line.split()[1])
    return out


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---- worker: the edge engine, in-process submissions --------------------------------------


async def engine_worker(args: argparse.Namespace) -> None:
    from edge_engine import EdgeEngine, EdgeSettings, SamplingParams

    settings = EdgeSettings(n_ctx=N_CTX, n_threads=N_THREADS, prefill_step_ms=args.prefill_step_ms, decode_gap_ms=args.decode_gap_ms)
    engine = EdgeEngine(settings)
    await engine.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def request(msgs: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        gen = await engine.submit(messages=msgs, params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
        ttft = None
        last = None
        async for ev in gen:
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = ev
        assert last is not None and ttft is not None
        return {"submitted_at": t0, "ttft_s": ttft, "latency_s": time.perf_counter() - t0,
                "completion_tokens": last.completion_tokens, "prompt_tokens": last.prompt_tokens,
                "cached_tokens": last.cached_tokens}

    async def batch(cmd: dict[str, Any]) -> dict[str, Any]:
        todo = iter(cmd["prompts"])
        results: list[dict[str, Any]] = []
        samples: list[dict[str, int]] = []
        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                s = engine.stats()
                samples.append({k: s[k] for k in ("active_sequences", "kv_cells_used", "kv_cells_reserved", "prefix_entries", "queue_depth")})
                await asyncio.sleep(0.05)

        async def worker() -> None:
            for msgs in todo:
                results.append(await request(msgs, cmd["max_tokens"]))
                emit({"progress": 1})

        watch = asyncio.create_task(sampler())
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(cmd["concurrency"])))
        wall = time.perf_counter() - t0
        stop.set()
        await watch
        return {"wall_s": wall, "requests": results, "kv_samples": samples}

    async def interference(cmd: dict[str, Any]) -> dict[str, Any]:
        alone = []
        for i in cmd["alone"]:
            alone.append(await request(short_chat(i), cmd["short_max_tokens"]))
            emit({"progress": 1})
            await asyncio.sleep(cmd["gap_s"])
        during: list[dict[str, Any]] = []
        longs = []
        next_short = iter(cmd["during"])
        for r in range(cmd["rounds"]):
            msgs = await asyncio.to_thread(long_chat, r + 1, cmd["long_tokens"], lambda m: len(engine.tokenize_request(messages=m)))
            long_task = asyncio.create_task(request(msgs, cmd["long_max_tokens"]))
            t_long = time.perf_counter()
            await asyncio.sleep(cmd["gap_s"])
            shorts = []
            while not long_task.done():
                shorts.append(await request(short_chat(next(next_short)), cmd["short_max_tokens"]))
                emit({"progress": 1})
                await asyncio.sleep(cmd["gap_s"])
            long = long_task.result()
            first_long = long["submitted_at"] + long["ttft_s"]
            for s in shorts:
                s["during_prefill"] = s["submitted_at"] < first_long
            during += shorts
            longs.append({"prompt_tokens": long["prompt_tokens"], "ttft_s": long["ttft_s"], "submitted_after_s": t_long - long["submitted_at"],
                          "shorts_during_prefill": sum(s["during_prefill"] for s in shorts)})
        return {"alone": alone, "during": during, "longs": longs}

    emit({"ready": True, "pid": os.getpid(), "settings": {"n_ctx": settings.n_ctx, "n_threads": settings.n_threads, "slots": settings.slots,
          "prefix_slots": settings.prefix_slots, "prefill_chunk": settings.prefill_chunk, "n_batch": settings.n_batch,
          "batch_invariant": settings.batch_invariant, "prefix_reuse": settings.prefix_reuse, "mix_prefill": settings.mix_prefill,
          "extra_buffers": settings.extra_buffers, "flash_attn": settings.flash_attn, "kv_cache_type": settings.kv_cache_type,
          "prefill_step_ms": settings.prefill_step_ms,
          "decode_gap_ms": settings.decode_gap_ms, "prompt_tokens_per_step": engine.stats()["prompt_tokens_per_step"]}})
    while line := await reader.readline():
        cmd = json.loads(line)
        if cmd["op"] == "batch":
            emit({"result": await batch(cmd)})
        elif cmd["op"] == "interference":
            emit({"result": await interference(cmd)})
        elif cmd["op"] == "status":
            emit({"result": {**memory_kb(), "stats": engine.stats()}})
        elif cmd["op"] == "quit":
            break
    await engine.close()


# ---- workers: llama_cpp.Llama, sequential in-process and behind a naive server -------------


def model_path() -> Path:
    from edge_engine import bundled_model_path

    return bundled_model_path()


def load_llama() -> Any:
    import llama_cpp

    from edge_engine import bundled_model_path

    # NOTE: Llama() has no use_extra_bufts parameter in llama-cpp-python 0.3.36 (extra kwargs are
    # ignored); the portable AVX2 build in the venv does not need it.
    # flash attention: the faster of llama-cpp-python's two attention paths here (bench/edge_decode.py:
    # 70.2 vs 67.8 tok/s one request after another), so the baselines are the best a lock can do.
    return llama_cpp.Llama(str(bundled_model_path()), n_ctx=N_CTX, n_batch=512, n_threads=N_THREADS,
                           n_threads_batch=N_THREADS, flash_attn=True, verbose=False)


def sequential_worker() -> None:
    llm = load_llama()
    emit({"ready": True, "pid": os.getpid()})
    while line := sys.stdin.readline():
        cmd = json.loads(line)
        if cmd["op"] == "batch":
            results = []
            t0 = time.perf_counter()
            for msgs in cmd["prompts"]:
                t = time.perf_counter()
                out = llm.create_chat_completion(messages=msgs, max_tokens=cmd["max_tokens"], temperature=0.0)
                results.append({"latency_s": time.perf_counter() - t, "completion_tokens": out["usage"]["completion_tokens"],
                                "prompt_tokens": out["usage"]["prompt_tokens"]})
                emit({"progress": 1})
            emit({"result": {"wall_s": time.perf_counter() - t0, "requests": results}})
        elif cmd["op"] == "status":
            emit({"result": memory_kb()})
        elif cmd["op"] == "quit":
            break


def naive_server(port: int) -> None:
    from aiohttp import web

    llm = load_llama()
    lock = asyncio.Lock()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def run() -> None:
            n = 0
            try:
                for chunk in llm.create_chat_completion(messages=body["messages"], max_tokens=body["max_tokens"],
                                                        temperature=0.0, stream=True):
                    if chunk["choices"][0]["delta"].get("content"):
                        n += 1
                    loop.call_soon_threadsafe(queue.put_nowait, chunk)
            finally:
                # NOTE: llama-cpp-python streams no usage; one content chunk per sampled token
                loop.call_soon_threadsafe(queue.put_nowait, {"usage": {"completion_tokens": n}})
                loop.call_soon_threadsafe(queue.put_nowait, None)

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async with lock:
            job = loop.run_in_executor(None, run)
            while (item := await queue.get()) is not None:
                await resp.write(b"data: " + json.dumps(item).encode() + b"\n\n")
            await job
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def status(_: web.Request) -> web.Response:
        return web.json_response(memory_kb())

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/status", status)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---- the driver ------------------------------------------------------------------------------


class Worker:
    """A child process speaking JSON lines on stdin/stdout; progress lines tick the bar."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.info: dict[str, Any] = {}

    @classmethod
    async def spawn(cls, role: str, log: Path, extra: list[str] | None = None) -> Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--worker", role, *(extra or []), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=open(log, "wb"), limit=1 << 24,
        )
        self = cls(proc)
        self.info = await self._read()
        return self

    async def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.pid} exited with {await self.proc.wait()} (see its log)")
        return json.loads(line)

    async def call(self, cmd: dict[str, Any], bar: Any = None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        while True:
            msg = await self._read()
            if "progress" in msg:
                if bar is not None:
                    bar.update(msg["progress"])
            else:
                return msg["result"]

    async def quit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b'{"op": "quit"}\n')
        await self.proc.stdin.drain()
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()


async def naive_batch(url: str, prompts: list[list[dict[str, str]]], concurrency: int, max_tokens: int, bar: Any) -> dict[str, Any]:
    import aiohttp

    todo = iter(prompts)
    results: list[dict[str, Any]] = []

    async def one(session: aiohttp.ClientSession, msgs: list[dict[str, str]]) -> dict[str, Any]:
        t0 = time.perf_counter()
        ttft = None
        tokens = 0
        body = {"messages": msgs, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                "stream_options": {"include_usage": True}}
        async with session.post(url, json=body) as resp:
            resp.raise_for_status()
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                item = json.loads(line[6:])
                if item.get("usage"):
                    tokens = item["usage"]["completion_tokens"]
                choices = item.get("choices") or []
                if ttft is None and choices and (choices[0].get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - t0
        return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "completion_tokens": tokens}

    async def worker(session: aiohttp.ClientSession) -> None:
        for msgs in todo:
            results.append(await one(session, msgs))
            bar.update(1)

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "requests": results}


class CpuWatch:
    """Share of the machine's CPU time taken by processes other than this benchmark's, over a span."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.hz = os.sysconf("SC_CLK_TCK")

    def _read(self) -> tuple[float, int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # less idle and iowait
        ours = 0
        for pid in self.pids:
            try:
                parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ours += int(parts[11]) + int(parts[12])  # utime, stime of all its threads
            except FileNotFoundError:
                pass
        return time.perf_counter(), busy, ours

    def start(self) -> None:
        self._t0 = self._read()

    def stop(self) -> dict[str, float]:
        t1, busy1, ours1 = self._read()
        t0, busy0, ours0 = self._t0
        capacity = (t1 - t0) * self.hz * (os.cpu_count() or 1)
        return {"foreign_cpu_share": round(max(0, (busy1 - busy0) - (ours1 - ours0)) / capacity, 3),
                "own_cpu_share": round((ours1 - ours0) / capacity, 3), "loadavg_1m": round(os.getloadavg()[0], 2)}


def throughput(run: dict[str, Any]) -> dict[str, Any]:
    reqs = run["requests"]
    tokens = sum(r["completion_tokens"] for r in reqs)
    out: dict[str, Any] = {"tokens_per_s": round(tokens / run["wall_s"], 1), "completion_tokens": tokens, "requests": len(reqs),
                           "wall_s": round(run["wall_s"], 2), "latency_p50_s": round(pct([r["latency_s"] for r in reqs], 0.5), 3)}
    ttft = [r["ttft_s"] for r in reqs if r.get("ttft_s") is not None]
    if ttft:
        out["ttft_p50_ms"] = round(pct(ttft, 0.5) * 1000, 1)
        out["ttft_p99_ms"] = round(pct(ttft, 0.99) * 1000, 1)
    return out


def kv_summary(samples: list[dict[str, int]], n_ctx_total: int, n_seq_max: int) -> dict[str, Any]:
    busy = [s for s in samples if s["active_sequences"]]
    if not busy:
        return {}
    per_active = [s["kv_cells_used"] / s["active_sequences"] for s in busy]
    return {
        "peak_active_sequences": max(s["active_sequences"] for s in busy),
        "peak_kv_cells_used": max(s["kv_cells_used"] for s in busy),
        "kv_cells_used_per_active_seq_median": round(statistics.median(per_active), 1),
        "kv_cells_used_per_active_seq_max": round(max(per_active), 1),
        "kv_cells_reserved_per_active_seq_median": round(statistics.median(s["kv_cells_reserved"] / s["active_sequences"] for s in busy), 1),
        "kv_cells_allocated_per_seq": n_ctx_total // n_seq_max,
        "samples": len(busy),
        "note": "kv_cells_used counts active sequences' own cells plus prefix entries' cells; with batch_invariant "
                "every sequence id owns a KV stream of n_ctx cells whatever it uses",
    }


async def drive(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    tmp = Path(tempfile.mkdtemp(prefix="tierlane-edge-bench-"))
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    port = free_port()
    naive = await asyncio.create_subprocess_exec(sys.executable, __file__, "--naive-server", "--port", str(port),
                                                 stdout=open(tmp / "naive.log", "wb"), stderr=asyncio.subprocess.STDOUT)
    knobs = ["--prefill-step-ms", str(args.prefill_step_ms), "--decode-gap-ms", str(args.decode_gap_ms)]
    engine = await Worker.spawn("engine", tmp / "engine.log", knobs)
    seq = await Worker.spawn("sequential", tmp / "sequential.log")
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    status_url = f"http://127.0.0.1:{port}/status"
    import aiohttp

    for _ in range(600):
        try:
            async with aiohttp.ClientSession() as s, s.get(status_url) as r:
                if r.status == 200:
                    break
        except aiohttp.ClientError:
            await asyncio.sleep(0.2)
    server = None
    server_url = None
    if args.llama_server:
        # llama.cpp's own server: same model, same threads, one slot per concurrent request at the
        # largest level, each slot with the engine's per-sequence context.
        sport = free_port()
        slots = max(args.levels)
        server = await asyncio.create_subprocess_exec(
            args.llama_server, "-m", str(model_path()), "--host", "127.0.0.1", "--port", str(sport),
            "-t", str(N_THREADS), "-tb", str(N_THREADS), "--parallel", str(slots), "-c", str(N_CTX * slots),
            "--no-webui", stdout=open(tmp / "llama_server.log", "wb"), stderr=asyncio.subprocess.STDOUT)
        server_url = f"http://127.0.0.1:{sport}/v1/chat/completions"
        for _ in range(600):
            try:
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{sport}/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    watch = CpuWatch([os.getpid(), engine.proc.pid, seq.proc.pid, naive.pid] + ([server.pid] if server else []))
    levels = [c for c in args.levels]
    reqs = {c: c * max(1, round(REQUESTS.get(c, 2 * c) * args.scale / c)) for c in levels}
    n_sys = 4 if args.llama_server else 3
    total = n_sys * (1 + len(args.workloads) * sum(reqs.values())) + args.alone + args.long_rounds * 12
    results: dict[str, Any] = {"workloads": {}}
    try:
        with tqdm(total=total, desc="edge bench", unit="req") as bar:
            warm = [chat(999)]
            await engine.call({"op": "batch", "prompts": warm, "concurrency": 1, "max_tokens": 8}, bar)
            await seq.call({"op": "batch", "prompts": warm, "concurrency": 1, "max_tokens": 8}, bar)
            await naive_batch(url, warm, 1, 8, bar)
            systems = ["engine", "sequential", "naive"]
            if server_url:
                await naive_batch(server_url, warm, 1, 8, bar)
                systems.append("llama_server")
            offset = 0
            turn = 0
            for workload in args.workloads:
                make = WORKLOADS[workload]
                by_level: dict[str, Any] = results["workloads"].setdefault(workload, {})
                for c in levels:
                    if time.perf_counter() - t_start > args.budget_s:
                        results.setdefault("skipped_levels", []).append(f"{workload}@{c}")  # out of time: machine too slow now
                        bar.update(n_sys * reqs[c])
                        continue
                    # NOTE: a level runs in rounds of c requests; each round gives every system the same
                    # prompts, in a rotated order, so a burst of foreign load hits all three alike.
                    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
                    for _ in range(max(1, reqs[c] // c)):
                        prompts = [make(offset + i) for i in range(c)]
                        offset += c
                        for name in systems[turn % len(systems):] + systems[: turn % len(systems)]:
                            bar.set_description(f"{workload} c={c} {name}")
                            watch.start()
                            cmd = {"op": "batch", "prompts": prompts, "concurrency": c, "max_tokens": args.max_tokens}
                            if name == "engine":
                                run = await engine.call(cmd, bar)
                            elif name == "sequential":
                                run = await seq.call(cmd, bar)
                            elif name == "naive":
                                run = await naive_batch(url, prompts, c, args.max_tokens, bar)
                            else:
                                run = await naive_batch(server_url, prompts, c, args.max_tokens, bar)
                            run["cpu"] = watch.stop()
                            runs[name].append(run)
                        turn += 1
                    level: dict[str, Any] = {}
                    for name, parts in runs.items():
                        merged = {"wall_s": sum(r["wall_s"] for r in parts), "requests": [q for r in parts for q in r["requests"]]}
                        level[name] = {**throughput(merged), "rounds_tokens_per_s": [throughput(r)["tokens_per_s"] for r in parts],
                                       "foreign_cpu_share": round(sum(r["cpu"]["foreign_cpu_share"] * r["wall_s"] for r in parts) / merged["wall_s"], 3),
                                       "own_cpu_share": round(sum(r["cpu"]["own_cpu_share"] * r["wall_s"] for r in parts) / merged["wall_s"], 3),
                                       "loadavg_1m_max": max(r["cpu"]["loadavg_1m"] for r in parts),
                                       "_ttft": [q.get("ttft_s") for q in merged["requests"]]}
                        if name == "engine":
                            level[name]["_kv_samples"] = [k for r in parts for k in r["kv_samples"]]  # summarised in report()
                    level["engine_vs_sequential"] = round(level["engine"]["tokens_per_s"] / level["sequential"]["tokens_per_s"], 2)
                    level["engine_vs_naive"] = round(level["engine"]["tokens_per_s"] / level["naive"]["tokens_per_s"], 2)
                    if "llama_server" in level:
                        level["engine_vs_llama_server"] = round(level["engine"]["tokens_per_s"] / level["llama_server"]["tokens_per_s"], 2)
                    by_level[f"concurrency_{c}"] = level
                    tqdm.write(f"{workload} c={c}: engine {level['engine']['tokens_per_s']} tok/s, sequential "
                               f"{level['sequential']['tokens_per_s']}, naive {level['naive']['tokens_per_s']} (load {os.getloadavg()[0]:.2f})")
            bar.set_description("long-prompt interference")
            watch.start()
            inter = await engine.call({"op": "interference", "alone": list(range(args.alone)),
                                       "during": list(range(1000, 1200)), "rounds": args.long_rounds,
                                       "long_tokens": args.long_tokens, "long_max_tokens": 8,
                                       "short_max_tokens": 4, "gap_s": 0.1}, bar)
            results["interference"] = {**inter, **watch.stop()}
        results["memory"] = {
            "engine": await engine.call({"op": "status"}),
            "sequential": await seq.call({"op": "status"}),
        }
        async with aiohttp.ClientSession() as s, s.get(status_url) as r:
            results["memory"]["naive"] = await r.json()
    finally:
        if server is not None:
            server.terminate()
            await server.wait()
        await engine.quit()
        await seq.quit()
        naive.terminate()
        await naive.wait()
    results["engine_settings"] = engine.info["settings"]
    results["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    results["loadavg_start"] = [round(x, 2) for x in load_start]
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["requests_per_level"] = reqs
    results.setdefault("skipped_levels", [])
    results["logs"] = str(tmp)
    return results


def report(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    settings = raw["engine_settings"]
    engine_stats = raw["memory"]["engine"]["stats"]
    n_seq_max = settings["slots"] + settings["prefix_slots"]
    workloads: dict[str, Any] = {}
    for workload, by_level in raw["workloads"].items():
        levels: dict[str, Any] = {}
        ttft8: dict[str, Any] = {}
        for key, level in by_level.items():
            samples = level["engine"].pop("_kv_samples")
            level["engine"]["kv"] = kv_summary(samples, engine_stats["kv_cells_total"], n_seq_max)
            ttfts = {name: level[name].pop("_ttft") for name in ("engine", "sequential", "naive", "llama_server") if name in level}
            if key == "concurrency_8":
                for name in [n for n in ("engine", "naive", "llama_server") if n in level]:
                    vals = [t for t in ttfts[name] if t is not None]
                    ttft8[name] = {"p50_ms": round(pct(vals, 0.5) * 1000, 1), "p99_ms": round(pct(vals, 0.99) * 1000, 1), "n": len(vals)}
            levels[key] = level
        ratios: dict[str, Any] = {}
        l8 = levels.get("concurrency_8")
        if l8:
            ratios["throughput_engine_vs_sequential_at_8"] = {"value": l8["engine_vs_sequential"], "target": ">= 1.4",
                                                              "met": l8["engine_vs_sequential"] >= 1.4}
            if "engine_vs_llama_server" in l8:
                v = l8["engine_vs_llama_server"]
                ratios["throughput_engine_vs_llama_server_at_8"] = {"value": v, "target": ">= 0.8", "met": v >= 0.8}
            r = round(ttft8["naive"]["p99_ms"] / ttft8["engine"]["p99_ms"], 1)
            ratios["ttft_p99_naive_over_engine_at_8"] = {"value": r, "target": ">= 10", "met": r >= 10}
        workloads[workload] = {"prompts": WORKLOADS[workload].__doc__.strip() if WORKLOADS[workload].__doc__ else workload,
                               "ratios": ratios, "throughput": levels, "ttft_at_8_streams": ttft8}
    inter = raw["interference"]
    alone = [s["ttft_s"] for s in inter["alone"]]
    during = [s["ttft_s"] for s in inter["during"] if s["during_prefill"]]
    interference = {
        "alone": {"p50_ms": round(pct(alone, 0.5) * 1000, 1), "p99_ms": round(pct(alone, 0.99) * 1000, 1), "n": len(alone)},
        "during_long_prefill": {"p50_ms": round(pct(during, 0.5) * 1000, 1), "p99_ms": round(pct(during, 0.99) * 1000, 1), "n": len(during)},
        "long_prompts": inter["longs"],
        "ttft_ms_sorted": {"alone": sorted(round(x * 1000) for x in alone), "during_long_prefill": sorted(round(x * 1000) for x in during)},
        "short_prompt_tokens": sorted({s["prompt_tokens"] for s in inter["alone"] + inter["during"]}),
        "short_cached_tokens_median": statistics.median(s["cached_tokens"] for s in inter["alone"] + inter["during"]),
        "foreign_cpu_share": inter["foreign_cpu_share"], "loadavg_1m": inter["loadavg_1m"],
        "method": "shorts (max_tokens 4) sent one at a time, 100 ms apart; 'during' keeps those submitted "
                  "before the long prompt's first token; each long prompt differs after the chat template's system prompt",
    }
    ratios: dict[str, Any] = {}
    if during and alone:
        r = round(interference["during_long_prefill"]["p99_ms"] / interference["alone"]["p99_ms"], 2)
        ratios["short_ttft_p99_during_long_prefill_over_alone"] = {"value": r, "target": "<= 2", "met": r <= 2}
    foreign = [lv[n]["foreign_cpu_share"] for w in workloads.values() for lv in w["throughput"].values()
               for n in ("engine", "sequential", "naive", "llama_server") if n in lv]
    noisy = max(raw["loadavg_start"][0], raw["loadavg_end"][0]) > 2.5 or max(foreign, default=0) > 0.15
    return {
        "what": "edge engine (continuous batching) vs sequential llama_cpp.Llama vs a naive locked aiohttp server; same model, 2 threads",
        "model": "SmolLM2-135M-Instruct Q4_1 (bundled)",
        "setup": {"n_threads": N_THREADS, "n_ctx_per_sequence": N_CTX, "max_tokens": args.max_tokens, "sampling": "greedy (temperature 0)",
                  "prompts": "per workload (see workloads.*.prompts); none repeated across levels",
                  "engine": settings, "engine_requests": "in-process EdgeEngine.submit (no HTTP)",
                  "naive": "aiohttp, one asyncio.Lock around Llama.create_chat_completion(stream=True) in the default executor; "
                           "streamed over loopback to this process",
                  "sequential": "one Llama.create_chat_completion after another, in-process (flash attention, f16 KV); concurrency ignored",
                  "llama_cpp_server": (f"llama-server --parallel {max(args.levels)} -t {N_THREADS} -c {N_CTX} per slot, built from "
                                       "llama-cpp-python's vendored llama.cpp with the same CPU flags" if args.llama_server else
                                       "not run (bench/build_llama_server.sh, then --llama-server PATH); calibration on this kind of machine: ~122 tok/s at --parallel 8"),
                  "use_extra_bufts": "Llama() in llama-cpp-python 0.3.36 has no such parameter; not needed with the portable AVX2 build",
                  "tokens_per_s": "completion tokens of all requests / wall time (prefill included); a level runs in rounds of "
                                  "c concurrent requests, each round giving the three systems the same prompts in rotated order"},
        "targets": {"throughput_at_8": ">= 1.4x sequential", "ttft_p99_at_8": ">= 10x better than naive",
                    "short_ttft_during_long_prefill": "p99 <= 2x alone"},
        "ratios": {**{f"{w}.{k}": v for w, body in workloads.items() for k, v in body["ratios"].items()}, **ratios},
        "noisy": noisy,
        "load": {"loadavg_start": raw["loadavg_start"], "loadavg_end": raw["loadavg_end"],
                 "note": "shared 2-core machine; foreign_cpu_share is the CPU time other processes took during each run "
                         "(0.5 = one core's worth); above ~0.15 treat the figures as noisy"},
        "workloads": workloads,
        "long_prompt_interference": interference,
        "memory": {
            name: {"peak_rss_mb": round(m["VmHWM"] / 1024, 1), "rss_end_mb": round(m["VmRSS"] / 1024, 1)}
            for name, m in raw["memory"].items()
        },
        "engine_kv_cells_total": engine_stats["kv_cells_total"],
        "requests_per_level": raw["requests_per_level"],
        "skipped_levels": raw.get("skipped_levels", []),
        "elapsed_s": raw["elapsed_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    defaults = EdgeSettingsDefaults()
    parser.add_argument("--prefill-step-ms", type=float, default=defaults.prefill_step_ms, help="engine setting under test")
    parser.add_argument("--decode-gap-ms", type=float, default=defaults.decode_gap_ms, help="engine setting under test")
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server binary: adds it as a fourth system")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the requests per level")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--alone", type=int, default=12, help="short requests measured with nothing else running")
    parser.add_argument("--long-rounds", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--budget-s", type=float, default=720, help="levels not started by then are skipped")
    parser.add_argument("--out", default="edge_engine", help="result name under bench/results")
    parser.add_argument("--worker", choices=["engine", "sequential"], help=argparse.SUPPRESS)
    parser.add_argument("--naive-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "engine":
        asyncio.run(engine_worker(args))
        return
    if args.worker == "sequential":
        sequential_worker()
        return
    if args.naive_server:
        naive_server(args.port)
        return
    raw = asyncio.run(drive(args))
    data = report(raw, args)
    data["verdicts"] = verdicts("edge_engine", data)
    path = write(args.out, data)
    print(f"\nload average start {data['load']['loadavg_start']}, end {data['load']['loadavg_end']}"
          f"{' (NOISY: shared machine busy)' if data['noisy'] else ''}")
    for workload, body in data["workloads"].items():
        for key, lv in body["throughput"].items():
            print(f"{workload} {key}: tok/s engine {lv['engine']['tokens_per_s']}, sequential {lv['sequential']['tokens_per_s']}, "
                  f"naive {lv['naive']['tokens_per_s']}  (engine/seq {lv['engine_vs_sequential']}x, foreign CPU "
                  f"{max(lv[n]['foreign_cpu_share'] for n in ('engine', 'sequential', 'naive')):.2f})")
        t8 = body["ttft_at_8_streams"]
        if t8:
            print(f"{workload} TTFT at 8 streams p99: engine {t8['engine']['p99_ms']} ms, naive {t8['naive']['p99_ms']} ms")
    li = data["long_prompt_interference"]
    print(f"short TTFT p99 alone {li['alone']['p99_ms']} ms, during 1,500-token prefill {li['during_long_prefill']['p99_ms']} ms "
          f"(n={li['during_long_prefill']['n']})")
    print("peak RSS MB: " + ", ".join(f"{k} {v['peak_rss_mb']}" for k, v in data["memory"].items()))
    for name, r in data["ratios"].items():
        print(f"{name}: {r['value']} (target {r['target']}: {'met' if r['met'] else 'MISSED'})")
    print(f"wrote {path} in {data['elapsed_s']} s")


if __name__ == "__main__":
    main()
