"""Model names: auto, discovery from wildcard upstreams, and the /v1/models listing."""

from __future__ import annotations

import httpx
from aiohttp import web

from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
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
