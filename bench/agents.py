"""The coding agents through the gateway: requests and 4xx per session, added time per turn.

Writes bench/results/agents.json. For each agent (Claude Code, Codex: the pinned npm packages,
their defaults) it runs the same task, reading two files with the agent's own tools, in sessions
that alternate between two paths:
- `gateway`: the agent -> tierlane (pass-through: no cache, router, trim or edge; a separate
  process, as deployed) -> the scripted model speaking chat completions (tests/support/agent_model.py);
- `native`: the agent -> the same script speaking the agent's own API natively
  (tests/support/native_agent_model.py), no gateway.
A recording proxy sits in front of both paths and times every request from its arrival to the
last byte of its answer, so both are measured at the same point: the gateway's added time per
turn is the difference of the two paths' per-turn times (p50 and p99, side by side in one run).
It also counts requests and 4xx per session and the fields the gateway dropped (its
`x-tierlane-dropped` header), by name.

    .venv/bin/python bench/agents.py [--sessions 8] [--llama-server bench/.peers/llama.cpp/build/bin/llama-server]

With `--llama-server` (built by bench/build_llama_server.sh) each agent also runs once through
the gateway in front of llama.cpp's own server, with the bundled SmolLM2 and the chat template
the GGUF carries (jinja, the server's default), to check that what the gateway sends is what
such a server takes: every status of the gateway and of the server is recorded.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import free_port, gateway_cmd, pct, start, stop, write
from bench._verdicts import verdicts
from tests.support import agents
from tests.support.agent_model import ANSWER_PREFIX, MODEL, AgentModel
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import PASS_THROUGH
from tests.support.native_agent_model import native_app

PROMPT = "Read notes.txt and todo.txt and tell me what they say."
FILES = {"notes.txt": "the secret word is pelican", "todo.txt": "buy 7 apples"}
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class Recorder:
    """A reverse proxy that times each request and keeps its status and dropped-field header."""

    def __init__(self) -> None:
        self.target = ""
        self.rows: list[dict[str, Any]] = []
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def forward(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        row: dict[str, Any] = {"path": request.path, "status": 0, "seconds": 0.0, "dropped": "", "overhead_ms": float("nan"),
                               "complete": False}
        try:
            async with self.session.request(request.method, self.target + request.path_qs, data=body, headers=headers) as up:
                row.update(status=up.status, dropped=up.headers.get("x-tierlane-dropped", ""),
                           overhead_ms=float(up.headers.get("x-tierlane-overhead-ms", "nan")))
                response = web.StreamResponse(status=up.status,
                                              headers={k: v for k, v in up.headers.items() if k.lower() not in HOP})
                await response.prepare(request)
                async for piece in up.content.iter_any():
                    await response.write(piece)
                await response.write_eof()
                row["complete"] = True
        finally:
            # an agent may exit on the final event, before the proxy's last write: the request still counts
            row["seconds"] = time.perf_counter() - started
            self.rows.append(row)
        return response

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def run_session(agent: agents.Agent, proxy_url: str, workdir: Path) -> tuple[bool, float]:
    started = time.perf_counter()
    out = agents.run(agent, proxy_url, workdir, workdir / "home", PROMPT, timeout=180)
    ok = out.returncode == 0 and ANSWER_PREFIX in out.stdout and all(text in out.stdout for text in FILES.values())
    return ok, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8, help="sessions per agent and path (alternated)")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    args = parser.parse_args()
    bg = BackgroundLoop()
    tmp = Path(tempfile.mkdtemp(prefix="tierlane-agents-"))
    work = tmp / "work"
    work.mkdir()
    for name, text in FILES.items():
        (work / name).write_text(text + "\n")
    script = [str(work / name) for name in FILES]
    chat_model, native_model = AgentModel(files=script), AgentModel(files=script)
    chat_up, native_up = RunningApp(bg, chat_model.app()), RunningApp(bg, native_app(native_model))
    recorder = Recorder()
    proxy = RunningApp(bg, recorder.app())
    port = free_port()
    config = {**PASS_THROUGH, "state_dir": str(tmp / "state"), "model_aliases": {"claude-*": "auto", "gpt-*": "auto"},
              "upstreams": [{"name": "model", "base_url": chat_up.url + "/v1", "models": [MODEL]}]}
    gateway = start(gateway_cmd(config, tmp / "gateway.yaml", port), f"http://127.0.0.1:{port}/healthz", tmp / "gateway.log")
    targets = {"gateway": f"http://127.0.0.1:{port}", "native": native_up.url}
    results: dict[str, Any] = {}
    try:
        for agent in agents.AGENTS:
            agents.install(agent)
        total = len(agents.AGENTS) * 2 * args.sessions
        with tqdm(total=total, desc="agent sessions", unit="session") as bar:
            for agent in agents.AGENTS:
                per_path: dict[str, dict[str, Any]] = {p: {"sessions": [], "turn_s": [], "self_ms": [],
                                                           "dropped": collections.Counter()}
                                                       for p in targets}
                for i in range(args.sessions):
                    for path in (("gateway", "native") if i % 2 == 0 else ("native", "gateway")):
                        recorder.target = targets[path]
                        first = len(recorder.rows)
                        ok, seconds = run_session(agent, proxy.url, work)
                        rows = recorder.rows[first:]
                        model_rows = [r for r in rows if r["path"] in ("/v1/messages", "/v1/responses")]
                        stats = per_path[path]
                        stats["sessions"].append({"ok": ok, "seconds": round(seconds, 3), "requests": len(model_rows),
                                                  "4xx": sum(400 <= r["status"] < 500 for r in rows),
                                                  "5xx": sum(r["status"] >= 500 for r in rows)})
                        stats["turn_s"].extend(r["seconds"] for r in model_rows if r["status"] == 200 and r["complete"])
                        stats["self_ms"].extend(r["overhead_ms"] for r in model_rows if r["overhead_ms"] == r["overhead_ms"])
                        for r in model_rows:
                            stats["dropped"].update(name for name in r["dropped"].split(",") if name)
                        bar.update(1)
                results[agent.name] = summarise(agent, per_path)
    finally:
        stop(gateway)
        bg.call(recorder.close())
        proxy.stop()
        chat_up.stop()
        native_up.stop()
        bg.close()
    llama = against_llama_server(args.llama_server, tmp) if args.llama_server is not None else None
    data: dict[str, Any] = {
        "what": "coding agents (pinned npm packages, their defaults) reading two files with their own tools; each session "
                "through the gateway (pass-through, own process) or straight to a native scripted model, alternated; "
                "times per model request measured by one recording proxy in front of both paths",
        "sessions_per_path": args.sessions,
        "agents": {a.name: a.spec for a in agents.AGENTS},
        "results": results,
    }
    if llama is not None:
        data["llama_server"] = llama
    data["verdicts"] = verdicts("agents", data)
    path = write("agents", data)
    print(f"wrote {path}")
    for name, r in results.items():
        print(f"{name}: {r['gateway']['requests_per_session']} requests/session, {r['gateway']['4xx_per_session']} 4xx/session, "
              f"added p50 {r['added_p50_ms']} ms, p99 {r['added_p99_ms']} ms")
    return 0


def against_llama_server(binary: Path, tmp: Path) -> dict[str, Any]:
    """One run of each agent through the gateway before llama-server (SmolLM2, its own template)."""
    from edge_engine import bundled_model_path

    port, gw_port = free_port(), free_port()
    server = start([str(binary), "-m", str(bundled_model_path()), "--host", "127.0.0.1", "--port", str(port), "-c", "8192",
                    "-np", "1", "-t", "2", "-a", "smollm2"], f"http://127.0.0.1:{port}/health", tmp / "llama-server.log")
    config = {**PASS_THROUGH, "state_dir": str(tmp / "state-llama"), "model_aliases": {"claude-*": "auto", "gpt-*": "auto"},
              "upstreams": [{"name": "llama-server", "base_url": f"http://127.0.0.1:{port}/v1", "models": ["smollm2"],
                             "read_timeout_s": 300, "max_output_tokens": 48}]}
    gateway = start(gateway_cmd(config, tmp / "gateway-llama.yaml", gw_port), f"http://127.0.0.1:{gw_port}/healthz",
                    tmp / "gateway-llama.log")
    out: dict[str, Any] = {"server": "llama.cpp llama-server (jinja, the GGUF's chat template)", "max_output_tokens": 48}
    try:
        for agent in tqdm(agents.AGENTS, desc="against llama-server", unit="agent"):
            work = tmp / f"llama-{agent.name}"
            work.mkdir()
            started = time.perf_counter()
            run = agents.run(agent, f"http://127.0.0.1:{gw_port}", work, work / "home", "Say hi.", timeout=400)
            said = run.stdout + run.stderr
            out[agent.name] = {"exit_code": run.returncode, "seconds": round(time.perf_counter() - started, 1),
                               "api_errors": [line for line in said.splitlines() if "API Error" in line][:3]}
    finally:
        stop(gateway)
        stop(server)
    ledger = tmp / "state-llama" / "ledger.sqlite3"
    import sqlite3

    conn = sqlite3.connect(ledger)
    try:
        out["gateway_statuses"] = dict(collections.Counter(str(s) for (s,) in conn.execute("SELECT status FROM requests")))
    finally:
        conn.close()
    log = (tmp / "llama-server.log").read_text(errors="replace")
    # llama-server logs no per-request status: its finished tasks and its error-level lines
    out["server_tasks_finished"] = len(re.findall(r"stop processing", log))
    out["server_errors"] = [line for line in log.splitlines() if re.match(r"^\S+ E ", line)][:5]
    return out


def summarise(agent: agents.Agent, per_path: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"package": agent.spec}
    for path, stats in per_path.items():
        sessions = stats["sessions"]
        n = max(1, len(sessions))
        turns = [s * 1000 for s in stats["turn_s"]]
        out[path] = {
            "sessions": len(sessions),
            "sessions_completed": sum(s["ok"] for s in sessions),
            "requests_per_session": round(sum(s["requests"] for s in sessions) / n, 2),
            "4xx_per_session": round(sum(s["4xx"] for s in sessions) / n, 2),
            "5xx_per_session": round(sum(s["5xx"] for s in sessions) / n, 2),
            "turn_p50_ms": round(pct(turns, 0.5), 3),
            "turn_p99_ms": round(pct(turns, 0.99), 3),
            "turns": len(turns),
            "session_p50_s": round(pct([s["seconds"] for s in sessions], 0.5), 3),
        }
        if path == "gateway":
            # the gateway's own time per request (x-tierlane-overhead-ms: its time less the upstream's)
            out[path]["self_p50_ms"] = round(pct(stats["self_ms"], 0.5), 3)
            out[path]["self_p99_ms"] = round(pct(stats["self_ms"], 0.99), 3)
            requests = max(1, sum(s["requests"] for s in sessions))
            out[path]["dropped_per_request"] = {name: round(count / requests, 2) for name, count in stats["dropped"].most_common()}
    out["added_p50_ms"] = round(out["gateway"]["turn_p50_ms"] - out["native"]["turn_p50_ms"], 3)
    out["added_p99_ms"] = round(out["gateway"]["turn_p99_ms"] - out["native"]["turn_p99_ms"], 3)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
