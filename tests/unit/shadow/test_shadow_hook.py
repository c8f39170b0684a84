"""The shadow hook against a real upstream and the real embedder: what it samples, sends and records."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.context import Outcome, Principal, RequestContext
from gateway.pipeline import shadow
from gateway.services import Services
from gateway.settings import Settings
from gateway.upstream.pool import UpstreamPool
from policies.policy import Policy
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.unit.shadow.conftest import UPSTREAM_ANSWER, chat_answer

pytestmark = pytest.mark.slow

Make = Callable[..., Any]


@pytest.fixture
async def make_services(tmp_path: Path, embedder: Any) -> AsyncIterator[Make]:
    pools: list[UpstreamPool] = []

    async def factory(url: str | None, *, use_embedder: bool = True, **section: Any) -> Services:
        upstreams = [upstream_cfg("up", url + "/v1", retries=0)] if url else []
        settings = Settings.load(env={}, overrides={**PASS_THROUGH, "state_dir": str(tmp_path / "state"), "upstreams": upstreams})
        policy = Policy.load(extra={"shadow": {"sample_rate": 1.0, "seed": 0, **section}})
        pool = UpstreamPool(settings)
        await pool.start()
        pools.append(pool)
        return Services(settings=settings, policy=policy, pool=pool, embedder=embedder if use_embedder else None)

    yield factory
    for pool in pools:
        await pool.close()


def ctx_for(lane: str, content: str = "What is the capital of France?", tenant: str = "acme") -> RequestContext:
    return RequestContext(
        request_id=f"req-{lane}", operation="chat", headers={}, principal=Principal(tenant, "web"), model="auto",
        body={"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 16, "stream": True},
        lane=lane,
    )


def done(text: str) -> Outcome:
    return Outcome(status=200, response=chat_answer(text), complete=True, finish_reasons=["stop"])


def rows(services: Services) -> list[dict[str, Any]]:
    return shadow.summarize(services.settings.state_dir / shadow.FILENAME)


async def test_edge_and_cache_answers_are_compared_with_the_upstream(make_services: Make, upstream: Any) -> None:
    app, rec = upstream
    services = await make_services(app.url)
    hook = shadow.build(services)
    assert hook is not None
    await hook.on_complete(ctx_for("edge"), done(UPSTREAM_ANSWER))
    await hook.on_complete(ctx_for("cache"), done("Bananas are rich in potassium."))
    await hook.drain()
    assert rec.hits == 2
    sent = rec.bodies[0]
    assert "stream" not in sent and sent["messages"][0]["content"] == "What is the capital of France?"
    by_lane = {row["lane"]: row for row in rows(services)}
    assert by_lane["edge"]["count"] == 1 and by_lane["edge"]["mean"] > 0.99
    assert by_lane["edge"]["share_above_0_8"] == 1.0
    assert by_lane["cache"]["mean"] < 0.5 and by_lane["cache"]["share_above_0_8"] == 0.0
    assert by_lane["edge"]["upstream_input_tokens"] == 7 and by_lane["edge"]["upstream_output_tokens"] == 3


async def test_only_complete_answers_of_shadowed_lanes_are_sampled(make_services: Make, upstream: Any) -> None:
    app, rec = upstream
    services = await make_services(app.url, lanes=["edge"])
    hook = shadow.build(services)
    assert hook is not None
    await hook.on_complete(ctx_for("upstream"), done("x"))
    await hook.on_complete(ctx_for("cache"), done("x"))
    await hook.on_complete(ctx_for("edge"), Outcome(status=200, response=chat_answer("cut"), complete=False))
    await hook.on_complete(ctx_for("edge"), Outcome(status=429, response=None, complete=False))
    await hook.on_complete(ctx_for("edge"), done(""))
    await hook.drain()
    assert rec.hits == 0 and rows(services) == []


async def test_sampling_follows_the_rate(make_services: Make, upstream: Any) -> None:
    app, rec = upstream
    services = await make_services(app.url, sample_rate=0.25, max_pending=1000)
    hook = shadow.build(services)
    assert hook is not None
    for _ in range(200):
        await hook.on_complete(ctx_for("edge"), done(UPSTREAM_ANSWER))
    await hook.drain()
    assert 25 <= rec.hits <= 75
    assert rows(services)[0]["count"] == rec.hits == hook.recorded


async def test_upstream_failures_are_logged_not_raised(
    make_services: Make, broken_upstream: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app, rec = broken_upstream
    services = await make_services(app.url)
    hook = shadow.build(services)
    assert hook is not None
    await hook.on_complete(ctx_for("edge"), done("hello"))
    await hook.drain()
    assert rec.hits == 1 and hook.failed == 1 and rows(services) == []
    assert "shadow comparison for request req-edge" in caplog.text


async def test_without_an_embedder_nothing_is_sent(make_services: Make, upstream: Any) -> None:
    app, rec = upstream
    services = await make_services(app.url, use_embedder=False)
    hook = shadow.build(services)
    assert hook is not None
    await hook.on_complete(ctx_for("edge"), done("hello"))
    await hook.drain()
    assert rec.hits == 0


async def test_off_by_default_and_without_upstreams(make_services: Make, upstream: Any) -> None:
    app, _ = upstream
    assert shadow.build(await make_services(app.url, sample_rate=0.0)) is None
    assert shadow.build(await make_services(None)) is None
    assert Policy.load().section("shadow")["sample_rate"] == 0.0
    with pytest.raises(ValueError, match="sample_rate"):
        shadow.build(await make_services(app.url, sample_rate=1.5))


async def test_tenant_override_turns_sampling_on_for_one_tenant(make_services: Make, upstream: Any) -> None:
    app, rec = upstream
    services = await make_services(
        app.url, sample_rate=0.0, overrides=[{"match": {"tenant": "acme"}, "set": {"sample_rate": 1.0}}]
    )
    hook = shadow.build(services)
    assert hook is not None
    await hook.on_complete(ctx_for("edge", tenant="other"), done("hello"))
    await hook.on_complete(ctx_for("edge"), done("hello"))
    await hook.drain()
    assert rec.hits == 1
    # resolved once per tenant/app/model, then kept: the next request of each gets the same config
    assert hook._config_for(ctx_for("edge")) is hook._config_for(ctx_for("edge"))
    assert hook._config_for(ctx_for("edge", tenant="other")).sample_rate == 0.0
    await hook.on_complete(ctx_for("edge"), done("hello again"))
    await hook.drain()
    assert rec.hits == 2


async def test_an_auto_hit_is_re_asked_of_the_model_that_answered_with_bounded_tokens(
        tmp_path: Path, embedder: Any, upstream: Any) -> None:
    app, rec = upstream
    settings = Settings.load(env={}, overrides={**PASS_THROUGH, "state_dir": str(tmp_path / "state"),
                                                "upstreams": [upstream_cfg("up", app.url + "/v1", retries=0,
                                                                           models=["small", "big"])]})
    policy = Policy.load(extra={"shadow": {"sample_rate": 1.0, "seed": 0, "max_tokens": 256}})
    pool = UpstreamPool(settings)
    await pool.start()
    try:
        services = Services(settings=settings, policy=policy, pool=pool, embedder=embedder)
        hook = shadow.build(services)
        assert hook is not None
        hit = ctx_for("cache")
        hit.body["max_tokens"] = 60_000
        hit.target_model = "big"  # the model named in the stored answer
        await hook.on_complete(hit, done(UPSTREAM_ANSWER))
        unknown = ctx_for("edge")
        await hook.on_complete(unknown, done(UPSTREAM_ANSWER))  # answered by no upstream model: the pool's first
        await hook.drain()
        assert [(body["model"], body["max_tokens"]) for body in rec.bodies] == [("big", 256), ("small", 16)]
    finally:
        await pool.close()
