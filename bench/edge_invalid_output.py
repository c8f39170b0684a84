"""Invalid edge output on everyday prompts, with and without the degeneration stop and JSON mode.

Everyday prompts are the OpenAssistant first turns in ../shared/data/router/oasst_*; each is
answered greedily by the bundled model through the edge engine, side by side in one run:

- `before`: the engine as it decoded without a degeneration stop (stop_on_loop off): an answer is
  invalid when it runs to max_tokens while repeating itself (the loop detector of
  edge_engine.degeneration run over the whole output);
- `after, pinned`: the stop on: a looping answer ends early (finish "loop", shown to clients as
  "length"); it is still a bad answer, but a short one;
- `after, auto`: what `auto` traffic is served: the cascade escalates a stopped loop upstream, so
  an invalid answer is served only when the stop missed it.

JSON mode: the same prompts asked for `response_format: {"type": "json_object"}`: without a
grammar (how the edge answered before) and with the grammar, the share of answers that parse.

Writes bench/results/edge_invalid_output.json. Run: .venv/bin/python bench/edge_invalid_output.py
[--limit N] (needs ../shared/data; skipped with a message without it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import write
from edge_engine import EdgeEngine, EdgeSettings, SamplingParams
from edge_engine.degeneration import LoopDetector
from edge_engine.json_mode import grammar_for

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "router"
FILES = ("oasst_en_100_text.jsonl", "oasst_prompt_lottery_en_250_text.jsonl")
JSON_INSTRUCTION = "Answer in JSON."


def prompts(limit: int) -> list[str]:
    out: list[str] = []
    for name in FILES:
        with open(DATA / name, encoding="utf-8") as fh:
            out.extend(json.loads(line) for line in fh if line.strip())
    # short ones first would bias towards easy prompts; keep the file order, drop the very long
    return [p for p in out if isinstance(p, str) and len(p) < 2000][:limit]


def repeats(tokens: list[int]) -> bool:
    detector = LoopDetector()
    return any(detector.push(t) for t in tokens)


async def answer(engine: EdgeEngine, prompt: str, params: SamplingParams) -> dict[str, Any]:
    tokens: list[int] = []
    text: list[str] = []
    finish = None
    async for event in engine.generate(messages=[{"role": "user", "content": prompt}], params=params):
        text.append(event.text)
        tokens.extend(t.token for t in event.tokens)
        finish = event.finish_reason or finish
    return {"text": "".join(text), "tokens": tokens, "finish": finish}


async def run_all(engine: EdgeEngine, items: list[str], params: SamplingParams, label: str,
                  concurrency: int) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(items), desc=label, unit="prompt")

    async def one(prompt: str) -> dict[str, Any]:
        async with gate:
            result = await answer(engine, prompt, params)
            bar.update(1)
            return result

    results = await asyncio.gather(*(one(p) for p in items))
    bar.close()
    return list(results)


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    items = prompts(args.limit)
    engine = EdgeEngine(EdgeSettings(n_ctx=4096, slots=8))
    await engine.start()
    try:
        started = time.perf_counter()
        base = {"max_tokens": args.max_tokens, "temperature": 0.0}
        before = await run_all(engine, items, SamplingParams(**base, stop_on_loop=False), "no loop stop", args.concurrency)
        after = await run_all(engine, items, SamplingParams(**base, stop_on_loop=True), "loop stop", args.concurrency)
        json_items = [f"{p}\n\n{JSON_INSTRUCTION}" for p in items[: args.json_limit]]
        grammar = grammar_for({"type": "json_object"})
        json_free = await run_all(engine, json_items, SamplingParams(**base), "json, no grammar", args.concurrency)
        json_grammar = await run_all(engine, json_items, SamplingParams(**base, grammar=grammar), "json, grammar",
                                     args.concurrency)
        wall = time.perf_counter() - started
    finally:
        await engine.close()

    def invalid_before(r: dict[str, Any]) -> bool:
        return r["finish"] == "length" and repeats(r["tokens"])

    n = len(items)
    invalid = {
        "before": sum(invalid_before(r) for r in before),
        # pinned requests get the cut-short loop; still counted as invalid
        "after_pinned": sum(r["finish"] == "loop" or (r["finish"] == "length" and repeats(r["tokens"])) for r in after),
        # auto requests: a stopped loop is escalated, only a missed one is served
        "after_auto_served": sum(r["finish"] == "length" and repeats(r["tokens"]) for r in after),
    }
    tokens = {"before": sum(len(r["tokens"]) for r in before), "after": sum(len(r["tokens"]) for r in after)}
    cut = [r for r in json_grammar if r["finish"] != "stop"]
    result = {
        "prompts": n,
        "source": [f"../shared/data/router/{name}" for name in FILES],
        "max_tokens": args.max_tokens,
        "decoding": "greedy, bundled SmolLM2-135M-Instruct Q4_1, edge engine",
        "invalid": {k: {"count": v, "share": round(v / n, 4)} for k, v in invalid.items()},
        "invalid_reduction_auto": round(1 - invalid["after_auto_served"] / invalid["before"], 4) if invalid["before"] else None,
        "invalid_reduction_pinned": round(1 - invalid["after_pinned"] / invalid["before"], 4) if invalid["before"] else None,
        "generated_tokens": tokens,
        "json_mode": {
            "prompts": len(json_items),
            "parse_share_without_grammar": round(sum(parses(r["text"]) for r in json_free) / len(json_items), 4),
            "parse_share_with_grammar": round(sum(parses(r["text"]) for r in json_grammar) / len(json_items), 4),
            "with_grammar_ended_by_max_tokens": len(cut),
            "parse_share_with_grammar_of_finished": round(
                sum(parses(r["text"]) for r in json_grammar if r["finish"] == "stop")
                / max(1, sum(r["finish"] == "stop" for r in json_grammar)), 4),
        },
        "wall_s": round(wall, 1),
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=160, help="everyday prompts to answer")
    parser.add_argument("--json-limit", type=int, default=60, help="of those, asked again in JSON mode")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    if not DATA.exists():
        print(f"skipped: {DATA} is absent (the everyday prompts live in ../shared/data)")
        return 0
    result = asyncio.run(main_async(args))
    path = write("edge_invalid_output", result)
    print(json.dumps({k: result[k] for k in ("invalid", "invalid_reduction_auto", "json_mode")}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
