"""Model names: the resolve stage, auto, discovery from wildcard upstreams, and the /v1/models listing."""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web

from gateway.context import Principal, RequestContext
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.pipeline.resolve import ModelCatalog, ResolveStage
from gateway.settings import Settings
from gateway.upstream.pool import UpstreamPool
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app


def discoverable(rec: Recorder) -> web.Application:
    app = fault_app("ok", rec)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "served-model", "object": "model"}]})

    app.router.add_get("/v1/models", models)
    return app


def test_auto_asks_a_wildcard_upstream_for_the_model_it_listed(bg, make_gateway):
    rec = Recorder()
    up = RunningApp(bg, discoverable(rec))
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])  # models: ["*"]
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert rec.bodies[0]["model"] == "served-model"
    ids = [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]]
    assert ids == ["auto", "served-model"]


def test_auto_without_any_model_name_is_a_clear_404(bg, make_gateway):
    up = RunningApp(bg, fault_app("ok", Recorder()))  # no /v1/models to discover from
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert "names no model" in r.json()["error"]["message"]


# -- the resolve stage on its own: model name and route header to lane, pool and model ----------

def catalog(*upstreams: dict, edge: bool = True) -> ModelCatalog:
    settings = Settings.load(env={}, overrides={**PASS_THROUGH, "upstreams": list(upstreams)})
    return ModelCatalog(UpstreamPool(settings), "edge" if edge else None, ["local"] if edge else ())


STD = upstream_cfg("a", "http://127.0.0.1:9/v1", models=["small-model", "gpt-4o-mini"], pool="standard")
CRIT = upstream_cfg("b", "http://127.0.0.1:9/v1", models=["gpt-4o"], pool="critical")


def request(model: str, route: str | None = None, operation: str = "chat") -> RequestContext:
    return RequestContext(
        request_id="r", operation=operation, body={"model": model}, principal=Principal("t", "a"), model=model,
        headers={"x-tierlane-route": route} if route is not None else {},
    )


async def resolved(stage: ResolveStage, *args: str) -> tuple[str, str | None, str | None, str | None]:
    ctx = request(*args)
    assert await stage.run(ctx) is None
    return ctx.lane, ctx.pool, ctx.target_model, ctx.requested_route


async def test_model_names_resolve_to_a_lane_pool_and_model() -> None:
    stage = ResolveStage(catalog(STD, CRIT))
    assert await resolved(stage, "gpt-4o") == ("upstream", "critical", "gpt-4o", None)
    assert await resolved(stage, "local") == ("edge", None, "edge", None)
    # `auto` goes to the default pool with the model it names, until the route stage decides
    assert await resolved(stage, "auto") == ("upstream", "standard", "small-model", None)
    assert await resolved(stage, "gpt-4o", "auto") == ("upstream", "standard", "small-model", "auto")
    assert await resolved(stage, "gpt-4o", "EDGE") == ("upstream", "critical", "gpt-4o", "edge")
    assert await resolved(ResolveStage(catalog()), "auto") == ("edge", None, "edge", None)


async def test_unknown_models_and_route_values_are_openai_errors() -> None:
    stage = ResolveStage(catalog(STD))
    with pytest.raises(ModelNotFound) as missing:
        await stage.run(request("gpt-5"))
    assert missing.value.status == 404 and missing.value.payload()["error"]["param"] == "model"
    assert "model_aliases" in missing.value.message and "TIERLANE_MODEL_ALIASES='gpt-*=auto'" in missing.value.message
    with pytest.raises(ModelNotFound, match="is not served here"):  # the edge's name, but the header says upstream
        await stage.run(request("edge", "upstream"))
    with pytest.raises(ModelNotFound, match="neither is configured"):
        await ResolveStage(catalog(edge=False)).run(request("auto"))
    with pytest.raises(InvalidRequest) as bad:
        await stage.run(request("gpt-4o-mini", "gpu"))
    assert bad.value.status == 400 and bad.value.payload()["error"]["param"] == "x-tierlane-route"


async def test_embeddings_always_go_upstream() -> None:
    stage = ResolveStage(catalog(STD, upstream_cfg("w", "http://127.0.0.1:9/v1", pool="wild")))
    assert await resolved(stage, "local", None, "embeddings") == ("upstream", "wild", "local", None)
    assert await resolved(stage, "small-model", "edge", "embeddings") == ("upstream", "standard", "small-model", "edge")


def test_the_resolve_stage_runs_first_for_every_operation() -> None:
    from gateway.pipeline import order

    assert order.STAGES[0] == ("gateway.pipeline.resolve", None)
    assert ResolveStage.operations == {"chat", "completions", "embeddings"}


def test_bad_route_header_on_embeddings_is_a_400(bg, make_gateway):
    up = RunningApp(bg, fault_app("ok", Recorder()))
    gw = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1")])
    r = httpx.post(gw.url + "/v1/embeddings", json={"model": "m", "input": "hi"}, headers={"x-tierlane-route": "gpu"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-tierlane-route"
