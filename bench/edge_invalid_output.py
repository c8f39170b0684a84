"""Invalid output served to `auto` traffic, before and after the degeneration stop and the cascade.

Everyday prompts (the OpenAssistant first turns in ../shared/data/router/oasst_*) are sent with
model `auto`, greedy, through two running gateways in front of the same real upstream
(llama-cpp-python's OpenAI-compatible server with the bundled SmolLM2, on loopback), side by side
in one run:

- `before`: the edge lane as it was without a degeneration stop (the engine's loop stop off) and
  with the cascade off (the router alone picks edge or upstream, nothing is escalated);
- `after`: the shipped defaults (loop stop on, cascade on: a stopped loop or a low-confidence
  answer is escalated upstream).

Each served answer is judged on its text alone, by criteria the engine and the cascade do not use:
- repeated 4-grams: the share of the answer's word 4-grams that repeat an earlier one
  ("rep-4"); invalid above 0.5 (half of the text repeats itself);
- compressibility: raw bytes / zlib-compressed bytes; invalid above 2.4 (the threshold Whisper
  uses to reject repetitive transcripts), for answers of at least 200 bytes.
An answer is invalid when either criterion flags it; the figures give each criterion, the
served lane, the sample size and Wilson 95 % intervals. The prompts have no reference answers,
so correctness is not judged here (bench/edge_quality.py does that on checkable tasks).

Writes bench/results/edge_invalid_output.json. Run: .venv/bin/python bench/edge_invalid_output.py
[--limit N] (needs ../shared/data; skipped with a message without it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import free_port, gateway_cmd, start, stop, write
from bench._verdicts import wilson

DATA = Path(os.environ.get("TIERLANE_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")) / "router"
FILES = ("oasst_en_100_text.jsonl", "oasst_prompt_lottery_en_250_text.jsonl")
UPSTREAM_MODEL = "smollm2-upstream"
REP4_MAX = 0.5
COMPRESSION_MAX = 2.4
COMPRESSION_MIN_BYTES = 200


def prompts(limit: int) -> list[str]:
    out: list[str] = []
    for name in FILES:
        with open(DATA / name, encoding="utf-8") as fh:
            out.extend(json.loads(line) for line in fh if line.strip())
    # short ones first would bias towards easy prompts; keep the file order, drop the very long
    return [p for p in out if isinstance(p, str) and len(p) < 2000][:limit]


def rep4(text: str) -> float:
    """Share of the word 4-grams that repeat an earlier 4-gram of the same text (0 for short texts)."""
    words = re.findall(r"\w+", text.lower())
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    return round(1 - len(set(grams)) / len(grams), 4) if grams else 0.0


def compression(text: str) -> float | None:
    """Raw bytes / zlib-compressed bytes (None below COMPRESSION_MIN_BYTES: short texts do not compress)."""
    raw = text.encode("utf-8")
    return round(len(raw) / len(zlib.compress(raw, 9)), 3) if len(raw) >= COMPRESSION_MIN_BYTES else None


def judge(text: str) -> dict[str, Any]:
    r4, ratio = rep4(text), compression(text)
    flags = {"rep4": r4 > REP4_MAX, "compression": ratio is not None and ratio > COMPRESSION_MAX}
    return {"rep4": r4, "compression": ratio, **{f"invalid_{k}": v for k, v in flags.items()}, "invalid": any(flags.values())}


def _share(k: int, n: int) -> dict[str, Any]:
    return {"count": k, "n": n, "share": round(k / n, 4) if n else None, "interval_95": wilson(k, n)}


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == 200]
    lanes = sorted({r["lane"] for r in ok})
    out: dict[str, Any] = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "invalid": _share(sum(r["invalid"] for r in ok), len(ok)),
        "invalid_rep4": _share(sum(r["invalid_rep4"] for r in ok), len(ok)),
        "invalid_compression": _share(sum(r["invalid_compression"] for r in ok), len(ok)),
        "finish_length": _share(sum(r["finish"] == "length" for r in ok), len(ok)),
        "rep4_mean": round(statistics.fmean(r["rep4"] for r in ok), 4) if ok else None,
        "compression_median": statistics.median([r["compression"] for r in ok if r["compression"] is not None] or [0.0]),
        "completion_tokens": sum(r["completion_tokens"] for r in ok),
        "escalated": sum(r["escalated"] for r in ok),
        "by_lane": {
            lane: {"served": sum(r["lane"] == lane for r in ok),
                   "invalid": _share(sum(r["invalid"] for r in ok if r["lane"] == lane), sum(r["lane"] == lane for r in ok))}
            for lane in lanes
        },  # fmt: skip
    }
    return out


async def ask(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": "auto", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    # Cache-Control: no-cache: every answer is generated now, never a cache entry of an earlier one
    async with session.post(url + "/v1/chat/completions", json=body, headers={"Cache-Control": "no-cache"}) as resp:
        lane_header = resp.headers.get("x-tierlane-lane", "")
        if resp.status != 200:
            return {"status": resp.status, "error": (await resp.text())[:200], "lane": "error"}
        payload = await resp.json()
    choice = payload["choices"][0]
    text = choice["message"]["content"] or ""
    return {
        "status": 200, "lane": lane_header.split(";")[0].split(":")[0] or "unknown", "escalated": "escalated" in lane_header,
        "finish": choice["finish_reason"], "completion_tokens": (payload.get("usage") or {}).get("completion_tokens", 0),
        "chars": len(text), **judge(text),
    }  # fmt: skip


async def run(url: str, items: list[str], max_tokens: int, concurrency: int, label: str) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(items), desc=label, unit="prompt")
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(prompt: str) -> dict[str, Any]:
            async with gate:
                result = await ask(session, url, prompt, max_tokens)
                bar.update(1)
                return result

        results = await asyncio.gather(*(one(p) for p in items))
    bar.close()
    return list(results)


def config(upstream_url: str, state: Path, before: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "state_dir": str(state),
        "upstreams": [{"name": "llama", "base_url": upstream_url, "models": [UPSTREAM_MODEL]}],
        "telemetry": {"tracing": False},
    }
    if before:
        cfg["policy"] = {"cascade": {"enabled": False}}
    return cfg


def serve_without_loop_stop(argv: list[str]) -> int:
    """`gateway.cli` with the edge engine's loop stop off for every request: the lane before it existed."""
    import gateway.lanes.edge as edge_lane
    from gateway.cli import main as cli_main

    original = edge_lane.sampling_from_request

    def without_loop_stop(wire: Any) -> Any:
        params = original(wire)
        params.stop_on_loop = False
        return params

    edge_lane.sampling_from_request = without_loop_stop
    return cli_main(argv)


def start_upstream(tmp: Path, threads: int) -> tuple[Any, str]:
    from edge_engine import bundled_model_path

    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(bundled_model_path()), "--model_alias", UPSTREAM_MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", str(threads), "--verbose", "False",
           "--interrupt_requests", "False"]  # fmt: skip  (llama_cpp.server drops a running request when the next arrives otherwise)
    return start(cmd, f"http://127.0.0.1:{port}/v1/models", tmp / "upstream.log"), f"http://127.0.0.1:{port}/v1"


def start_gateway(tmp: Path, upstream_url: str, before: bool) -> tuple[Any, str]:
    name = "before" if before else "after"
    state = tmp / name
    state.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = gateway_cmd(config(upstream_url, state, before), state / "config.yaml", port)
    if before:  # the same command line, through serve_without_loop_stop
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-without-loop-stop", *cmd[3:]]
    proc = start(cmd, f"http://127.0.0.1:{port}/readyz", state / "gateway.log", env={"HF_HUB_OFFLINE": "1"})
    return proc, f"http://127.0.0.1:{port}"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    items = prompts(args.limit)
    records: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tierlane-invalid-") as tmp_name:
        tmp = Path(tmp_name)
        upstream, upstream_url = start_upstream(tmp, args.upstream_threads)
        try:
            for name in ("before", "after"):  # one gateway at a time: they share the CPUs with the upstream
                proc, url = start_gateway(tmp, upstream_url, before=name == "before")
                try:
                    records[name] = await run(url, items, args.max_tokens, args.concurrency, name)
                finally:
                    stop(proc)
        finally:
            stop(upstream)
    before, after = summarise(records["before"]), summarise(records["after"])
    both = [(b["invalid"], a["invalid"]) for b, a in zip(records["before"], records["after"]) if b["status"] == a["status"] == 200]
    return {
        "what": "invalid output served to `auto` traffic through running gateways, before (no loop stop, cascade off) "
                "and after (shipped defaults), judged on the served text by criteria the engine does not use",
        "prompts": len(items),
        "source": [f"../shared/data/router/{name}" for name in FILES],
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "decoding": "model auto, temperature 0; edge: bundled SmolLM2-135M-Instruct Q4_1 in the gateway; upstream: the same "
                    "model behind llama-cpp-python's server (its default sampling otherwise)",
        "criterion": {"rep4_max": REP4_MAX, "compression_max": COMPRESSION_MAX, "compression_min_bytes": COMPRESSION_MIN_BYTES,
                      "invalid": "rep-4 above rep4_max, or raw/zlib bytes above compression_max (answers of at least "
                                 "compression_min_bytes); the engine's loop detector and the cascade's confidence are not used"},
        "before": before,
        "after": after,
        "paired": {"prompts": len(both), "invalid_before_only": sum(b and not a for b, a in both),
                   "invalid_after_only": sum(a and not b for b, a in both), "invalid_both": sum(a and b for b, a in both)},
        "wall_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-without-loop-stop":
        return serve_without_loop_stop(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=80, help="everyday prompts, each sent to both gateways")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--upstream-threads", type=int, default=1)
    args = parser.parse_args()
    if not DATA.exists():
        print(f"skipped: {DATA} is absent (the everyday prompts live in ../shared/data)")
        return 0
    result = asyncio.run(main_async(args))
    path = write("edge_invalid_output", result)
    print(json.dumps({k: result[k] for k in ("before", "after", "paired")}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
