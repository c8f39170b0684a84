"""Upstream tiers through a running gateway, on the router's held-out data -> bench/results/tiers.json.

Two replay upstreams (bench/replay_upstream.py) stand in for the tiers: `cost` answers as the
weak model did (MMLU: Mixtral-8x7B; AlpacaEval: FuseChat-Llama-3.2-1B), `strong` as the strong
one did (MMLU: GPT-4; AlpacaEval: the gpt4_1106_preview reference). A gateway with the shipped
router and policy (target max_strong_share 0.3), `lanes.upstream.tiers` over two pools, the edge
off, the cache and trimming off, gets every held-out prompt once (MMLU: the 13 test subjects;
AlpacaEval: koala + vicuna, from the router's manifest: never used to train, select or calibrate
it) as model `auto`; the lane header says which tier answered and the router's score, and the
answer is graded against the recorded outcome.

Reported per source: strong share vs the target; quality as a fraction of all-strong; the same
for random routing at the same strong share (its expectation); cost as a fraction of all-strong
under each pricing model (prices stated in the file); and the cost-quality curve across
share targets, from the scores the gateway reported and the thresholds the policy resolves for
each target (the gateway's own rule; checked against the tiers it chose at the shipped target).

    HF_HUB_OFFLINE=1 python bench/tiers.py [--limit N]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import free_port, gateway_cmd, start, stop, write
from bench._verdicts import verdicts
from bench.replay_upstream import ALPACA_COMPLETION_TOKENS, MMLU_COMPLETION_TOKENS, grade, replay_app, tables
from policies.domain import Usage
from policies.policy import Policy
from policies.pricing import TokenPrice
from policies.router import RoutePolicy, Router
from policies.router.data import load_alpaca, load_mmlu, shared_data_dir

SHIPPED_TARGET = 0.3  # policies/defaults/router.yaml: max_strong_share 0.3
CURVE_TARGETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# USD. Per token: per million input / output tokens. Per GPU-second: one GPU each, the same price
# per second, the cost model faster (seconds = prompt / prefill + output / decode tokens per second).
PRICING: dict[str, dict[str, Any]] = {
    "per_token_cost_1_10": {"strong": {"input": 5.0, "output": 15.0}, "cost": {"input": 0.5, "output": 1.5}},
    "per_token_cost_1_5": {"strong": {"input": 5.0, "output": 15.0}, "cost": {"input": 1.0, "output": 3.0}},
    "per_request_cost_1_10": {"strong": {"per_request": 0.01}, "cost": {"per_request": 0.001}},
    "per_gpu_second": {"strong": {"per_second": 0.0012, "prefill_tps": 2000, "decode_tps": 25},
                       "cost": {"per_second": 0.0012, "prefill_tps": 10000, "decode_tps": 100}},
}
LANE = re.compile(r"tier=(cost|strong); score=([0-9.]+)")


def held_out(data_dir: Path, router: Router) -> dict[str, Any]:
    split = router.manifest.get("split", {})
    mmlu = load_mmlu(data_dir)
    mmlu = mmlu.take(np.flatnonzero(np.isin(mmlu.subjects, split["test_subjects"])))
    alpaca = load_alpaca(data_dir)
    alpaca = alpaca.take(np.flatnonzero(np.isin(alpaca.subjects, split["alpaca_test_sources"])))
    return {"mmlu": mmlu, "alpaca": alpaca}


def gateway_config(state: Path, cost_url: str, strong_url: str) -> dict[str, Any]:
    return {
        "state_dir": str(state),
        "upstreams": [{"name": "cost", "base_url": cost_url, "models": ["cost-model"], "pool": "standard"},
                      {"name": "strong", "base_url": strong_url, "models": ["strong-model"], "pool": "critical"}],
        "edge": {"enabled": False},
        "embedder": {"enabled": True},
        "telemetry": {"tracing": False},
        "policy": {
            "cache": {"enabled": False}, "trim": {"enabled": False}, "budgets": {"enabled": False},
            "lanes": {"upstream": {"tiers": {"cost": {"pool": "standard", "model": "cost-model"},
                                             "strong": {"pool": "critical", "model": "strong-model"}}}},
        },
    }


async def send_all(url: str, rows: list[tuple[str, str]], concurrency: int) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(concurrency)
    out: list[dict[str, Any]] = [{} for _ in rows]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(i: int, kind: str, prompt: str) -> None:
            body = {"model": "auto", "messages": [{"role": "user", "content": prompt}], "max_tokens": 512}
            headers = {"x-request-id": f"tiers-{i}"}
            async with gate, session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
                header = resp.headers.get("x-tierlane-lane", "")
                payload = await resp.json() if resp.status == 200 else {}
            m = LANE.search(header)
            text = payload["choices"][0]["message"]["content"] if payload else ""
            out[i] = {"status": resp.status, "tier": m.group(1) if m else None, "score": float(m.group(2)) if m else None,
                      "quality": grade(kind, prompt, text) if payload else None}
        await asyncio.gather(*(one(i, kind, p) for i, (kind, p) in enumerate(rows)))
        async with session.get(url + "/v1/usage") as resp:  # flushes the ledger
            assert resp.status == 200, await resp.text()
    return out


def ledger_rows(state: Path) -> dict[str, tuple[float | None, str | None]]:
    """request id -> (route score at full precision, tier) as the gateway's ledger recorded them."""
    with sqlite3.connect(state / "ledger.sqlite3") as conn:
        return {rid: (score, tier) for rid, score, tier in conn.execute("SELECT request_id, route_score, tier FROM requests")}


def request_cost(spec: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> float:
    seconds = 0.0
    if "per_second" in spec:
        seconds = prompt_tokens / spec["prefill_tps"] + completion_tokens / spec["decode_tps"]
    price = TokenPrice(input=spec.get("input", 0.0), output=spec.get("output", 0.0), cached_input=0.0,
                       per_request=spec.get("per_request", 0.0), per_second=spec.get("per_second", 0.0))
    return price.charge(Usage(input_tokens=prompt_tokens, output_tokens=completion_tokens), seconds)


def source_report(prompts: list[str], weak_q: np.ndarray, strong_q: np.ndarray, results: list[dict[str, Any]],
                  completion_tokens: int, thresholds: dict[float, float]) -> dict[str, Any]:
    n = len(prompts)
    tiers = np.asarray([r["tier"] == "strong" for r in results])
    quality = np.asarray([r["quality"] if r["quality"] is not None else 0.0 for r in results])
    scores = np.asarray([r["score"] if r["score"] is not None else 0.0 for r in results])
    all_strong, all_weak = float(strong_q.sum()), float(weak_q.sum())
    share = float(tiers.mean())
    prompt_tokens = [max(1, len(p) // 4) for p in prompts]
    costs = {name: (np.asarray([request_cost(spec["cost"], t, completion_tokens) for t in prompt_tokens]),
                    np.asarray([request_cost(spec["strong"], t, completion_tokens) for t in prompt_tokens]))
             for name, spec in PRICING.items()}  # fmt: skip

    def point(strong: np.ndarray) -> dict[str, Any]:
        s = float(strong.mean())
        q = float(np.where(strong, strong_q, weak_q).sum())
        random_q = s * all_strong + (1 - s) * all_weak
        out = {"strong_share": round(s, 4), "quality_vs_all_strong": round(q / all_strong, 4),
               "random_quality_vs_all_strong": round(random_q / all_strong, 4),
               "quality_gain_over_random": round((q - random_q) / all_strong, 4), "cost_vs_all_strong": {}}
        for name, (cheap, dear) in costs.items():
            total = float(np.where(strong, dear, cheap).sum())
            random_total = s * float(dear.sum()) + (1 - s) * float(cheap.sum())
            out["cost_vs_all_strong"][name] = {"router": round(total / float(dear.sum()), 4),
                                                "random": round(random_total / float(dear.sum()), 4)}
        return out

    at_shipped = point(tiers)
    at_shipped["served_quality_vs_all_strong"] = round(float(quality.sum()) / all_strong, 4)
    at_shipped["strong_share_error"] = round(share - SHIPPED_TARGET, 4)
    at_shipped["per_tier"] = {"cost": int((~tiers).sum()), "strong": int(tiers.sum())}
    rule = scores >= thresholds[SHIPPED_TARGET]
    return {
        "rows": n,
        "errors": sum(r["status"] != 200 for r in results),
        "weak_quality": round(all_weak / n, 4), "strong_quality": round(all_strong / n, 4),
        "at_shipped_target": at_shipped,
        "gateway_matches_policy_rule": int((rule == tiers).sum()),
        "curve": [{"target_max_strong_share": t, "threshold": round(thresholds[t], 6), **point(scores >= thresholds[t])}
                  for t in CURVE_TARGETS],
    }


async def run(limit: int | None, concurrency: int) -> dict[str, Any]:
    router = Router.load()
    data = held_out(shared_data_dir(None), router)
    mmlu, alpaca = data["mmlu"], data["alpaca"]
    if limit:
        mmlu, alpaca = mmlu.take(np.arange(min(limit, len(mmlu.prompts)))), alpaca.take(np.arange(min(limit, len(alpaca.prompts))))
    weak_table, strong_table = tables(mmlu, alpaca)
    thresholds = {t: RoutePolicy(Policy.load(extra={"router": {"target": {"mode": "max_strong_share", "value": t}}}), router)
                  .rules(None, None).threshold for t in CURVE_TARGETS}  # fmt: skip
    apps = [replay_app(weak_table, "cost-model"), replay_app(strong_table, "strong-model")]
    runners, urls = [], []
    for app in apps:
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}/v1")
    rows = [("mmlu", p) for p in mmlu.prompts] + [("alpaca", p) for p in alpaca.prompts]
    began = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            state = Path(tmp)
            port = free_port()
            proc = start(gateway_cmd(gateway_config(state, *urls), state / "config.yaml", port),
                         f"http://127.0.0.1:{port}/readyz", state / "gateway.log", env={"HF_HUB_OFFLINE": "1"})
            try:
                results = await send_all(f"http://127.0.0.1:{port}", rows, concurrency)
            finally:
                stop(proc)
            ledger = ledger_rows(state)
    finally:
        for runner in runners:
            await runner.cleanup()
    # the header rounds the score to 3 decimals; the curve uses the ledger's exact one
    ledger_agrees = 0
    for i, result in enumerate(results):
        score, tier = ledger.get(f"tiers-{i}", (None, None))
        ledger_agrees += tier is not None and tier == result["tier"]
        if score is not None:
            result["score"] = float(score)
    seconds = time.perf_counter() - began
    k = len(mmlu.prompts)
    return {
        "what": "upstream tiers through a running gateway (shipped router and policy, edge off) in front of two "
                "replay upstreams answering as the recorded weak and strong models did, on the router's held-out "
                "MMLU subjects and AlpacaEval sources",
        "ledger_tier_matches_header": ledger_agrees,
        "setup": {"router_target": f"max_strong_share={SHIPPED_TARGET}", "mmlu_subjects": sorted(set(mmlu.subjects.tolist())),
                  "alpaca_sources": sorted(set(alpaca.subjects.tolist())), "concurrency": concurrency,
                  "completion_tokens": {"mmlu": MMLU_COMPLETION_TOKENS, "alpaca": ALPACA_COMPLETION_TOKENS},
                  "prompt_tokens": "characters / 4", "pricing": PRICING, "seconds": round(seconds, 1),
                  "mmlu_grading": "a fixed key letter per prompt (hash); the replay answers it where the recorded model "
                                  "was right, the next letter where it was wrong",
                  "alpaca_quality": "P(answer beats gpt4_1106_preview) by the recorded judge: weak pref - 1, strong 0.5"},
        "mmlu": source_report(mmlu.prompts, mmlu.weak.astype(float), mmlu.strong.astype(float), results[:k],
                              MMLU_COMPLETION_TOKENS, thresholds),
        "alpaca": source_report(alpaca.prompts, alpaca.weak, alpaca.strong, results[k:], ALPACA_COMPLETION_TOKENS, thresholds),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each source (a smoke run)")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    body = asyncio.run(run(args.limit, args.concurrency))
    body["targets"] = {"mmlu_cost_at_0.95_quality": "cost <= 0.50 x all-strong at >= 0.95 x all-strong quality "
                       "(per-token pricing, cost tier 1/10)", "quality_gain_over_random": ">= 0.03 at the shipped target",
                       "strong_share_error": "within +-0.05 of the shipped target"}
    body["verdicts"] = verdicts("tiers", body)
    print(write("tiers", body) if not args.limit else body["verdicts"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
