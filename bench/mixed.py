"""Mixed traffic through a running gateway, with and without the routing quality bound -> bench/results/mixed.json.

One seeded workload, replayed twice side by side on fresh gateways (shipped router, policy and
cache; edge off; two upstream tiers priced 1 : 10 per token):

- `router`: the router alone picks the tier;
- `bound`: the same with `lanes.upstream.tiers.max_quality_loss: 0.03` at the shipped
  quality_sample_rate (0.1), and `bound_sample_0.25` at 0.25 (more judgements, more judging spend).

Both tiers are one replay upstream answering from a table, as a weak and a strong model would:
- `mmlu`: the router's held-out MMLU subjects; a letter, right where the recorded model
  (Mixtral-8x7B / GPT-4) was right (bench/replay_upstream.py's key);
- `math`: MATH problems with a numeric reference answer (`math_levels.jsonl`, none of the
  router's math sample, a family the router and the regions never trained on): the strong tier
  answers with the reference; the cost tier right with probability COST_RIGHT[level] (seeded per
  problem: the same problem gets the same answer every time it is asked), else a plausible wrong
  number (bench/agreement_judge.py's `wrong`);
- `simple`: generated arithmetic both tiers get right;
- `paraphrase`: Quora question pairs (half true duplicates, `qqp_train_pairs.json`), the second
  asked after the first; an answer is right when it was written for that question or its duplicate;
- `repeat`: exact repeats of earlier mmlu, simple and math requests.

Reported per run: the bill as a share of all-strong (every request on the strong tier, no cache),
the quality served as a share of all-strong's, per lane and per family; random routing at the same
strong share (its expectation, over the requests the tiers answered); the judging spend (the
bound's shadow calls, read from the replay's own counters); the disagreement the cost tier served
after the first WARMUP requests, per region and in all.

    HF_HUB_OFFLINE=1 python bench/mixed.py [--limit N]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import free_port, gateway_cmd, start, stop, write
from bench._verdicts import verdicts
from bench.agreement_judge import phrase, show, wrong
from bench.replay_upstream import mmlu_answer, mmlu_key
from policies.policy import Policy
from policies.router import Router
from policies.router.agreement import final_answer, judge
from policies.router.data import load_math, load_mmlu, shared_data_dir
from policies.router.train import MATH_SAMPLE, MATH_SEED

SEED = 17
MAX_QUALITY_LOSS = 0.03
SAMPLE_RATES = {"bound": 0.1, "bound_sample_0.25": 0.25}
WARMUP = 200
MIN_REGION = 30  # tiered requests after warm-up a region needs for its own disagreement figure
COST_RIGHT = {1: 0.85, 2: 0.7, 3: 0.55, 4: 0.4, 5: 0.25}  # the cost tier's chance on a MATH problem, by level
MIX = {"simple": 0.3, "mmlu": 0.22, "math": 0.18, "paraphrase": 0.15, "repeat": 0.15}
COMPLETION_TOKENS = {"simple": 4, "mmlu": 1, "math": 120, "paraphrase": 60}
PRICES = {"cost-model": (0.5, 1.5), "strong-model": (5.0, 15.0)}  # USD per million input / output tokens
LANE = re.compile(r"tier=(cost|strong)(?:; region=(\d+))?; score=([0-9.]+)")


def tokens(prompt: str) -> int:
    return max(1, len(prompt) // 4)


def price(model: str, prompt_tokens: int, completion_tokens: int) -> float:
    inp, out = PRICES[model]
    return (prompt_tokens * inp + completion_tokens * out) / 1e6


def _unit(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def workload(n: int, data: Path, router: Router) -> list[dict[str, Any]]:
    """Seeded requests: {family, prompt, answers: {cost, strong}, right: {answer text: 1}, tokens}."""
    rng = random.Random(SEED)
    counts = {family: round(n * share) for family, share in MIX.items()}
    # math: numeric references, outside the router's math sample
    problems, levels = load_math(data)
    rows = [json.loads(line) for line in (data / "router" / "math_levels.jsonl").read_text().splitlines() if line.strip()]
    by_problem = {row["problem"]: row for row in rows}
    import numpy as np

    seen = set(np.random.RandomState(MATH_SEED).permutation(len(problems))[:MATH_SAMPLE].tolist())
    math = []
    for i in rng.sample(range(len(problems)), len(problems)):
        if i in seen:
            continue
        final = final_answer(by_problem[problems[i]]["solution"])
        if final is None or final.kind != "number" or not isinstance(final.value, Fraction):
            continue
        value, level, prompt = final.value, int(levels[i]), problems[i]
        local = random.Random(f"{SEED}-{prompt}")
        strong = phrase(show(value, local), local)
        cost = strong if _unit(f"cost-{prompt}") < COST_RIGHT[level] else phrase(show(wrong(value, local), local), local)
        math.append({"family": "math", "level": level, "prompt": prompt, "answers": {"cost": cost, "strong": strong},
                     "reference": strong})
        if len(math) >= counts["math"]:
            break
    # mmlu: the router's held-out subjects
    mmlu_all = load_mmlu(data)
    held = set(router.manifest["split"]["test_subjects"])
    idx = [i for i in range(len(mmlu_all.prompts)) if mmlu_all.subjects[i] in held]
    mmlu = []
    for i in rng.sample(idx, counts["mmlu"]):
        prompt = mmlu_all.prompts[i]
        mmlu.append({"family": "mmlu", "subject": str(mmlu_all.subjects[i]), "prompt": prompt,
                     "answers": {"cost": mmlu_answer(prompt, bool(mmlu_all.weak[i])),
                                 "strong": mmlu_answer(prompt, bool(mmlu_all.strong[i]))},
                     "reference": mmlu_key(prompt)})
    simple = []
    for _ in range(counts["simple"]):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        prompt = rng.choice([f"What is {a} {op} {b}? Reply with the number only.", f"Compute {a} {op} {b}.",
                             f"Quick check: {a} {op} {b} = ?"])
        simple.append({"family": "simple", "prompt": prompt, "answers": {"cost": str(value), "strong": str(value)},
                       "reference": str(value)})
    pairs = json.loads((data / "cache" / "qqp_train_pairs.json").read_text())
    positives = [p for p in pairs if p["label"] == 1]
    negatives = [p for p in pairs if p["label"] == 0]
    chosen = rng.sample(positives, counts["paraphrase"] // 4) + rng.sample(negatives, counts["paraphrase"] // 4)
    paraphrase = []
    for pair in chosen:
        first = pair["text_a"]
        second_owner = first if pair["label"] == 1 else pair["text_b"]
        for prompt, owner in ((pair["text_a"], first), (pair["text_b"], second_owner)):
            answer = f"On the question '{owner}': here is a considered answer."
            paraphrase.append({"family": "paraphrase", "prompt": prompt, "answers": {"cost": answer, "strong": answer},
                               "reference": answer, "pair": len(paraphrase) // 2})
    # order: everything shuffled, each paraphrase pair in order; repeats after their original
    firsts = math + mmlu + simple + paraphrase[0::2]
    rng.shuffle(firsts)
    order: list[dict[str, Any]] = []
    seconds = {row["pair"]: row for row in paraphrase[1::2]}
    for row in firsts:
        order.append(row)
        if row["family"] == "paraphrase" and rng.random() < 0.5:
            order.append(seconds.pop(row["pair"]))
    for row in seconds.values():  # the rest later, at a random point after their first
        first_at = next(i for i, r in enumerate(order) if r["family"] == "paraphrase" and r["pair"] == row["pair"])
        order.insert(rng.randint(first_at + 1, len(order)), row)
    pool = [r for r in order if r["family"] in ("mmlu", "simple", "math")]
    for _ in range(counts["repeat"]):
        original = rng.choice(pool)
        at = order.index(original)
        order.insert(rng.randint(at + 1, len(order)), {**original, "family": "repeat", "of": original["family"]})
    return order


def grade(row: dict[str, Any], text: str) -> float:
    family = row.get("of", row["family"])
    if family == "math":
        return float(judge(text, row["reference"]) == "agree")
    return float(text.strip() == row["reference"])


def replay(table: dict[str, dict[str, Any]]) -> tuple[web.Application, dict[str, Any]]:
    spend: dict[str, Any] = {"calls": {m: 0 for m in PRICES}, "usd": {m: 0.0 for m in PRICES}}

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        model = body.get("model")
        prompt = next((m["content"] for m in reversed(body.get("messages") or []) if m.get("role") == "user"), "")
        row = table.get(prompt)
        tier = "strong" if model == "strong-model" else "cost"
        text = row["answers"][tier] if row else "unknown"
        family = row.get("of", row["family"]) if row else "simple"
        usage = {"prompt_tokens": tokens(prompt), "completion_tokens": COMPLETION_TOKENS.get(family, 4)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if model in PRICES:
            spend["calls"][model] += 1
            spend["usd"][model] += price(model, usage["prompt_tokens"], usage["completion_tokens"])
        return web.json_response({"id": "r", "object": "chat.completion", "created": int(time.time()), "model": model,
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}], "usage": usage})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in PRICES]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app, spend


def gateway_config(state: Path, url: str, sample_rate: float | None) -> dict[str, Any]:
    tiers: dict[str, Any] = {"cost": {"pool": "standard", "model": "cost-model"}, "strong": {"pool": "critical", "model": "strong-model"}}
    if sample_rate is not None:
        tiers.update(max_quality_loss=MAX_QUALITY_LOSS, quality_sample_rate=sample_rate)
    return {
        "state_dir": str(state),
        "upstreams": [{"name": "cost", "base_url": url, "models": ["cost-model"], "pool": "standard"},
                      {"name": "strong", "base_url": url, "models": ["strong-model"], "pool": "critical"}],
        "edge": {"enabled": False},
        "embedder": {"enabled": True},
        "telemetry": {"tracing": False},
        "policy": {
            "trim": {"enabled": False}, "budgets": {"enabled": False},
            "lanes": {"upstream": {"tiers": tiers}},
            # the replay answers in ~1 ms, far faster than traffic a real deployment sees: no per-minute cap here
            "shadow": {"seed": SEED, "max_per_minute": 1_000_000, "max_pending": 1000},
            "pricing": {"models": {m: {"input": i, "output": o} for m, (i, o) in PRICES.items()}},
        },
    }


async def send_all(url: str, rows: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    """In order, one at a time: the bound learns from what came before, as on live traffic."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for i, row in enumerate(tqdm(rows, desc=label, unit="req")):
            body = {"model": "auto", "messages": [{"role": "user", "content": row["prompt"]}], "max_tokens": 256}
            async with session.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": f"mixed-{i}"}) as resp:
                header = resp.headers.get("x-tierlane-lane", "")
                payload = await resp.json() if resp.status == 200 else {}
            m = LANE.search(header)
            text = payload["choices"][0]["message"]["content"] if payload else ""
            lane = "cache" if header.startswith("cache") else (m.group(1) if m else "other")
            out.append({"status": resp.status, "lane": lane, "region": int(m.group(2)) if m and m.group(2) else None,
                        "score": float(m.group(3)) if m else None, "text": text})
        async with session.get(url + "/v1/dashboard") as resp:
            dashboard = await resp.json() if resp.status == 200 else {}
    out.append({"dashboard": dashboard})
    return out


def report(rows: list[dict[str, Any]], results: list[dict[str, Any]], spend: dict[str, Any]) -> dict[str, Any]:
    dashboard = results[-1]["dashboard"]
    results = results[:-1]
    all_strong_bill = sum(price("strong-model", tokens(r["prompt"]), COMPLETION_TOKENS[r.get("of", r["family"])]) for r in rows)
    served_bill = 0.0
    quality = strong_quality = 0.0
    tiered = []
    by_family: dict[str, dict[str, float]] = {}
    by_lane: dict[str, dict[str, float]] = {}
    for row, res in zip(rows, results):
        family = row["family"]
        q = grade(row, res["text"]) if res["status"] == 200 else 0.0
        sq = grade(row, row["answers"]["strong"])
        cq = grade(row, row["answers"]["cost"])
        quality += q
        strong_quality += sq
        if res["lane"] in ("cost", "strong"):
            model = f"{res['lane']}-model"
            served_bill += price(model, tokens(row["prompt"]), COMPLETION_TOKENS[row.get("of", family)])
            tiered.append((row, res, sq, cq))
        for key, table in ((family, by_family), (res["lane"], by_lane)):
            entry = table.setdefault(key, {"requests": 0, "quality": 0.0, "strong_quality": 0.0})
            entry["requests"] += 1
            entry["quality"] += q
            entry["strong_quality"] += sq
    share = sum(res["lane"] == "strong" for _, res, _, _ in tiered) / max(1, len(tiered))
    random_quality = quality - sum(
        (sq if res["lane"] == "strong" else cq) for _, res, sq, cq in tiered) + sum(share * sq + (1 - share) * cq for _, _, sq, cq in tiered)
    judge_usd = sum(spend["usd"].values()) - served_bill
    # disagreement the cost tier served after warm-up: its answer differs from the strong tier's
    late = [(row, res) for i, (row, res) in enumerate(zip(rows, results)) if i >= WARMUP and res["lane"] in ("cost", "strong")]
    regions: dict[str, dict[str, int]] = {}
    for row, res in late:
        key = str(res["region"])
        entry = regions.setdefault(key, {"tiered": 0, "cost": 0, "served_disagreement": 0})
        entry["tiered"] += 1
        if res["lane"] == "cost":
            entry["cost"] += 1
            entry["served_disagreement"] += int(row["answers"]["cost"] != row["answers"]["strong"])
    for entry in regions.values():
        entry["disagreement_share"] = round(entry["served_disagreement"] / entry["tiered"], 4)  # type: ignore[assignment]
    late_disagree = sum(e["served_disagreement"] for e in regions.values())

    def family_view(name: str) -> dict[str, Any]:
        fam = [(row, res, sq, cq) for row, res, sq, cq in tiered if row["family"] == name]
        if not fam:
            return {}
        s = sum(res["lane"] == "strong" for _, res, _, _ in fam) / len(fam)
        served = sum((sq if res["lane"] == "strong" else cq) for _, res, sq, cq in fam)
        rand = sum(s * sq + (1 - s) * cq for _, _, sq, cq in fam)
        best = sum(sq for _, _, sq, _ in fam)
        return {"tiered": len(fam), "strong_share": round(s, 4), "quality_vs_all_strong": round(served / best, 4) if best else None,
                "random_quality_vs_all_strong": round(rand / best, 4) if best else None,
                "gain_over_random": round((served - rand) / best, 4) if best else None}

    return {
        "requests": len(rows),
        "errors": sum(r["status"] != 200 for r in results),
        "bill_vs_all_strong": round(served_bill / all_strong_bill, 4),
        "saved_share": round(1 - served_bill / all_strong_bill, 4),
        "judging_spend_vs_all_strong": round(judge_usd / all_strong_bill, 4),
        "saved_share_after_judging": round(1 - (served_bill + judge_usd) / all_strong_bill, 4),
        "quality_vs_all_strong": round(quality / strong_quality, 4),
        "random_at_same_strong_share_quality_vs_all_strong": round(random_quality / strong_quality, 4),
        "strong_share_of_tiered": round(share, 4),
        "replay_calls": spend["calls"],
        "per_family": {k: {"requests": int(v["requests"]), "quality_vs_all_strong": round(v["quality"] / v["strong_quality"], 4)
                           if v["strong_quality"] else None} for k, v in sorted(by_family.items())},
        "per_lane": {k: {"requests": int(v["requests"]), "quality": round(v["quality"] / v["requests"], 4)}
                     for k, v in sorted(by_lane.items())},
        "held_out_families": {"math": family_view("math"), "mmlu": family_view("mmlu")},
        "after_warmup": {"from_request": WARMUP, "tiered": len(late), "served_disagreement": late_disagree,
                         "disagreement_share": round(late_disagree / max(1, len(late)), 4),
                         # regions with at least MIN_REGION tiered requests: one of 4 is no rate
                         "worst_region_share": max((e["disagreement_share"] for e in regions.values()
                                                    if e["tiered"] >= MIN_REGION), default=None),
                         "min_region_requests": MIN_REGION,
                         "per_region": dict(sorted(regions.items()))},
        "dashboard_regions": dashboard.get("quality", {}).get("route_bound", []),
    }


async def run_one(rows: list[dict[str, Any]], label: str, sample_rate: float | None) -> dict[str, Any]:
    table = {row["prompt"]: row for row in rows}
    app, spend = replay(table)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            state = Path(tmp)
            gw_port = free_port()
            proc = start(gateway_cmd(gateway_config(state, f"http://127.0.0.1:{port}/v1", sample_rate), state / "config.yaml", gw_port),
                         f"http://127.0.0.1:{gw_port}/readyz", state / "gateway.log", env={"HF_HUB_OFFLINE": "1"})
            try:
                results = await send_all(f"http://127.0.0.1:{gw_port}", rows, label)
                await asyncio.sleep(2.0)  # the last shadow calls finish
            finally:
                stop(proc)
    finally:
        await runner.cleanup()
    return report(rows, results, spend)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="requests (default 1600)")
    args = parser.parse_args()
    router = Router.load()
    rows = workload(args.limit or 1600, shared_data_dir(None), router)
    began = time.perf_counter()
    runs = {"router": asyncio.run(run_one(rows, "router", None))}
    for label, rate in SAMPLE_RATES.items():
        runs[label] = asyncio.run(run_one(rows, label, rate))
    target = Policy.load().section("router").get("target")
    body = {
        "what": "mixed traffic (repeats, paraphrases, simple checkable tasks, MMLU, MATH) through a running gateway in front "
                "of a replay of a weak (cost) and a strong tier, the router alone and with the routing quality bound",
        "setup": {"requests": len(rows), "mix": MIX, "seed": SEED, "router_target": target, "max_quality_loss": MAX_QUALITY_LOSS,
                  "quality_sample_rate": SAMPLE_RATES, "warmup": WARMUP, "cost_right_by_math_level": COST_RIGHT,
                  "prices_usd_per_million": PRICES, "completion_tokens": COMPLETION_TOKENS, "prompt_tokens": "characters / 4",
                  "families": {f: sum(r["family"] == f for r in rows) for f in MIX}, "edge": "off", "cache": "shipped policy",
                  "concurrency": 1, "seconds": None},
        "runs": runs,
        "targets": {"bound_quality": ">= 0.97 of all-strong", "bound_saved_share": ">= 0.40 of the all-strong bill",
                    "disagreement_after_warmup": f"<= {MAX_QUALITY_LOSS} (share of tiered requests, after the first {WARMUP})",
                    "held_out_gain_over_random": ">= 0.03 on math and mmlu"},
    }
    body["setup"]["seconds"] = round(time.perf_counter() - began, 1)
    body["verdicts"] = verdicts("mixed", body)
    print(write("mixed", body) if not args.limit else json.dumps(body["verdicts"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
