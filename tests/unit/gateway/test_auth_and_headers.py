"""API keys, tenant mapping and the headers on every answer."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.auth import KeyTable, hash_key
from gateway.errors import AuthenticationFailed
from gateway.settings import AuthSettings
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def test_key_table_maps_keys_to_tenants():
    table = KeyTable(AuthSettings(mode="keys", keys=[{"sha256": hash_key("k-acme"), "tenant": "acme", "app": "web"}]))
    p = table.resolve("Bearer k-acme")
    assert (p.tenant, p.app, p.admin) == ("acme", "web", False)
    for bad in (None, "", "Bearer", "Bearer wrong", "Basic k-acme"):
        with pytest.raises(AuthenticationFailed):
            table.resolve(bad)


def test_settings_reject_a_key_that_is_not_a_digest():
    with pytest.raises(ValueError):
        AuthSettings(mode="keys", keys=[{"sha256": "plaintext-key", "tenant": "a"}])


@pytest.fixture
def keyed(bg, make_gateway):
    up = RunningApp(bg, fault_app("ok", Recorder()))
    return make_gateway(
        upstreams=[upstream_cfg("a", up.url + "/v1")],
        auth={"mode": "keys", "keys": [{"sha256": hash_key("k-acme"), "tenant": "acme", "app": "web"}]},
    )


def test_missing_or_wrong_key_is_401(keyed):
    r = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    r = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(**CHAT)


def test_right_key_passes_and_health_needs_none(keyed):
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key="k-acme", max_retries=0)
    assert client.chat.completions.create(**CHAT).choices[0].message.content == "hello there"
    assert httpx.get(keyed.url + "/healthz").status_code == 200


def test_every_answer_carries_the_gateway_headers(keyed):
    ok = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k-acme", "x-request-id": "abc-1"})
    bad = httpx.post(keyed.url + "/v1/chat/completions", json={"model": "fake-model"}, headers={"Authorization": "Bearer k-acme"})
    denied = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT)
    for r in (ok, bad, denied):
        assert r.headers["x-request-id"]
        assert "x-tierlane-lane" in r.headers
        assert float(r.headers["x-tierlane-overhead-ms"]) >= 0
    assert ok.headers["x-request-id"] == "abc-1"
    assert ok.headers["x-tierlane-lane"] == "upstream:default"
