"""Agent sessions through the gateway, billed by a provider that caches prompt prefixes.

Writes bench/results/agent_sessions.json (or `--out`). Two steps, both with real processes:

1. Record: each pinned CLI (Claude Code over Messages, Codex over Responses) works in a
   checked-out project (copies of this repository's own sources: `--files` of them) against a
   scripted model (tests/support/agent_model.py) that asks for the CLI's own tools step by step:
   with `--script mixed` (the default) it reads each file, every third file searches the tree for
   a name the file defines (grep through Claude Code's Bash, Codex's exec_command), and every
   fourth file replaces one line of a file read earlier (Claude Code's Edit, Codex's apply_patch),
   one model call a step; `--script read` only reads. A recording proxy keeps every request the
   CLI sent, so the tool outputs in it are the CLI's own and their sizes real; the edits are
   checked in the work dir's files afterwards (`recording`).
2. Replay: each recorded session is sent again, request by request, through a gateway process in
   each configuration to a pricing upstream (bench/pricing_upstream.py) that bills the way OpenAI
   and Anthropic's automatic prefix caching does: the part of a prompt that a request within the
   TTL already sent (whole tools and messages, in order) is a cache read, the rest a cache write;
   list prices read 0.1x, write 1.25x the input price.

Configurations, each adding to the one before:
- `pass_through`: the gateway with every saving off;
- `prefix_stable`: the shipped trim policy (lossless passes that keep a message's bytes wherever
  it stands, tool results and code left whole) and the session sent as `prompt_cache_key`;
- `masking`: observation masking on (trim.agent_context, cache-aligned, priced steps);
- `background`, `session_tiers`: the agents' background lane, then session tiers, on top.

Per configuration: billed USD per session, the ratio to pass-through, the cached-read share of
input, cache writes, tokens masked, requests per lane, the gateway's added time per turn (its
`x-tierlane-overhead-ms`), whether every tool result reached the upstream whole on its first
appearance, and broken tool pairs. Task success under masking is not measured here (the scripted
model does not read what it is sent); the cited paper's figures are its own.

`anthropic_upstream`: the same sessions through the shipped policy to a provider that bills
Anthropic's explicit `cache_control` breakpoints (and whose chat endpoint caches nothing):
`anthropic_chat_compat`, `anthropic_messages` (a member with `apis: [messages]`: the gateway
sends Messages with its own breakpoints) and `anthropic_native` (`apis: [chat, messages]`: a
Messages client's body goes as sent); a session a configuration cannot serve carries `error`.

`masking_floor`: bounds from each recorded session itself (bench/masking_floor.py): the bill if
every tool result older than the last `--keep` model calls cost nothing to drop (an oracle), and
the bill if nothing already sent were read again.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/agent_sessions.py [--files 32] [--script mixed|read]
        [--sessions recorded.json] [--out results.json]
"""

from __future__ import annotations

import argparse
import copy
import re
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import REPO, free_port, gateway_cmd, machine, pct, start, stop, write
from bench.masking_floor import bounds
from bench.pricing_upstream import MODELS, PRICES, TTL_S, Billed, PricingUpstream
from tests.integration.test_agent_reads import agent_tool_results
from tests.support import agents
from tests.support.agent_model import MODEL, AgentModel, Step
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.recording_proxy import RecordingProxy

ALIASES = {"claude-*": "auto", "gpt-*": "auto"}
REPLAY_HEADERS = ("content-type", "anthropic-version", "anthropic-beta", "x-app", "user-agent", "session_id",
                  "x-claude-code-session-id", "originator", "conversation_id", "chatgpt-account-id", "openai-beta")
# what each CLI needs to edit and search without asking: Claude Code's edits accepted and its grep
# allowed; Codex's sandbox writable in its work dir
PERMISSIONS = {"claude": ["--permission-mode", "acceptEdits", "--allowedTools", "Bash(grep:*)"],
               "codex": ["--sandbox", "workspace-write"]}
EDIT_MARK = "  # reviewed"


# Recording ----------------------------------------------------------------------------------


def sources(n: int) -> list[Path]:
    """Real files of a checked-out project: this repository's Python sources, largest first."""
    files = [p for p in sorted((REPO / "gateway").rglob("*.py")) + sorted((REPO / "policies").rglob("*.py"))
             if p.stat().st_size > 2000]
    files.sort(key=lambda p: (-p.stat().st_size, str(p)))
    return sorted(files[:n])


def _symbol(text: str) -> str | None:
    """A name the file defines (its first function or class of six characters or more): what to search for."""
    match = re.search(r"^\s*(?:async\s+)?(?:def|class)\s+(\w{6,})", text, re.MULTILINE)
    return match.group(1) if match else None


def _unique_line(text: str) -> str | None:
    """A line of code found once in `text` (an edit's old text): the first of 30 characters or more."""
    for line in text.split("\n"):
        stripped = line.strip()
        if len(stripped) >= 30 and not stripped.startswith(("#", '"', "'")) and text.count(line) == 1 and "\\" not in line:
            return line
    return None


def script(names: list[str], kind: str) -> list[Step]:
    """The steps an agent takes: each file read in turn; `mixed` also searches the tree for a name the
    file just read defines every third file, and every fourth file edits one line of the earliest
    file read and not yet edited (Claude Code edits only what it has read)."""
    steps: list[Step] = []
    unedited: list[str] = []
    for i, path in enumerate(names, 1):
        steps.append(Step(path))
        unedited.append(path)
        if kind != "mixed":
            continue
        text = Path(path).read_text()
        symbol = _symbol(text)
        if i % 3 == 0 and symbol:
            steps.append(Step(str(Path(path).parent), "search", pattern=symbol))
        if i % 4 == 0:
            while unedited:
                target = unedited.pop(0)
                line = _unique_line(Path(target).read_text())
                if line is not None:
                    steps.append(Step(target, "edit", old=line, new=line + EDIT_MARK))
                    break
    return steps


def edits_done(steps: list[Step], session: list[dict[str, Any]]) -> dict[str, int]:
    """What the recording did: steps by kind, edits found in the work dir's files afterwards, and
    tool results the CLI marked an error."""
    class _Rec:
        def __init__(self, body: dict[str, Any]) -> None:
            self.method, self.body = "POST", orjson.dumps(body)

    results = agent_tool_results([_Rec(r["body"]) for r in session])
    errors = sum(1 for text in results.values() if text.startswith("Error") or '"exit_code":1' in text
                 or "apply_patch verification failed" in text)
    edits = [s for s in steps if s.kind == "edit"]
    return {"reads": sum(1 for s in steps if s.kind == "read"), "searches": sum(1 for s in steps if s.kind == "search"),
            "edits": len(edits), "edits_in_files": sum(1 for s in edits if s.new in Path(s.path).read_text()),
            "tool_results": len(results), "tool_results_marked_error": errors}


def record(bg: BackgroundLoop, agent: agents.Agent, files: list[Path], tmp: Path, label: str = "",
           kind: str = "mixed") -> tuple[list[dict[str, Any]], dict[str, int]]:
    name = f"{agent.name}{label}"
    work = tmp / f"work-{name}"
    work.mkdir()
    names = []
    for source in files:
        target = work / source.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
        names.append(str(target))
    steps = script(names, kind)
    scripted = AgentModel(files=names, steps=steps, quote_chars=20)
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
        out = agents.run(agent, proxy.url, work, tmp / f"home-{name}", "Read, search and edit the files as asked.",
                         timeout=900, args=PERMISSIONS[agent.name])
        if out.returncode != 0:
            raise RuntimeError(f"{agent.name} failed: {out.stderr[-2000:]}")
    finally:
        proxy.stop()
        gw.stop()
        upstream.stop()
    session = [{"path": r.path, "headers": {str(k): v for k, v in r.headers.items() if k.lower() in REPLAY_HEADERS},
                "body": orjson.loads(r.body)} for r in proxy_state.requests if r.method == "POST" and r.body]
    return session, edits_done(steps, session)


# Replay -------------------------------------------------------------------------------------


def _base() -> dict[str, Any]:
    base = copy.deepcopy(PASS_THROUGH)
    base["model_aliases"] = ALIASES
    # the gateway prices its ledger, and weighs masking's steps, with the same prices the provider bills
    base["policy"]["pricing"] = {"models": {MODELS[tier]: dict(price) for tier, price in PRICES.items()}}
    return base


def _shipped() -> dict[str, Any]:
    shipped = _base()
    del shipped["policy"]["trim"]
    return shipped


def configurations(urls: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each configuration adds to the one before; the first three send everything to the strong tier."""
    base, shipped = _base(), _shipped()
    strong = upstream_cfg("strong", urls["strong"], models=[MODELS["strong"]], pool="critical")
    keyed = [{**strong, "prompt_cache_key": True}]
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


def anthropic_configurations(urls: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The shipped policy in front of an Anthropic-style provider (bench/pricing_upstream.py,
    `mode="anthropic"`), one member in three ways: its OpenAI-compatible chat endpoint (no caching);
    Messages only (`apis: ["messages"]`: the gateway sends Messages, placing cache breakpoints
    itself); chat and Messages (a Messages client's own body, its own breakpoints, goes natively)."""
    shipped = _shipped()

    def member(url: str, **extra: Any) -> list[dict[str, Any]]:
        return [{**upstream_cfg("anthropic", url, models=[MODELS["strong"]], pool="critical"), **extra}]

    return {
        "anthropic_chat_compat": {**shipped, "upstreams": member(urls["anthropic"])},
        "anthropic_messages": {**shipped, "upstreams": member(urls["anthropic_messages"], apis=["messages"])},
        "anthropic_native": {**shipped, "upstreams": member(urls["anthropic"], apis=["chat", "messages"])},
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
        if b.api == "messages":  # tool_result blocks, each answering a tool_use of the same request
            uses = {c.get("id") for m in b.body.get("messages") or () if isinstance(m.get("content"), list)
                    for c in m["content"] if isinstance(c, dict) and c.get("type") == "tool_use"}
            for call_id, text in agent_tool_results([_Rec(b.body)]).items():
                first.setdefault(call_id, text)
                broken += call_id not in uses
            continue
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
                upstream.reset()
            try:
                with tqdm(total=len(session), desc=f"{name}/{agent}", unit="req", leave=False) as bar:
                    overheads = await replay(f"http://127.0.0.1:{port}", session, bar)
            except RuntimeError as exc:  # e.g. a member the gateway cannot yet send this session's API to
                out[agent] = {"requests": len(session), "error": str(exc)}
                tqdm.write(f"{name}/{agent}: {exc}")
                continue
            async with aiohttp.ClientSession() as client:  # /v1/usage writes the ledger out
                async with client.get(f"http://127.0.0.1:{port}/v1/usage", headers={"Authorization": "Bearer bench"}) as r:
                    await r.read()
            rows = [r for r in ledger(state) if r["id"] > seen_rows]
            seen_rows = max([seen_rows, *(r["id"] for r in rows)])
            billed = [b for upstream in upstreams for b in upstream.billed]
            read, written, uncached = (sum(b.read for b in billed), sum(b.written for b in billed),
                                       sum(b.uncached for b in billed))
            total = read + written + uncached
            whole, results, broken = whole_and_paired(session, billed)
            tiers = {tier: sum(1 for b in billed if b.tier == tier) for tier in PRICES}
            apis = {api: sum(1 for b in billed if b.api == api) for api in ("chat", "messages")}
            out[agent] = {"requests": len(session), "upstream_requests": len(billed), "upstream_requests_per_tier": tiers,
                          "upstream_requests_per_api": apis, "billed_usd": round(sum(b.usd for b in billed), 6),
                          "input_tokens": total, "cache_read_tokens": read, "cache_write_tokens": written,
                          "uncached_tokens": uncached, "cached_read_share": round(read / max(1, total), 4),
                          "uncached_share": round(uncached / max(1, total), 4),
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


def replay_all(bg: BackgroundLoop, configs: Any, sessions: dict[str, list[dict[str, Any]]],
               upstreams: dict[str, PricingUpstream], tmp: Path, desc: str) -> dict[str, Any]:
    """Each configuration (`configs(urls)`, urls by upstream name) replayed on every session."""
    running = {name: RunningApp(bg, upstream.app()) for name, upstream in upstreams.items()}
    results: dict[str, Any] = {}
    try:
        urls = {name: app.url + "/v1" for name, app in running.items()}
        for name, config in tqdm(list(configs(urls).items()), desc=desc, unit="config"):
            results[name] = bg.call(run_configuration(name, config, sessions, list(upstreams.values()), tmp), timeout=3600)
    finally:
        for app in running.values():
            app.stop()
    return results


def compare(results: dict[str, Any], base_name: str, sessions: dict[str, Any]) -> None:
    """Each session's bill and cached share against `base_name`'s (sessions that failed there or here left out)."""
    base = results[base_name]
    for r in results.values():
        for agent in sessions:
            if "error" in r[agent] or "error" in base[agent]:
                continue
            r[agent][f"billed_vs_{base_name}"] = round(r[agent]["billed_usd"] / max(1e-12, base[agent]["billed_usd"]), 4)
            r[agent][f"cached_share_minus_{base_name}"] = round(r[agent]["cached_read_share"] - base[agent]["cached_read_share"], 4)


NOTES = [
    "masking's effect on task success is not measured here; the scripted model does not read its input",
    "masking_floor: bounds computed from each recorded session itself (no gateway; bench/masking_floor.py), billed as "
    "the prefix-caching provider bills, on the client's own requests: `pass_through` as sent; `oracle_mask` as if every "
    "tool result older than the last `keep_last_calls` model calls cost nothing and dropping it caused no cache write "
    "(no real masking reaches it: each drop rewrites the prefix after it); `write_once` as if nothing already sent were "
    "read again (each new part of the prompt written once, plus the answers): below it no cache can go. The issue's "
    "target is 0.6x pass-through on sessions of 30 model calls or more",
    "anthropic_upstream: the same sessions through the shipped policy to a provider billing the way Anthropic does: only "
    "blocks marked cache_control create cache entries (prefix up to the mark written at 1.25x unless cached within the "
    "TTL; a read is the longest prefix, ending at a mark or at one of the 20 blocks before it, written before; the rest "
    "of the input at 1x, `uncached_share`); its OpenAI-compatible chat endpoint caches nothing. `anthropic_chat_compat`: "
    "chat to that endpoint; `anthropic_messages`: a member with apis [messages], the gateway translating chat to "
    "Messages with breakpoints of its own (a session it cannot send there carries `error`); `anthropic_native`: a member "
    "with apis [chat, messages], Claude Code's own body and marks sent as they came",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=32, help="files each agent reads: one model call each, plus its answer")
    parser.add_argument("--long-files", type=int, default=100,
                        help="files a longer Claude Code session reads (Codex's sandboxed reads are too slow for it)")
    parser.add_argument("--script", choices=("read", "mixed"), default="mixed",
                        help="read: each file in turn; mixed: also a search every 3rd file and an edit every 4th")
    parser.add_argument("--sessions", type=Path, help="a JSON file of recorded sessions: replayed if it exists, else "
                        "written after recording (to compare changes on the same recording)")
    parser.add_argument("--keep", type=int, default=10, help="model calls whose tool results the masking floor keeps")
    parser.add_argument("--out", type=Path, help="write the results here instead of bench/results/agent_sessions.json")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="agent-sessions-"))
    bg = BackgroundLoop()
    files = sources(args.files)
    sessions: dict[str, list[dict[str, Any]]] = {}
    recording: dict[str, dict[str, int]] = {}
    checks = args.sessions.with_suffix(".checks.json") if args.sessions is not None else None
    if args.sessions is not None and args.sessions.exists():
        sessions = orjson.loads(args.sessions.read_bytes())
        recording = orjson.loads(checks.read_bytes()) if checks is not None and checks.exists() else {}
    else:
        todo = [(agents.CLAUDE, files, ""), (agents.CODEX, files, "")]
        if args.long_files:
            todo.append((agents.CLAUDE, sources(args.long_files), "-long"))
        for agent, sources_, label in tqdm(todo, desc="recording", unit="session"):
            sessions[agent.name + label], recording[agent.name + label] = record(bg, agent, sources_, tmp, label, args.script)
        if args.sessions is not None and checks is not None:
            args.sessions.write_bytes(orjson.dumps(sessions))
            checks.write_bytes(orjson.dumps(recording))
    prefix = {tier: PricingUpstream(tier) for tier in PRICES}
    results = replay_all(bg, configurations, sessions, prefix, tmp, "configurations")
    anthropic = {"anthropic": PricingUpstream("strong", mode="anthropic"),
                 "anthropic_messages": PricingUpstream("strong", mode="anthropic", chat=False)}
    anthropic_results = replay_all(bg, anthropic_configurations, sessions, anthropic, tmp, "anthropic upstream")
    compare(results, "pass_through", sessions)
    compare(anthropic_results, "anthropic_chat_compat", sessions)
    floor = {agent: bounds(session, args.keep) for agent, session in tqdm(sessions.items(), desc="masking floor", unit="session")}
    data = {"files_read": len(files), "file_bytes": sum(p.stat().st_size for p in files), "script": args.script,
            "model_calls": {agent: sum(1 for r in s if r["path"] in ("/v1/messages", "/v1/responses"))
                            for agent, s in sessions.items()},
            "recording": recording, "prices_usd_per_m": PRICES, "ttl_s": TTL_S, "results": results,
            "shipped": "prefix_stable", "everything_on": "session_tiers",
            "anthropic_upstream": {"results": anthropic_results, "base": "anthropic_chat_compat"},
            "masking_floor": floor, "note": NOTES[0], "notes": NOTES}
    if args.out is None:
        path = write("agent_sessions", data)
    else:
        path = args.out
        path.parent.mkdir(parents=True, exist_ok=True)
        stamped = {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), **data}
        path.write_bytes(orjson.dumps(stamped, option=orjson.OPT_INDENT_2) + b"\n")
    summary: dict[str, dict[str, tuple[Any, ...]]] = {
        n: {a: (r[a].get("billed_vs_pass_through"), r[a].get("cached_read_share")) for a in sessions}
               for n, r in results.items()}
    summary |= {n: {a: (r[a].get("billed_usd"), r[a].get("cached_read_share"), r[a].get("uncached_share"), r[a].get("error"))
                    for a in sessions} for n, r in anthropic_results.items()}
    summary["masking_floor"] = {a: (f["oracle_mask"]["vs_pass_through"], f["write_once"]["vs_pass_through"])
                                for a, f in floor.items()}
    print(orjson.dumps(summary).decode())
    print(f"wrote {path}")
    bg.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
