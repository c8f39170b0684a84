"""Agent sessions through the gateway, billed by a provider that caches prompt prefixes.

Writes bench/results/agent_sessions.json. Two steps, both with real processes:

1. Record: each pinned CLI (Claude Code over Messages, Codex over Responses) reads the files of a
   checked-out project (this repository's own sources: `--files` of them, one model call each)
   against a scripted model (tests/support/agent_model.py) that asks for the CLI's own read tool
   file after file; a recording proxy keeps every request the CLI sent, so the tool outputs in it
   are the CLI's own and their sizes real.
2. Replay: each recorded session is sent again, request by request, through a gateway process in
   each configuration to a pricing upstream that bills the way Anthropic and OpenAI do: the part
   of a prompt that a request within the TTL already sent (whole tools and messages, in order) is
   a cache read, the rest a cache write; list prices read 0.1x, write 1.25x the input price.

Configurations, each adding to the one before:
- `pass_through`: the gateway with every saving off;
- `prefix_stable`: the shipped trim policy (lossless passes that keep a message's bytes wherever
  it stands, tool results and code left whole) and the session sent as `prompt_cache_key`;
- `masking`: observation masking on (trim.agent_context, cache-aligned, priced steps).

Per configuration: billed USD per session, the ratio to pass-through, the cached-read share of
input, cache writes, tokens masked, requests per lane, the gateway's added time per turn (its
`x-tierlane-overhead-ms`), whether every tool result reached the upstream whole on its first
appearance, and broken tool pairs. Task success under masking is not measured here (the scripted
model does not read what it is sent); the cited paper's figures are its own.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/agent_sessions.py [--files 32]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import sqlite3
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import REPO, free_port, gateway_cmd, pct, start, stop, write
from policies.trim.messages import estimate_tokens
from tests.integration.test_agent_reads import agent_tool_results
from tests.support import agents
from tests.support.agent_model import MODEL, AgentModel
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.recording_proxy import RecordingProxy

# USD per M tokens at Anthropic's list ratios (cache read 0.1x, write 1.25x input): the strong tier
# (what the agent asked for) and the cost tier a session may be routed to
PRICES = {"strong": {"input": 3.0, "cached_input": 0.3, "cache_write": 3.75, "output": 15.0},
          "cost": {"input": 1.0, "cached_input": 0.1, "cache_write": 1.25, "output": 5.0}}
MODELS = {"strong": "strong-model", "cost": "cost-model"}
TTL_S = 300.0
ALIASES = {"claude-*": "auto", "gpt-*": "auto"}
REPLAY_HEADERS = ("content-type", "anthropic-version", "anthropic-beta", "x-app", "user-agent", "session_id",
                  "x-claude-code-session-id", "originator", "conversation_id", "chatgpt-account-id", "openai-beta")


# The pricing upstream -------------------------------------------------------------------------


@dataclass
class Billed:
    session: str | None
    read: int
    written: int
    output: int
    body: dict[str, Any]
    tier: str = "strong"

    @property
    def usd(self) -> float:
        price = PRICES[self.tier]
        return (self.read * price["cached_input"] + self.written * price["cache_write"] + self.output * price["output"]) / 1e6


@dataclass
class PricingUpstream:
    """A chat upstream that caches prompt prefixes in whole tools/messages and bills reads and writes."""

    tier: str = "strong"  # whose prices, and its own cache: a switch of tier starts cold
    seen: dict[bytes, float] = field(default_factory=dict)  # chained prefix hash -> last sent
    billed: list[Billed] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODELS[self.tier], "object": "model",
                                                              "owned_by": "bench"}]})

    def _bill(self, body: dict[str, Any]) -> tuple[int, int]:
        now = time.monotonic()
        chunks = [orjson.dumps(body.get("tools") or [])] + [orjson.dumps(m) for m in body.get("messages") or ()]
        chained, read, written, cold = b"", 0, 0, False
        for chunk in chunks:
            chained = hashlib.blake2b(chained + chunk, digest_size=16).digest()
            tokens = estimate_tokens(chunk.decode())
            if not cold and now - self.seen.get(chained, -1e18) <= TTL_S:
                read += tokens
            else:
                cold = True
                written += tokens
            self.seen[chained] = now
        return read, written

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        read, written = self._bill(body)
        text = "Noted."
        output = estimate_tokens(text) + 1
        self.billed.append(Billed(body.get("prompt_cache_key"), read, written, output, body, self.tier))
        usage = {"prompt_tokens": read + written, "completion_tokens": output, "total_tokens": read + written + output,
                 "prompt_tokens_details": {"cached_tokens": read}}
        ident, created = "chatcmpl-" + uuid.uuid4().hex[:12], int(time.time())
        message = {"role": "assistant", "content": text}
        if not body.get("stream"):
            return web.json_response({"id": ident, "object": "chat.completion", "created": created, "model": MODELS[self.tier],
                                      "choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        def chunk(delta: dict[str, Any], reason: str | None = None, extra: dict[str, Any] | None = None) -> bytes:
            data = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": MODELS[self.tier],
                    "choices": [{"index": 0, "delta": delta, "finish_reason": reason}] if extra is None else [], **(extra or {})}
            return b"data: " + orjson.dumps(data) + b"\n\n"

        await response.write(chunk({"role": "assistant", "content": ""}))
        await response.write(chunk({"content": text}))
        await response.write(chunk({}, "stop"))
        await response.write(chunk({}, extra={"usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        return response


# Recording ----------------------------------------------------------------------------------


def sources(n: int) -> list[Path]:
    """Real files of a checked-out project: this repository's Python sources, largest first."""
    files = [p for p in sorted((REPO / "gateway").rglob("*.py")) + sorted((REPO / "policies").rglob("*.py"))
             if p.stat().st_size > 2000]
    files.sort(key=lambda p: (-p.stat().st_size, str(p)))
    return sorted(files[:n])


def record(bg: BackgroundLoop, agent: agents.Agent, files: list[Path], tmp: Path, label: str = "") -> list[dict[str, Any]]:
    name = f"{agent.name}{label}"
    work = tmp / f"work-{name}"
    work.mkdir()
    names = []
    for source in files:
        target = work / source.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
        names.append(str(target))
    scripted = AgentModel(files=names, quote_chars=20)
    upstream = RunningApp(bg, scripted.app())
    from gateway.app import create_app
    from gateway.settings import Settings

    config = copy.deepcopy(PASS_THROUGH)
    config.update({"state_dir": str(tmp / f"record-{name}"), "model_aliases": ALIASES,
                   "upstreams": [upstream_cfg("model", upstream.url + "/v1", models=[MODEL])]})
    gw = RunningApp(bg, create_app(Settings.load(env={}, overrides=config)))
    proxy_state = RecordingProxy(gw.url)
    proxy = RunningApp(bg, proxy_state.app())
    try:
        out = agents.run(agent, proxy.url, work, tmp / f"home-{name}", "Read every file listed in turn.",
                         timeout=900)
        if out.returncode != 0:
            raise RuntimeError(f"{agent.name} failed: {out.stderr[-2000:]}")
    finally:
        proxy.stop()
        gw.stop()
        upstream.stop()
    return [{"path": r.path, "headers": {str(k): v for k, v in r.headers.items() if k.lower() in REPLAY_HEADERS},
             "body": orjson.loads(r.body)} for r in proxy_state.requests if r.method == "POST" and r.body]


# Replay -------------------------------------------------------------------------------------


def configurations(urls: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each configuration adds to the one before; the first three send everything to the strong tier."""
    base = copy.deepcopy(PASS_THROUGH)
    base["model_aliases"] = ALIASES
    # the gateway prices its ledger, and weighs masking's steps, with the same prices the provider bills
    base["policy"]["pricing"] = {"models": {MODELS[tier]: dict(price) for tier, price in PRICES.items()}}
    strong = upstream_cfg("strong", urls["strong"], models=[MODELS["strong"]], pool="critical")
    keyed = [{**strong, "prompt_cache_key": True}]
    shipped = copy.deepcopy(base)
    del shipped["policy"]["trim"]
    masking = copy.deepcopy(shipped)
    masking["policy"]["trim"] = {"agent_context": {"mode": "on"}}
    tiers = {"cost": {"pool": "standard", "model": MODELS["cost"]}, "strong": {"pool": "critical", "model": MODELS["strong"]}}
    background = copy.deepcopy(masking)
    background["policy"]["lanes"] = {"upstream": {"pool": "critical", "tiers": tiers},
                                     "agents": {"background": {"enabled": True}}}
    sessions = copy.deepcopy(background)
    sessions["embedder"] = {"enabled": True}
    sessions["policy"]["router"] = {"enabled": True}
    sessions["policy"]["lanes"]["agents"]["session_tiers"] = {"enabled": True}
    both = [*keyed, {**upstream_cfg("cost", urls["cost"], models=[MODELS["cost"]], pool="standard"), "prompt_cache_key": True}]
    return {
        "pass_through": {**base, "upstreams": [strong]},
        "prefix_stable": {**shipped, "upstreams": keyed},
        "masking": {**masking, "upstreams": keyed},
        "background": {**background, "upstreams": both},
        "session_tiers": {**sessions, "upstreams": both},
    }


async def replay(url: str, session: list[dict[str, Any]], progress: Any) -> list[float]:
    overheads = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
        for request in session:
            headers = {**request["headers"], "Authorization": "Bearer bench", "x-api-key": "bench"}
            async with client.post(url + request["path"], data=orjson.dumps(request["body"]), headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{request['path']} answered {resp.status}: {(await resp.text())[:300]}")
                if "x-tierlane-overhead-ms" in resp.headers:
                    overheads.append(float(resp.headers["x-tierlane-overhead-ms"]))
            progress.update(1)
    return overheads


def ledger(state: Path) -> list[dict[str, Any]]:
    conn = sqlite3.connect(state / "ledger.sqlite3")
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM requests ORDER BY id")]
    finally:
        conn.close()


def whole_and_paired(session: list[dict[str, Any]], billed: list[Billed]) -> tuple[int, int, int]:
    """(tool results whole on first appearance, tool results seen, broken tool pairs) upstream."""
    class _Rec:
        def __init__(self, body: dict[str, Any]) -> None:
            self.method, self.body = "POST", orjson.dumps(body)

    sent = agent_tool_results([_Rec(r["body"]) for r in session])
    first: dict[str, str] = {}
    broken = 0
    for b in billed:
        calls = {c.get("id") for m in b.body.get("messages") or () for c in m.get("tool_calls") or ()}
        for message in b.body.get("messages") or ():
            if message.get("role") == "tool":
                first.setdefault(message["tool_call_id"], message.get("content"))
                broken += message["tool_call_id"] not in calls
    whole = sum(1 for k, v in first.items() if sent.get(k) == v)
    return whole, len(first), broken


async def run_configuration(name: str, config: dict[str, Any], sessions: dict[str, list[dict[str, Any]]],
                            upstreams: list[PricingUpstream], tmp: Path) -> dict[str, Any]:
    port = free_port()
    state = tmp / f"state-{name}"
    config = {**config, "state_dir": str(state)}
    proc = start(gateway_cmd(config, tmp / f"{name}.yaml", port), f"http://127.0.0.1:{port}/healthz", tmp / f"{name}.log",
                 env={"HF_HUB_OFFLINE": "1"})
    out: dict[str, Any] = {}
    seen_rows = 0
    try:
        for agent, session in sessions.items():
            for upstream in upstreams:
                upstream.seen.clear()
                upstream.billed.clear()
            with tqdm(total=len(session), desc=f"{name}/{agent}", unit="req", leave=False) as bar:
                overheads = await replay(f"http://127.0.0.1:{port}", session, bar)
            async with aiohttp.ClientSession() as client:  # /v1/usage writes the ledger out
                async with client.get(f"http://127.0.0.1:{port}/v1/usage", headers={"Authorization": "Bearer bench"}) as r:
                    await r.read()
            rows = [r for r in ledger(state) if r["id"] > seen_rows]
            seen_rows = max([seen_rows, *(r["id"] for r in rows)])
            billed = [b for upstream in upstreams for b in upstream.billed]
            read, written = sum(b.read for b in billed), sum(b.written for b in billed)
            whole, results, broken = whole_and_paired(session, billed)
            tiers = {tier: sum(1 for b in billed if b.tier == tier) for tier in PRICES}
            out[agent] = {"requests": len(session), "upstream_requests": len(billed), "upstream_requests_per_tier": tiers,
                          "billed_usd": round(sum(b.usd for b in billed), 6),
                          "input_tokens": read + written, "cache_read_tokens": read, "cache_write_tokens": written,
                          "cached_read_share": round(read / max(1, read + written), 4),
                          "tool_results": results, "tool_results_whole_first": whole, "broken_tool_pairs": broken,
                          "added_ms_p50": round(pct(overheads, 0.5), 3), "added_ms_p99": round(pct(overheads, 0.99), 3),
                          "masked_tokens": sum(int(r.get("masked_tokens") or 0) for r in rows),
                          "route_reasons": sorted({str(r.get("route_reason")) for r in rows if r["lane"] == "upstream"})}
        rows = ledger(state)
        lanes: dict[str, int] = {}
        for row in rows:
            lane = row["lane"] if row["lane"] != "upstream" or not row.get("tier") else f"upstream:{row['tier']}"
            lanes[lane] = lanes.get(lane, 0) + 1
        out["requests_per_lane"] = lanes
    finally:
        stop(proc)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=32, help="files each agent reads: one model call each, plus its answer")
    parser.add_argument("--long-files", type=int, default=100,
                        help="files a longer Claude Code session reads (Codex's sandboxed reads are too slow for it)")
    parser.add_argument("--sessions", type=Path, help="a JSON file of recorded sessions: replayed if it exists, else "
                        "written after recording (to compare changes on the same recording)")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="agent-sessions-"))
    bg = BackgroundLoop()
    files = sources(args.files)
    sessions: dict[str, list[dict[str, Any]]] = {}
    if args.sessions is not None and args.sessions.exists():
        sessions = orjson.loads(args.sessions.read_bytes())
    else:
        for agent in tqdm([agents.CLAUDE, agents.CODEX], desc="recording", unit="agent"):
            sessions[agent.name] = record(bg, agent, files, tmp)
        if args.long_files:
            sessions["claude-long"] = record(bg, agents.CLAUDE, sources(args.long_files), tmp, label="long")
        if args.sessions is not None:
            args.sessions.write_bytes(orjson.dumps(sessions))
    upstreams = [PricingUpstream(tier) for tier in PRICES]
    running = [RunningApp(bg, upstream.app()) for upstream in upstreams]
    results: dict[str, Any] = {}
    try:
        urls = {upstream.tier: app.url + "/v1" for upstream, app in zip(upstreams, running)}
        for name, config in tqdm(list(configurations(urls).items()), desc="configurations", unit="config"):
            results[name] = bg.call(run_configuration(name, config, sessions, upstreams, tmp), timeout=3600)
    finally:
        for app in running:
            app.stop()
    base = results["pass_through"]
    for r in results.values():
        for agent in sessions:
            r[agent]["billed_vs_pass_through"] = round(r[agent]["billed_usd"] / max(1e-12, base[agent]["billed_usd"]), 4)
            r[agent]["cached_share_minus_pass_through"] = round(
                r[agent]["cached_read_share"] - base[agent]["cached_read_share"], 4)
    data = {"files_read": len(files), "file_bytes": sum(p.stat().st_size for p in files),
            "model_calls": {agent: sum(1 for r in s if r["path"] in ("/v1/messages", "/v1/responses"))
                            for agent, s in sessions.items()},
            "prices_usd_per_m": PRICES, "ttl_s": TTL_S, "results": results,
            "shipped": "prefix_stable", "everything_on": "session_tiers",
            "note": "masking's effect on task success is not measured here; the scripted model does not read its input"}
    path = write("agent_sessions", data)
    print(orjson.dumps({n: {a: (r[a]["billed_vs_pass_through"], r[a]["cached_read_share"]) for a in sessions}
                        for n, r in results.items()}).decode())
    print(f"wrote {path}")
    bg.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
