"""Checkable tasks through a running gateway (model `auto`), with an upstream that answers right.

The upstream is a fixed-answer stand-in for a strong model: a loopback server that answers each
task with its expected answer (OpenAI JSON and SSE), so every request the gateway sends upstream
is answered correctly and the figures isolate what the gateway keeps local. Each task is sent:

- pinned to the edge (`x-tierlane-route: edge`): is the edge model right on it at all;
- with model `auto` through gateways with the shipped policy and with variants (the cascade off,
  i.e. the router alone decides, as before the cascade existed): which lane answered, and right?

Streams are timed on a sample the edge serves, with the shipped hold-back and with none, for the
cascade's cost in time to first token. Used by bench/edge_quality.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import free_port, gateway_cmd, pct, start, stop
from policies.edge_quality.checkers import is_correct
from policies.edge_quality.probes import Probe

UPSTREAM_MODEL = "strong-stand-in"
LABELS = "ABCD"


def right_answer(probe: Probe) -> str:
    """What the stand-in answers: the expected answer, as a strong model would phrase it."""
    if probe.check == "choice" and probe.choices:
        index = LABELS.index(probe.answer) if probe.answer in LABELS else 0
        return f"{probe.answer}. {probe.choices[index]}"
    return probe.answer


def upstream_app(answers: dict[str, str]) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = next((m.get("content") for m in reversed(body.get("messages") or []) if m.get("role") == "user"), "")
        text = answers.get(prompt if isinstance(prompt, str) else "", "I do not know.")
        usage = {"prompt_tokens": max(1, len(str(prompt)) // 4), "completion_tokens": max(1, len(text) // 4)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        base = {"id": "chatcmpl-standin", "created": int(time.time()), "model": UPSTREAM_MODEL}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop", "logprobs": None}
            return web.json_response({**base, "object": "chat.completion", "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delta, finish in (({"role": "assistant", "content": ""}, None), ({"content": text}, None), ({}, "stop")):
            chunk = {**base, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(f"data: {json.dumps({**base, 'object': 'chat.completion.chunk', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": UPSTREAM_MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


def gateway_config(upstream_url: str, state_dir: Path, cascade: dict[str, Any]) -> dict[str, Any]:
    return {
        "state_dir": str(state_dir),
        "upstreams": [{"name": "strong", "base_url": upstream_url, "models": [UPSTREAM_MODEL]}],
        "telemetry": {"tracing": False},
        "policy": {"cascade": cascade},
    }


async def _send(session: aiohttp.ClientSession, url: str, probe: Probe, *, pinned: bool, stream: bool = False,
                max_tokens: int = 48) -> dict[str, Any]:
    body = {"model": "auto", "messages": probe.messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    headers = {"x-tierlane-route": "edge"} if pinned else {}
    if stream:
        headers["Cache-Control"] = "no-cache"  # timed on the lane, never on an earlier run's cache entry
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        lane_header = resp.headers.get("x-tierlane-lane", "")
        cache = resp.headers.get("x-tierlane-cache")
        if resp.status != 200:
            return {"id": probe.id, "status": resp.status, "error": (await resp.text())[:200], "lane": "error"}
        ttft = None
        if stream:
            parts: list[str] = []
            finish = None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(piece or "")
                    finish = choice.get("finish_reason") or finish
            text = "".join(parts)
        else:
            payload = await resp.json()
            choice = payload["choices"][0]
            text, finish = choice["message"]["content"] or "", choice["finish_reason"]
    lane = "cache" if cache == "hit" else lane_header.split(";")[0].split(":")[0]
    confidence = re.search(r"confidence=([0-9.]+)", lane_header)
    return {
        "id": probe.id, "status": 200, "lane": lane, "header": lane_header, "escalated": "escalated" in lane_header,
        "confidence": float(confidence.group(1)) if confidence else None,
        "correct": is_correct(probe, text, finish or "stop"), "ttft_s": ttft, "latency_s": time.perf_counter() - t0,
    }


async def _run(url: str, probes: Sequence[Probe], label: str, concurrency: int, **kwargs: Any) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(probes), desc=label, unit="task")
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(probe: Probe) -> dict[str, Any]:
            async with gate:
                out = await _send(session, url, probe, **kwargs)
                bar.update(1)
                return out

        results = await asyncio.gather(*(one(p) for p in probes))
    bar.close()
    return list(results)


async def _metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("tierlane_edge_escalated_tokens_total", "tierlane_tokens_total"):
            if line.startswith(name + "{") and ('lane="edge"' in line or name.startswith("tierlane_edge")):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def figures(pinned: Sequence[dict[str, Any]], auto: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Local precision and recall, overall accuracy, edge share and escalations of one auto run."""
    right_when_pinned = {r["id"] for r in pinned if r.get("correct")}
    ok = [r for r in auto if r["status"] == 200]
    local = [r for r in ok if r["lane"] in ("edge", "cache")]
    kept_right = [r for r in local if r["id"] in right_when_pinned]
    n = len(auto)
    return {
        "tasks": n,
        "errors": n - len(ok),
        "kept_local": len(local),
        "kept_local_right": sum(bool(r["correct"]) for r in local),
        "right_when_pinned": len(right_when_pinned),
        "local_share": round(len(local) / n, 4) if n else None,
        "edge_share": round(sum(r["lane"] == "edge" for r in ok) / n, 4) if n else None,
        "cache_share": round(sum(r["lane"] == "cache" for r in ok) / n, 4) if n else None,
        "local_precision": round(sum(r["correct"] for r in local) / len(local), 4) if local else None,
        "local_recall": round(len(kept_right) / len(right_when_pinned), 4) if right_when_pinned else None,
        "overall_accuracy": round(sum(bool(r.get("correct")) for r in auto) / n, 4) if n else None,
        "upstream_only_accuracy": 1.0,
        "upstream_calls_saved": len(local),
        "escalated": sum(r["escalated"] for r in ok),
        "escalated_share_of_edge_tried": round(
            sum(r["escalated"] for r in ok) / max(1, sum(r["escalated"] or r["lane"] == "edge" for r in ok)), 4),
    }


def _ttft(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    values = [r["ttft_s"] * 1000 for r in results if r.get("ttft_s") is not None and r["lane"] == "edge"]
    return {"n": len(values), "p50_ms": round(pct(values, 0.5), 1) if values else None,
            "p99_ms": round(pct(values, 0.99), 1) if values else None,
            "mean_ms": round(statistics.fmean(values), 1) if values else None}


class Gateway:
    """A gateway process on loopback over the stand-in upstream."""

    def __init__(self, tmp: Path, upstream_url: str, cascade: dict[str, Any], name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        state = tmp / name
        state.mkdir(parents=True, exist_ok=True)
        cmd = gateway_cmd(gateway_config(upstream_url, state, cascade), state / "config.yaml", self.port)
        self.proc = start(cmd, self.url + "/readyz", state / "gateway.log", env={"HF_HUB_OFFLINE": "1"})

    def close(self) -> None:
        stop(self.proc)


async def evaluate(probes: Sequence[Probe], *, concurrency: int = 4, stream_sample: int = 40) -> dict[str, Any]:
    """Every figure of the gateway run; `probes` are held-out tasks never used in calibration."""
    answers = {p.prompt: right_answer(p) for p in probes}
    runner = web.AppRunner(upstream_app(answers))
    await runner.setup()
    up_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", up_port).start()
    upstream_url = f"http://127.0.0.1:{up_port}/v1"
    out: dict[str, Any] = {"upstream": "fixed-answer stand-in (answers every task with its expected answer)"}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        try:
            shipped = Gateway(tmp, upstream_url, {}, "shipped")
            try:
                pinned = await _run(shipped.url, probes, "pinned to edge", concurrency, pinned=True)
                auto = await _run(shipped.url, probes, "auto, shipped policy", concurrency, pinned=False)
                metrics = await _metrics(shipped.url)
            finally:
                shipped.close()
            router_only = Gateway(tmp, upstream_url, {"enabled": False}, "router_only")
            try:
                before = await _run(router_only.url, probes, "auto, router only", concurrency, pinned=False)
            finally:
                router_only.close()
            # The hold-back's cost in time to first token: the same prompts streamed through the
            # cascade with and without it, every answer kept (confidence threshold 0), one at a time.
            sample = [p for p, r in zip(probes, auto, strict=True) if r["lane"] == "edge" or r["escalated"]][:stream_sample]
            timed: dict[str, list[dict[str, Any]]] = {}
            for name, hold in (("hold_back", {}), ("no_hold_back", {"hold_tokens": 0})):
                gateway = Gateway(tmp, upstream_url, {"target": {"mode": "threshold", "value": 0.0}, **hold}, name)
                try:
                    timed[name] = await _run(gateway.url, sample, f"streams, {name}", 1, pinned=False, stream=True)
                finally:
                    gateway.close()
        finally:
            await runner.cleanup()
    edge_tokens = metrics.get("tierlane_tokens_total", 0.0)
    wasted = metrics.get("tierlane_edge_escalated_tokens_total", 0.0)
    out.update({
        "pinned_edge_accuracy": round(sum(bool(r.get("correct")) for r in pinned) / len(pinned), 4),
        "shipped": figures(pinned, auto),
        "router_only": figures(pinned, before),
        "escalated_edge_tokens_share": round(wasted / (wasted + edge_tokens), 4) if wasted + edge_tokens else None,
        "stream_ttft": {name: _ttft(results) for name, results in timed.items()},
        "stream_ttft_note": "edge-served streams, sequential, every answer kept (confidence threshold 0); "
                            "hold_back: the shipped cascade.hold_tokens",
        "records": {"pinned": pinned, "auto": auto, "router_only": before},
    })
    return out
