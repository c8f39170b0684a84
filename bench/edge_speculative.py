"""Speculative decoding (prompt lookup) in the edge engine: off vs on, side by side in one run.

Same model (the bundled SmolLM2-135M Q4_1), same threads, greedy requests. Workloads:
input-grounded (extract, rewrite, summarise a given text, fill a JSON object from a given
record, edit a code snippet: the answer copies runs of the prompt) and everyday (one-line
questions, bench/edge_engine.py's). Each run is a fresh process with a fresh engine; requests
go out `concurrency` at a time. Also measured: speculation forced on at every concurrency, to
find the crossover above which it no longer pays (the default of edge.speculative.max_batch).
Writes bench/results/edge_speculative.json. Run: .venv/bin/python bench/edge_speculative.py
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
from bench._verdicts import speculative_record
from bench.edge_engine import everyday_chat

RECORD = (
    "name: Maria Lopez; role: senior data engineer; team: Platform; office: Lisbon; started: 2019-03-04; "
    "email: maria.lopez@example.com; phone: +351 21 555 0192; manager: Tom Becker; skills: Python, SQL, Airflow"
)
ORDER = "order 88213, customer Jonas Weber, 3 x USB-C cable at 9.90 EUR, 1 x laptop stand at 34.50 EUR, ship to Hamburg, paid by card"
TEXT = (
    "The city council approved the new cycling plan on Tuesday. The plan adds 42 kilometres of protected "
    "bike lanes over the next three years, starting with the river road and the university district. "
    "Parking on the river road will be reduced by 120 spaces, and the council will open a new car park "
    "near the station to make up for it. The total cost is 18 million euros, of which 11 million come "
    "from a national grant."
)
NOTICE = (
    "Dear residents, the water supply in Block C will be switched off on Friday 14 June from 9:00 to 15:00 "
    "for maintenance of the main pipe. Please store enough water for the day. The lifts will keep working. "
    "For questions, call the building office at 0800 123 456."
)
CODE = '''def total_price(items):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    return total


def average_price(items):
    if len(items) == 0:
        return 0
    return total_price(items) / len(items)
'''
CONFIG = '''server:
  host: 127.0.0.1
  port: 8080
  workers: 4
database:
  url: postgres://app@localhost/app
  pool_size: 10
  timeout_s: 30
logging:
  level: info
  format: json
'''


def grounded_chat(i: int) -> list[dict[str, str]]:
    """Request i: a task over a given text, whose answer copies long runs of it."""
    tasks = [
        f"Here is an employee record:\n{RECORD}\n\nFill this JSON object from the record and output only the JSON: "
        '{"name": "", "role": "", "team": "", "office": "", "started": "", "email": "", "phone": "", "manager": ""}',
        f"Here is an order:\n{ORDER}\n\nWrite it as a JSON object with the keys order_id, customer, items (a list "
        "with name, quantity, unit_price), city and payment. Output only the JSON.",
        f"Copy the following text exactly, but replace every number with the word NUMBER:\n\n{TEXT}",
        f"Extract the sentences about parking and cost from this text, word for word:\n\n{TEXT}",
        f"Rewrite this notice as a bulleted list, keeping the original wording:\n\n{NOTICE}",
        f"Rename the function total_price to order_total everywhere in this code and output the full code:\n\n{CODE}",
        f"Add a docstring to each function in this code and output the full code:\n\n{CODE}",
        f"Change the port to 9090 and the logging level to debug in this YAML, and output the whole file:\n\n{CONFIG}",
        f"Summarise this text in two sentences, reusing its own words:\n\n{TEXT}",
        f"Repeat this notice, but change Friday 14 June to Monday 17 June:\n\n{NOTICE}",
    ]
    return [{"role": "user", "content": tasks[i % len(tasks)]}]


WORKLOADS = {"grounded": grounded_chat, "everyday": everyday_chat}
OFF: dict[str, Any] = {"enabled": False}
FORCED: dict[str, Any] = {"max_batch": 64}  # drafts at any concurrency, to find the crossover


async def engine_run(
    workload: str, n: int, concurrency: int, max_tokens: int, threads: int, spec: dict[str, Any] | None
) -> dict[str, Any]:
    from edge_engine import EdgeEngine, EdgeSettings, SamplingParams
    from edge_engine.settings import SpeculativeSettings

    settings = EdgeSettings(
        n_ctx=1024, n_threads=threads, slots=max(concurrency, 1), prefix_reuse=False,
        speculative=SpeculativeSettings(**(spec or {})),
    )
    engine = EdgeEngine(settings)
    await engine.start()
    gate = asyncio.Semaphore(concurrency)
    make = WORKLOADS[workload]

    async def one(i: int) -> tuple[str, int, float, float]:
        async with gate:
            parts: list[str] = []
            tokens, started, first = 0, time.perf_counter(), None
            generation = await engine.submit(messages=make(i), params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
            async for event in generation:
                if first is None:
                    first = time.perf_counter()
                parts.append(event.text)
                tokens = event.completion_tokens or tokens
            end = time.perf_counter()
            return "".join(parts), tokens, (first or end) - started, end - (first or end)

    try:
        await one(10_000)  # warm up
        before = engine.stats()
        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - started
        after = engine.stats()
    finally:
        await engine.close()
    produced = sum(r[1] for r in results)
    drafted = after["spec_drafted_tokens_total"] - before["spec_drafted_tokens_total"]
    accepted = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
    decode_s = sum(r[3] for r in results)
    return {
        "texts": [r[0] for r in results],
        "completion_tokens": produced,
        "tokens_per_s": produced / wall,
        # after each request's first token (no prefill), summed over requests: meaningful at concurrency 1
        "decode_tokens_per_s": sum(r[1] - 1 for r in results) / decode_s if decode_s else 0.0,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_row_cost": [after["spec_draft_row_cost_first"], after["spec_draft_row_cost"]],
    }


def _run(*args: Any) -> dict[str, Any]:
    return asyncio.run(engine_run(*args))


def fresh(*args: Any) -> dict[str, Any]:
    # a fresh process per run: llama.cpp's OpenMP threads from one run otherwise slow the next
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_run, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grounded", type=int, default=10, help="input-grounded requests per run")
    parser.add_argument("--everyday", type=int, default=16, help="everyday requests per run")
    parser.add_argument("--crossover", type=int, nargs="*", default=[2, 4, 8], help="concurrencies, forced on (1: workload a)")
    parser.add_argument("--rounds", type=int, default=2, help="each run this many times, alternating; best kept")
    args = parser.parse_args()
    # (workload, concurrency, mode): off, on (the defaults) and forced (drafts at any concurrency)
    plan: list[tuple[str, int, str]] = []
    for workload, level in [("grounded", 1), ("everyday", 1), ("everyday", 8), ("grounded", 8)]:
        plan += [(workload, level, "off"), (workload, level, "on")]
    for level in args.crossover:
        if ("grounded", level, "off") not in plan:
            plan.append(("grounded", level, "off"))
        plan.append(("grounded", level, "forced"))
    modes: dict[str, dict[str, Any] | None] = {"off": OFF, "on": None, "forced": FORCED}
    runs: dict[str, dict[str, Any]] = {}
    all_runs: dict[str, list[float]] = {}
    texts_differ: set[str] = set()
    # NOTE: the 2 CPUs are shared: rounds alternate through the whole plan and the best of each is kept
    with tqdm(total=len(plan) * args.rounds, desc="edge speculative", unit="run") as bar:
        for _ in range(args.rounds):
            for workload, level, mode in plan:
                n = args.grounded if workload == "grounded" else args.everyday
                bar.set_postfix_str(f"{workload} x{level} {mode}")
                key = f"{workload}@{level}/{mode}"
                out = fresh(workload, n, level, args.max_tokens, args.threads, modes[mode])
                all_runs.setdefault(key, []).append(round(out["tokens_per_s"], 2))
                if key in runs and runs[key]["texts"] != out["texts"]:
                    texts_differ.add(key)  # greedy text must not change from run to run either
                if key not in runs or out["tokens_per_s"] > runs[key]["tokens_per_s"]:
                    runs[key] = out
                bar.update(1)

    def ratio(workload: str, level: int, mode: str, key: str = "tokens_per_s") -> float:
        return round(runs[f"{workload}@{level}/{mode}"][key] / runs[f"{workload}@{level}/off"][key], 3)

    def speedup(workload: str, level: int, mode: str, key: str = "tokens_per_s") -> float | None:
        """The on/off ratio only where drafts were made: with none, the difference is not speculation's doing."""
        return ratio(workload, level, mode, key) if runs[f"{workload}@{level}/{mode}"]["drafted"] else None

    def case(workload: str, level: int, target: str, **extra: Any) -> dict[str, Any]:
        on = runs[f"{workload}@{level}/on"]
        return {"speedup": speedup(workload, level, "on"), **extra, "exercised": bool(on["drafted"]),
                "drafted": on["drafted"], "accepted": on["accepted"], "completion_tokens": on["completion_tokens"],
                "acceptance_rate": on["acceptance_rate"], "target": target}

    def same(workload: str, level: int, mode: str) -> bool:
        key, off = f"{workload}@{level}/{mode}", f"{workload}@{level}/off"
        return bool(runs[key]["texts"] == runs[off]["texts"]) and not ({key, off} & texts_differ)

    crossover = {1: {"forced_vs_off": speedup("grounded", 1, "on"), "identical": same("grounded", 1, "on")}}  # on = forced alone
    crossover.update({
        level: {"forced_vs_off": speedup("grounded", level, "forced"), "identical": same("grounded", level, "forced")}
        for level in args.crossover
    })
    losing = [level for level in sorted(crossover) if (crossover[level]["forced_vs_off"] or 1.0) < 1.0]
    from edge_engine.settings import SpeculativeSettings

    summary = {
        "a_grounded_c1": case("grounded", 1, ">= 1.5", decode_only_speedup=speedup("grounded", 1, "on", "decode_tokens_per_s")),
        "b_everyday_c1": case("everyday", 1, ">= 0.97"),
        "b_everyday_c8": case("everyday", 8, ">= 0.97"),
        "c_grounded_c8": case("grounded", 8, ">= 1.0"),
        "d_identical": {f"{w}@{lv}": same(w, lv, "on") for w, lv in [("grounded", 1), ("everyday", 1), ("everyday", 8), ("grounded", 8)]},
        "crossover_forced_on_grounded": crossover,
        "measured_crossover": min(losing) if losing else None,
        "max_batch_default": SpeculativeSettings().max_batch,
    }
    for key, value in summary.items():
        print(f"{key}: {value}")
    figures = {k: {f: (round(v, 3) if isinstance(v, float) else v) for f, v in r.items() if f != "texts"} for k, r in runs.items()}
    verdicts = [speculative_record(key, figures, summary[key]["speedup"]) for key in ("a_grounded_c1", "b_everyday_c1", "b_everyday_c8", "c_grounded_c8")]
    path = write("edge_speculative", {
        "what": __doc__.splitlines()[0],
        "setup": {"max_tokens": args.max_tokens, "n_threads": args.threads, "grounded_requests": args.grounded,
                  "everyday_requests": args.everyday, "rounds": args.rounds,
                  "statistic": "best of rounds; completion tokens / wall time incl. prefill",
                  "speculative_defaults": SpeculativeSettings().model_dump(),
                  "crossover": "smallest concurrency where forced speculation is slower than none on the grounded workload"},
        "summary": summary,
        "verdicts": verdicts,
        "runs": figures,
        "all_runs_tokens_per_s": all_runs,
        "load_average_end": Path("/proc/loadavg").read_text().split()[:3],
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
