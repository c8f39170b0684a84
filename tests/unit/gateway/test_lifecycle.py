"""Stopping the gateway: the pipeline closes its stages and hooks before the components and the pool.

Also the model call span: started once, finished once, whichever way the answer ended.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from aiohttp import web

from gateway.app import create_app
from gateway.context import ModelCall, Outcome, Principal, RequestContext
from gateway.keys import PIPELINE, SERVICES
from gateway.pipeline import shadow
from gateway.pipeline.route import RouteStage
from gateway.pipeline.runner import Pipeline
from gateway.pipeline.shadow import ShadowConfig, ShadowHook, ShadowStore
from gateway.services import Services
from gateway.settings import Settings
from policies.policy import Policy, _deep_merge
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import completion

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


class UnitEmbedder:
    """Every text embeds to the same unit vector: the shadow comparison needs no real model here."""

    async def embed(self, text: str) -> np.ndarray:
        return np.full(384, 1 / np.sqrt(384), dtype=np.float32)


class SlowShadowUpstream:
    """Answers the client's request at once and every later one (the shadow call) after `delay` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.hits = 0
        self.answered = 0
        self.shadow_arrived = threading.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.hits > 1:
            self.shadow_arrived.set()
            await asyncio.sleep(self.delay)
        self.answered += 1
        return web.json_response(completion("Paris is the capital of France."))


def gateway(bg: BackgroundLoop, tmp_path: Path, upstream_url: str) -> RunningApp:
    data = _deep_merge(PASS_THROUGH, {
        "state_dir": str(tmp_path / "state"),
        "upstreams": [upstream_cfg("up", upstream_url + "/v1", retries=0)],
        "policy": {
            "router": {"enabled": True},
            "shadow": {"sample_rate": 1.0, "seed": 0, "lanes": ["upstream"]},
        },
    })
    return RunningApp(bg, create_app(Settings.load(env={}, overrides=data)))


def test_stop_finishes_shadow_calls_and_closes_stages_before_the_pool(
    bg: BackgroundLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    up = SlowShadowUpstream(delay=0.5)
    upstream = RunningApp(bg, up.app())
    gw = gateway(bg, tmp_path, upstream.url)
    try:
        services: Services = gw.app[SERVICES]
        pipeline: Pipeline = gw.app[PIPELINE]
        services.embedder = UnitEmbedder()
        hook = next(h for h in pipeline.hooks if isinstance(h, ShadowHook))
        route = next(s for s in pipeline.stages if isinstance(s, RouteStage))
        # The route stage's fallback encoder thread, as a router without the shared embedder starts it.
        monkeypatch.setattr(route, "_encode", lambda text: np.zeros(384, dtype=np.float32))
        probe = RequestContext(request_id="p", operation="chat", body={"messages": MESSAGES}, headers={},
                               principal=Principal("t", "a"), model="auto")
        bg.call(route._embedding(probe, MESSAGES))
        route_executor = route._executor
        assert route_executor is not None
        connections: list[sqlite3.Connection] = []

        real_connect = shadow.connect

        def connect(path: Path) -> sqlite3.Connection:
            connections.append(real_connect(path))
            return connections[-1]

        monkeypatch.setattr(shadow, "connect", connect)
        at_pool_close: dict[str, int] = {}
        pool_close = services.pool.close

        async def close_pool() -> None:
            at_pool_close.update(in_flight=len(hook._tasks), recorded=hook.recorded, failed=hook.failed,
                                 answered=up.answered)
            await pool_close()

        services.pool.close = close_pool  # type: ignore[method-assign]

        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
        assert r.status_code == 200, r.text
        assert up.shadow_arrived.wait(10), "the shadow call never reached the upstream"
    finally:
        gw.stop()
        upstream.stop()
    # The shadow call in flight at shutdown ended (answered and recorded) before the pool closed.
    assert at_pool_close == {"in_flight": 0, "recorded": 1, "failed": 0, "answered": 2}
    assert hook.store._executor._shutdown  # type: ignore[attr-defined]
    assert len(connections) == 1
    with pytest.raises(sqlite3.ProgrammingError):
        connections[0].execute("SELECT 1")
    assert route._executor is None and route_executor._shutdown  # type: ignore[attr-defined]
    assert shadow.summarize(tmp_path / "state" / shadow.FILENAME)[0]["count"] == 1


class NeverAnswers:
    """A pool whose upstream never answers: a shadow call stays in flight until it is cancelled."""

    def __init__(self) -> None:
        self.cancelled = 0

    def has_upstreams(self) -> bool:
        return True

    def pool_names(self) -> list[str]:
        return ["default"]

    def pool_for_model(self, model: str) -> str:
        return "default"

    async def send(self, *args: Any, **kwargs: Any) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


async def test_shadow_calls_past_the_grace_period_are_cancelled_cleanly(tmp_path: Path) -> None:
    pool = NeverAnswers()
    services = Services(settings=Settings.load(env={}, overrides=PASS_THROUGH), policy=Policy.load(),
                        pool=pool, embedder=UnitEmbedder())  # type: ignore[arg-type]
    store = ShadowStore(tmp_path / shadow.FILENAME)
    hook = ShadowHook(services, ShadowConfig(sample_rate=1.0, seed=0), store)
    ctx = RequestContext(request_id="r", operation="chat", body={"messages": MESSAGES}, headers={},
                         principal=Principal("t", "a"), model="edge", lane="edge")
    done = Outcome(status=200, response=completion("Paris."), complete=True, finish_reasons=["stop"])
    await hook.on_complete(ctx, done)
    await asyncio.sleep(0.05)
    assert len(hook._tasks) == 1
    await hook.close(grace_s=0.05)
    assert (len(hook._tasks), pool.cancelled, hook.failed, hook.recorded) == (0, 1, 0, 0)
    assert store._executor._shutdown  # type: ignore[attr-defined]
    await hook.on_complete(ctx, done)  # closed: nothing more is sampled
    assert hook.sampled == 1 and not hook._tasks


async def test_pipeline_close_closes_every_stage_and_hook_once() -> None:
    closed: list[str] = []

    class Part:
        operations = frozenset({"chat"})

        def __init__(self, name: str) -> None:
            self.name = name

        async def close(self) -> None:
            closed.append(self.name)

    pipeline = Pipeline(None, [], [])  # type: ignore[arg-type]
    pipeline.stages, pipeline.hooks = [Part("resolve"), Part("route")], [Part("shadow"), Part("meter")]  # type: ignore[list-item]
    await pipeline.close()
    await pipeline.close()
    assert closed == ["shadow", "meter", "resolve", "route"]


class RecordingSpan:
    def __init__(self) -> None:
        self.entered = 0
        self.exits: list[tuple[Any, ...]] = []
        self.response: Any = "unset"

    def __enter__(self) -> RecordingSpan:
        self.entered += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self.exits.append(exc)

    def set_response(self, response: Any) -> None:
        self.response = response


class SpanTelemetry:
    def __init__(self) -> None:
        self.span = RecordingSpan()

    def model_span(self, ctx: RequestContext) -> RecordingSpan:
        return self.span


def test_model_call_ends_its_span_once_with_the_answer_or_the_error() -> None:
    tel = SpanTelemetry()
    call = ModelCall(tel, None)  # type: ignore[arg-type]
    call.start()
    assert (tel.span.entered, tel.span.exits) == (1, [])
    call.finish(Outcome(status=200, response={"id": "x"}, complete=True))
    call.finish(Outcome(status=499, response=None, complete=False))
    assert tel.span.response == {"id": "x"} and tel.span.exits == [(None, None, None)]

    failing = SpanTelemetry()
    call = ModelCall(failing, None)  # type: ignore[arg-type]
    call.start()
    error = RuntimeError("lane broke")
    call.fail(error)
    call.finish(Outcome(status=502, response=None, complete=False))
    assert failing.span.response == "unset"
    assert [exc[1] for exc in failing.span.exits] == [error]
