"""Decode-dominated throughput of the edge engine at 8 concurrent requests vs sequential Llama.

Short prompts (about 20-60 tokens) and 64 output tokens, so decoding rather than prefill sets
the pace; the engine is measured in each of its scheduling modes, side by side with
one `llama_cpp.Llama.create_chat_completion` after another over the same prompts. Each run
gets a fresh process: llama.cpp's OpenMP threads from one run otherwise slow the next.
Writes bench/results/edge_decode.json. Run: .venv/bin/python bench/edge_decode.py
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import write
from bench._verdicts import verdicts
from edge_engine import EdgeEngine, EdgeSettings, SamplingParams, bundled_model_path

SEQUENTIAL: dict[str, dict[str, Any]] = {
    "sequential": {},  # llama-cpp-python's defaults
    "sequential (flash attention)": {"flash_attn": True},
}
MODES: dict[str, dict[str, Any]] = {
    "default (batch-invariant, flash attention, q8_0 KV)": {},
    "f16 KV, no flash attention (batch-invariant)": {"flash_attn": False, "kv_cache_type": "f16"},
    "shared f16 KV + flash attention (not batch-invariant)": {"batch_invariant": False, "kv_cache_type": "f16"},
    "shared f16 KV, no flash attention (not batch-invariant)": {"batch_invariant": False, "flash_attn": False, "kv_cache_type": "f16"},
}


def prompts(n: int) -> list[str]:
    return [f"Write a short essay about topic number {i}: " + "the history of bridges and rivers. " * (1 + i % 5) for i in range(n)]


async def engine_rate(texts: list[str], max_tokens: int, threads: int, **mode: Any) -> float:
    engine = EdgeEngine(EdgeSettings(n_ctx=1024, n_threads=threads, slots=len(texts), **mode))
    await engine.start()

    async def one(text: str) -> int:
        tokens = 0
        generation = await engine.submit(
            messages=[{"role": "user", "content": text}], params=SamplingParams(temperature=0.0, max_tokens=max_tokens)
        )
        async for event in generation:
            tokens = event.completion_tokens or tokens
        return tokens

    try:
        await one("warm up")
        started = time.perf_counter()
        produced = sum(await asyncio.gather(*(one(t) for t in texts)))
        return produced / (time.perf_counter() - started)
    finally:
        await engine.close()


def sequential_rate(texts: list[str], max_tokens: int, threads: int, flash_attn: bool = False) -> float:
    from llama_cpp import Llama

    llm = Llama(str(bundled_model_path()), n_ctx=1024, n_threads=threads, flash_attn=flash_attn, verbose=False)
    llm.create_chat_completion([{"role": "user", "content": "warm up"}], max_tokens=4)
    started, produced = time.perf_counter(), 0
    for text in texts:
        out = llm.create_chat_completion([{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0)
        produced += out["usage"]["completion_tokens"]
    return produced / (time.perf_counter() - started)


def _run(kind: str, texts: list[str], max_tokens: int, threads: int, mode: dict[str, Any]) -> float:
    if kind == "sequential":
        return sequential_rate(texts, max_tokens, threads, **mode)
    return asyncio.run(engine_rate(texts, max_tokens, threads, **mode))


def fresh(kind: str, texts: list[str], max_tokens: int, threads: int, mode: dict[str, Any] | None = None) -> float:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_run, (kind, texts, max_tokens, threads, mode or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="engine and sequential alternate this many times")
    args = parser.parse_args()
    texts = prompts(args.concurrency)
    rates: dict[str, list[float]] = {**{m: [] for m in SEQUENTIAL}, **{m: [] for m in MODES}}
    with tqdm(total=args.rounds * (len(SEQUENTIAL) + len(MODES)), desc="edge decode", unit="run") as bar:
        for _ in range(args.rounds):
            for name, mode in SEQUENTIAL.items():
                rates[name].append(fresh("sequential", texts, args.max_tokens, args.threads, mode))
                bar.update(1)
            for name, mode in MODES.items():
                rates[name].append(fresh("engine", texts, args.max_tokens, args.threads, mode))
                bar.update(1)
    best = {k: round(max(v), 1) for k, v in rates.items()}
    lock = max(best[k] for k in SEQUENTIAL)  # the best a lock around Llama can do
    ratios = {k: round(best[k] / lock, 2) for k in MODES}
    print(", ".join(f"{k}: {best[k]} tok/s" for k in SEQUENTIAL))
    for k in MODES:
        print(f"{k}: {best[k]} tok/s = {ratios[k]}x the faster sequential ({lock} tok/s)")
    load = Path("/proc/loadavg").read_text().split()[:3]
    result: dict[str, Any] = {
        "what": __doc__.splitlines()[0],
        "setup": {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "n_threads": args.threads,
                  "rounds": args.rounds, "statistic": "best of rounds, tokens/s including the short prefill",
                  "engine_vs_sequential": "against the faster of the two sequential set-ups"},
        "target": "engine >= 1.4x sequential at 8",
        "tokens_per_s": best, "engine_vs_sequential": ratios, "all_runs": rates, "load_average_end": load,
    }
    path = write("edge_decode", {**result, "verdicts": verdicts("edge_decode", result)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
