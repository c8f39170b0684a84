"""What a failed edge attempt costs a request in time to first byte.

Two gateways with the bundled edge model in front of the same loopback upstream (an instant
stand-in, bench/edge_quality_gateway.py): one whose cascade never tries the edge (prior threshold
1), one whose cascade tries every `auto` request on the edge and escalates every answer
(prior threshold 0, confidence threshold 1; learning off so neither changes its mind). The same
everyday OpenAssistant prompts go through both, one at a time, as streams (checked after
`hold_tokens`) and as whole answers (checked after the calibration's 48 tokens, or at the end).
The difference in time to first byte is the price of an escalation; the upstream answers
instantly, so it is all edge time. A third gateway escalates every answer too, with the shipped
deadline per attempt (`cascade.deadline_slack`, `deadline_min_s`); the second runs without it.
`--concurrency N` sends N at a time (the loaded case; results in edge_escalation_ttfb_cN.json).
Results: bench/results/edge_escalation_ttfb.json.

    HF_HUB_OFFLINE=1 python bench/edge_escalation_ttfb.py [--prompts 20] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import free_port, gateway_cmd, pct, start, stop, write
from bench.edge_quality_gateway import gateway_config, upstream_app

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "router" / "oasst_en_100_text.jsonl"
NEVER = {"prior": {"mode": "threshold", "value": 1.0}, "learn": {"enabled": False}}
ALWAYS_ESCALATE = {"prior": {"mode": "threshold", "value": 0.0}, "target": {"mode": "threshold", "value": 1.0},
                   "learn": {"enabled": False}, "deadline_slack": 0.0}
# the same with the shipped deadline per attempt (policies/defaults/cascade.yaml)
ESCALATE_BY_DEADLINE = {**{k: v for k, v in ALWAYS_ESCALATE.items() if k != "deadline_slack"}}


def prompts(n: int) -> list[str]:
    path = DATA if DATA.exists() else Path("/work/shared/data/router/oasst_en_100_text.jsonl")
    texts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [t for t in texts if isinstance(t, str) and len(t) < 400][:n]


async def _one(session: aiohttp.ClientSession, url: str, text: str, stream: bool) -> dict[str, Any]:
    body = {"model": "auto", "messages": [{"role": "user", "content": text}], "max_tokens": 64, "temperature": 0,
            "stream": stream}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body, headers={"Cache-Control": "no-cache, no-store"}) as resp:
        header = resp.headers.get("x-tierlane-lane", "")
        first: float | None = None
        async for _ in resp.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
        return {"status": resp.status, "ttfb_s": first, "total_s": time.perf_counter() - t0, "header": header}


async def measure(url: str, texts: list[str], concurrency: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await _one(session, url, "warm up", False)
        await _one(session, url, "warm up again", True)  # the engine times a lone decode step (the deadline's unit)

        async def gated(text: str, stream: bool) -> dict[str, Any]:
            async with gate:
                return await _one(session, url, text, stream)

        for stream in (True, False):
            rows = list(await asyncio.gather(*(gated(t, stream) for t in texts)))
            ok = [r for r in rows if r["status"] == 200 and r["ttfb_s"] is not None]
            ttfb = [r["ttfb_s"] * 1000 for r in ok]
            out["stream" if stream else "whole"] = {
                "requests": len(rows), "ok": len(ok),
                "escalated": sum("escalated" in r["header"] for r in ok),
                "past_deadline": sum("(deadline)" in r["header"] for r in ok),
                "ttfb_ms": {"p50": round(pct(ttfb, 0.5), 1), "p90": round(pct(ttfb, 0.9), 1), "mean": round(sum(ttfb) / max(1, len(ttfb)), 1)},
            }
    return out


async def main(n: int, concurrency: int) -> dict[str, Any]:
    texts = prompts(n)
    up_port = free_port()
    runner = web.AppRunner(upstream_app({}))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", up_port).start()
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, cascade in (("edge_never_tried", NEVER), ("edge_always_escalates", ALWAYS_ESCALATE),
                                  ("edge_always_escalates_with_deadline", ESCALATE_BY_DEADLINE)):
                state = Path(tmp) / name
                state.mkdir()
                port = free_port()
                cmd = gateway_cmd(gateway_config(f"http://127.0.0.1:{up_port}/v1", state, cascade), state / "config.yaml", port)
                proc = start(cmd, f"http://127.0.0.1:{port}/readyz", state / "gateway.log", env={"HF_HUB_OFFLINE": "1"})
                try:
                    results[name] = await measure(f"http://127.0.0.1:{port}", texts, concurrency)
                finally:
                    stop(proc)
    finally:
        await runner.cleanup()
    cost = {
        f"{kind}{suffix}": {q: round(results[run][kind]["ttfb_ms"][q] - results["edge_never_tried"][kind]["ttfb_ms"][q], 1)
                            for q in ("p50", "p90", "mean")}
        for kind in ("stream", "whole")
        for suffix, run in (("", "edge_always_escalates"), ("_with_deadline", "edge_always_escalates_with_deadline"))
    }
    return {"setup": {"prompts": len(texts), "source": "OpenAssistant first prompts (oasst_en_100_text)", "max_tokens": 64,
                      "concurrency": concurrency, "upstream": "loopback stand-in answering at once"},
            "runs": results, "escalation_ttfb_cost_ms": cost}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    body = asyncio.run(main(args.prompts, args.concurrency))
    print(json.dumps(body["escalation_ttfb_cost_ms"], indent=2))
    print(write("edge_escalation_ttfb" if args.concurrency == 1 else f"edge_escalation_ttfb_c{args.concurrency}", body))
