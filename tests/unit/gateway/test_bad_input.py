"""Bad requests get a clear OpenAI-style 4xx, and the gateway keeps serving."""

from __future__ import annotations

import httpx
import pytest

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def gw(ok_gateway):
    return ok_gateway


CASES = [
    ("truncated json", b'{"model": "fake-model", "messages": [', 400, None, "invalid_json"),
    ("not an object", b"[1, 2]", 400, None, "invalid_json"),
    ("empty body", b"", 400, None, "invalid_json"),
    ("non-utf8 bytes", b'{"model": "fake-model", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None, "invalid_json"),
    ("missing messages", b'{"model": "fake-model"}', 400, "messages", "missing_required_parameter"),
    ("empty messages", b'{"model": "fake-model", "messages": []}', 400, "messages", "invalid_value"),
    ("unknown role", b'{"model": "fake-model", "messages": [{"role": "wizard", "content": "x"}]}', 400, "messages[0].role", "invalid_value"),
    ("wrong type", b'{"model": "fake-model", "messages": "hello"}', 400, "messages", "invalid_value"),
    ("wrong content type", b'{"model": "fake-model", "messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content", "invalid_value"),
    ("negative max_tokens", b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400, "max_tokens", "invalid_value"),
    ("n over the limit", b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "n": 50}', 400, "n", "invalid_value"),
    ("temperature out of range", b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "temperature": 7}', 400, "temperature", "invalid_value"),
    ("missing model", b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model", "missing_required_parameter"),
    ("unknown model", b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("name", "raw", "status", "param", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error(gw, name, raw, status, param, code):
    r = httpx.post(gw.url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert err["code"] == code
    assert err["message"]
    assert r.headers["x-request-id"]
    assert gw.rec.hits == 0  # nothing reached the upstream
    ok = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake-model", "messages": MSG})
    assert ok.status_code == 200


def test_ten_megabyte_body_is_413(gw):
    raw = b'{"model": "fake-model", "messages": [{"role": "user", "content": "' + b"a" * (10 * 1024 * 1024) + b'"}]}'
    r = httpx.post(gw.url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(gw.url + "/healthz").json() == {"status": "ok"}


def test_bad_route_header(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake-model", "messages": MSG}, headers={"x-tierlane-route": "moon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-tierlane-route"


def test_unknown_path_and_method(gw):
    r = httpx.get(gw.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(gw.url + "/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["Allow"]


def test_completions_and_embeddings_validate_too(gw):
    r = httpx.post(gw.url + "/v1/completions", json={"model": "fake-model"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(gw.url + "/v1/embeddings", json={"model": "fake-model", "input": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_too_many_items_is_a_400_in_each_apis_shape(gw):
    """Validation walks every message, item, part and tool on the event loop: their number is bounded."""
    many = [{"role": "user", "content": "x"}] * 9000
    chat = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake-model", "messages": many}, timeout=30)
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "too_many_items"
    assert chat.json()["error"]["param"] == "messages"
    parts = [{"role": "user", "content": [{"type": "text", "text": "x"}] * 5000}] * 2
    messages = httpx.post(gw.url + "/v1/messages", json={"model": "fake-model", "max_tokens": 8, "messages": parts}, timeout=30)
    assert messages.status_code == 400 and messages.json()["type"] == "error"
    assert "server.max_items" in messages.json()["error"]["message"]
    responses = httpx.post(gw.url + "/v1/responses", json={"model": "fake-model", "input": many}, timeout=30)
    assert responses.status_code == 400 and responses.json()["error"]["code"] == "too_many_items"
    fine = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake-model", "messages": many[:100]}, timeout=30)
    assert fine.status_code == 200
