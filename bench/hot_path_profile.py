"""Where the gateway's own time goes on one request: a cProfile of an in-process gateway.

Two workloads, each through a gateway built in this process (the same app `tierlane serve` runs)
in front of an upstream on another thread, so that only the gateway's own work is profiled:

- `full_pipeline`: bench/peers.py's full pipeline (embedded defaults, edge off, model `auto`) and
  its requests (a short unique prompt each, never a cache hit), one at a time, to its fixed-answer
  upstream;
- `agent_turn`: a recorded agent session (bench/agent_sessions.py --sessions FILE) replayed through
  the shipped defaults (agent_sessions' `prefix_stable`) to its pricing upstream, request by request.

Objects alive once the gateway has started are frozen out of the cyclic GC, as `tierlane serve` does.
The gateway's event-loop thread and the worker threads it hands work to (the trim of a long prompt,
token counts) are profiled, each under its own profiler, and added up. Each workload runs once
unprofiled first (imports, models, pools warm). Printed: the gateway's added time per request (its
own `x-tierlane-overhead-ms`, p50, unprofiled), then the functions by cumulative time per request.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/hot_path_profile.py --sessions /tmp/sessions.json \
        [--agent claude-long] [--requests 300] [--top 45] [--out profile.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import copy
import cProfile
import gc
import io
import itertools
import pstats
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import pct

REPO = Path(__file__).resolve().parents[1]


class ProfiledExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor, each job under its own profiler while `on` (cProfile is per thread)."""

    def __init__(self) -> None:
        super().__init__(max_workers=4)
        self.on = False
        self.profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        if not self.on:
            return super().submit(fn, *args, **kwargs)

        def run() -> Any:
            profile = cProfile.Profile()
            with self._lock:
                self.profiles.append(profile)
            return profile.runcall(fn, *args, **kwargs)

        return super().submit(run)


class Gateway:
    """An app served on its own event loop thread, which `profile()` profiles."""

    def __init__(self, config: dict[str, Any]) -> None:
        from gateway.app import create_app
        from gateway.settings import Settings

        self.loop = asyncio.new_event_loop()
        self.executor = ProfiledExecutor()
        self.loop.set_default_executor(self.executor)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.app = create_app(Settings.load(env={}, overrides=config))
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self.port = self.call(self._start())
        self.profile = cProfile.Profile()
        # as `tierlane serve` does after start-up (gateway/serve_cli.py): what lives this long is never walked
        # again by a full collection; here that includes the recorded sessions this process loaded
        gc.collect()
        gc.freeze()

    def call(self, coro: Any, timeout: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def _enable(self, on: bool) -> None:
        self.executor.on = on
        if on:
            self.profile.enable()
        else:
            self.profile.disable()

    def stats(self) -> pstats.Stats:
        stats = pstats.Stats(self.profile)
        for worker in self.executor.profiles:
            stats.add(worker)
        return stats

    def stop(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def _send(url: str, requests: list[tuple[str, dict[str, str], bytes]]) -> list[float]:
    overheads: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
        for path, headers, body in requests:
            async with client.post(url + path, data=body, headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{path} answered {resp.status}: {(await resp.text())[:300]}")
                overheads.append(float(resp.headers.get("x-tierlane-overhead-ms", "nan")))
    return overheads


Work = list[tuple[str, dict[str, str], bytes]]


def measure(config: dict[str, Any], warm: Work, timed: Work, profiled: Work) -> tuple[list[float], pstats.Stats, int]:
    """(added ms per request of `timed`, unprofiled; the profile of `profiled`; how many were profiled)."""
    gw = Gateway(config)
    url = f"http://127.0.0.1:{gw.port}"
    try:
        asyncio.run(_send(url, warm))
        overheads = asyncio.run(_send(url, timed))
        gw.call(gw._enable(True))
        asyncio.run(_send(url, profiled))
        gw.call(gw._enable(False))
        gw.call(gw.app[_pipeline_key()].drain())
        return overheads, gw.stats(), len(profiled)
    finally:
        gw.stop()


# What the timers mode times, inclusive wall time per request (each named function is replaced wherever
# a module holds it, so `from x import f` callers are timed too); the stages and hooks are added per gateway.
TIMED = ["gateway.apis.common:read_json", "gateway.protocol:parse_body", "gateway.protocol:check",
         "gateway.apis.messages_wire:to_chat", "gateway.apis.responses_wire:translate",
         "gateway.apis.field_policy:Dropped.unknown", "gateway.protocol:validate", "policies.trim.core:trim_request",
         "gateway.upstream.affinity:key_for", "gateway.upstream.pool:UpstreamPool._payload"]


class Timers:
    """Wall time per function: sync and async functions wrapped with perf_counter, totals kept by name."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    def _note(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, name: str, fn: Any) -> Any:
        import functools
        import inspect
        import time

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self._note(name, time.perf_counter() - started)
            return timed_async

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._note(name, time.perf_counter() - started)
        return timed

    def patch(self, owner: Any, attr: str, name: str) -> None:
        original = owner.__dict__[attr]
        is_static = isinstance(original, staticmethod)
        fn = original.__func__ if is_static else original
        wrapped = self.wrap(name, fn)
        setattr(owner, attr, staticmethod(wrapped) if is_static else wrapped)
        self._undo.append(lambda: setattr(owner, attr, original))
        if isinstance(owner, type):
            return
        for module in list(sys.modules.values()):  # `from owner import attr` copies
            if module is not owner and getattr(module, attr, None) is fn:
                setattr(module, attr, wrapped)
                self._undo.append(lambda module=module: setattr(module, attr, fn))

    def patch_named(self, target: str) -> None:
        import importlib

        module_name, _, path = target.partition(":")
        owner: Any = importlib.import_module(module_name)
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        self.patch(owner, attr, path)

    def undo(self) -> None:
        for step in reversed(self._undo):
            step()
        self._undo.clear()

    def report(self, n: int) -> str:
        rows = sorted(self.totals.items(), key=lambda kv: -kv[1])
        out = f"{'ms/req':>8} {'calls/req':>10}  function (inclusive wall time)\n"
        for name, total in rows:
            out += f"{total * 1000 / n:8.3f} {self.calls[name] / n:10.2f}  {name}\n"
        return out


def timed(config: dict[str, Any], warm: Work, work: Work) -> tuple[list[float], Timers, int]:
    """(added ms per request, the timers over `work`, how many requests) with no profiler on."""
    from gateway.keys import PIPELINE

    gw = Gateway(config)
    url = f"http://127.0.0.1:{gw.port}"
    timers = Timers()
    try:
        asyncio.run(_send(url, warm))
        for target in TIMED:
            timers.patch_named(target)
        pipeline = gw.app[PIPELINE]
        for stage in pipeline.stages:
            if "run" in type(stage).__dict__:
                timers.patch(type(stage), "run", f"stage {stage.name}")
        for hook in pipeline.hooks:
            if "on_complete" in type(hook).__dict__:
                timers.patch(type(hook), "on_complete", f"hook {hook.name} (after the answer)")
        overheads = asyncio.run(_send(url, work))
        gw.call(pipeline.drain())
        return overheads, timers, len(work)
    finally:
        timers.undo()
        gw.stop()


def _pipeline_key() -> Any:
    from gateway.keys import PIPELINE

    return PIPELINE


def report(name: str, overheads: list[float], stats: pstats.Stats, n: int, top: int) -> str:
    out = io.StringIO()
    out.write(f"== {name}: {n} requests; gateway added ms p50 {pct(overheads, 0.5):.3f}, "
              f"mean {sum(overheads) / max(1, len(overheads)):.3f} (unprofiled)\n")
    rows = []
    for (path, line, func), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = path.replace(str(REPO) + "/", "")
        if "site-packages/" in where:
            where = where.split("site-packages/", 1)[1]
        rows.append((cumtime, tottime, calls, f"{where}:{line}({func})"))
    rows.sort(reverse=True)
    out.write(f"{'cum ms/req':>11} {'own ms/req':>11} {'calls/req':>10}  function\n")
    for cumtime, tottime, calls, label in rows[:top]:
        out.write(f"{cumtime * 1000 / n:11.3f} {tottime * 1000 / n:11.3f} {calls / n:10.1f}  {label}\n")
    return out.getvalue()


_unique = itertools.count()


def timers_report(name: str, overheads: list[float], timers: Timers, n: int) -> str:
    return (f"== {name}: {n} requests; gateway added ms p50 {pct(overheads, 0.5):.3f}, "
            f"mean {sum(overheads) / max(1, len(overheads)):.3f} (timers on)\n" + timers.report(n))


def full_pipeline_workload(n: int) -> Work:
    """bench/peers.py's requests: a unique prompt each (never a cache hit), across calls too."""
    counter = _unique
    out = []
    for _ in range(n):
        i = next(counter)
        body = orjson.dumps({"model": "auto", "messages": [{"role": "user", "content": f"Request {i}: what is {i % 97} "
                                                            "times seven?"}], "max_tokens": 16})
        out.append(("/v1/chat/completions", {"Content-Type": "application/json", "Authorization": "Bearer bench"}, body))
    return out


def session_workload(session: list[dict[str, Any]]) -> Work:
    return [(r["path"], {**r["headers"], "Authorization": "Bearer bench", "x-api-key": "bench"}, orjson.dumps(r["body"]))
            for r in session]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=Path, help="recorded sessions (bench/agent_sessions.py --sessions)")
    parser.add_argument("--agent", default="claude-long", help="the recorded session replayed as agent turns")
    parser.add_argument("--turns", type=int, default=0, help="only the session's last N requests (0: all)")
    parser.add_argument("--repeat", type=int, default=1, help="times the session's turns are replayed, measured")
    parser.add_argument("--requests", type=int, default=300, help="full-pipeline requests profiled")
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timers", action="store_true",
                        help="no profiler: wall time of the pipeline's stages and the body's parse, validation, "
                        "translation, trim and serialisation, wrapped with perf_counter")
    args = parser.parse_args(argv)
    from bench import agent_sessions, fast_upstream, peers
    from bench.pricing_upstream import PRICES, PricingUpstream
    from tests.support.background import BackgroundLoop, RunningApp

    tmp = Path(tempfile.mkdtemp(prefix="hot-path-"))
    bg = BackgroundLoop()
    text = []
    fast = web.Application(client_max_size=64 * 1024 * 1024)
    fast.router.add_post("/v1/chat/completions", fast_upstream.chat)
    fast.router.add_get("/v1/models", fast_upstream.models)
    fast_app = RunningApp(bg, fast)
    try:
        config = peers.full_pipeline_config(fast_app.url + "/v1", str(tmp / "full-state"))
        if args.timers:
            overheads, timers, n = timed(config, full_pipeline_workload(50), full_pipeline_workload(args.requests))
            text.append(timers_report("full_pipeline", overheads, timers, n))
        else:
            overheads, stats, n = measure(config, full_pipeline_workload(50), full_pipeline_workload(args.requests),
                                          full_pipeline_workload(args.requests))
            text.append(report("full_pipeline", overheads, stats, n, args.top))
        print(text[-1], flush=True)
        if args.sessions is not None:
            sessions = orjson.loads(args.sessions.read_bytes())
            session = sessions[args.agent]
            upstreams = {tier: PricingUpstream(tier) for tier in PRICES}
            running = {tier: RunningApp(bg, u.app()) for tier, u in upstreams.items()}
            try:
                configs = agent_sessions.configurations({t: a.url + "/v1" for t, a in running.items()})
                config = copy.deepcopy(configs["prefix_stable"])
                config["state_dir"] = str(tmp / "agent-state")
                turns = session[-args.turns:] if args.turns else session
                work = [w for w in session_workload(turns) if w[0] in ("/v1/messages", "/v1/responses",
                                                                        "/v1/chat/completions")] * args.repeat
                # the agent configurations keep no cache: each replay of the session goes upstream
                name = f"agent_turn ({args.agent}, prefix_stable)"
                if args.timers:
                    overheads, timers, n = timed(config, session_workload(session), work)
                    text.append(timers_report(name, overheads, timers, n))
                else:
                    overheads, stats, n = measure(config, session_workload(session), work, work)
                    text.append(report(name, overheads, stats, n, args.top))
                print(text[-1], flush=True)
            finally:
                for app in running.values():
                    app.stop()
    finally:
        fast_app.stop()
        bg.close()
    if args.out is not None:
        args.out.write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
