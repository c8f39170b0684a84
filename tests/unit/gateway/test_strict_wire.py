"""The wire is validated strictly once: lax values, deep nesting and broken encodings are 400s, never 500s."""

from __future__ import annotations

import json
import zlib

import httpx
import orjson
import pytest

from gateway import protocol

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def gw(ok_gateway):
    return ok_gateway


def _nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


LAX = [
    ("stream as a string", {"stream": "false"}, "stream"),
    ("seed as a string", {"seed": "12"}, "seed"),
    ("seed as a float", {"seed": 1.5}, "seed"),
    ("seed beyond 64 bits", {"seed": 2**70}, "seed"),
    ("max_tokens as a float", {"max_tokens": 16.0}, "max_tokens"),
    ("max_tokens as a bool", {"max_tokens": True}, "max_tokens"),
    ("temperature as a string", {"temperature": "0.5"}, "temperature"),
    ("top_k as a string", {"top_k": "abc"}, "top_k"),
    ("top_k as a list", {"top_k": [1]}, "top_k"),
    ("min_p above 1", {"min_p": 2}, "min_p"),
    ("repeat_penalty of zero", {"repeat_penalty": 0}, "repeat_penalty"),
    ("include_usage as a string", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("logprobs as a string", {"logprobs": "true"}, "logprobs"),
    ("stop as a number", {"stop": 5}, "stop"),
    ("presence_penalty as a string", {"presence_penalty": "1"}, "presence_penalty"),
    ("a text part without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    ("message name as a number", {"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
]


@pytest.mark.parametrize(("name", "extra", "param"), LAX, ids=[c[0] for c in LAX])
def test_lax_values_are_refused_with_the_param(gw, name, extra, param):
    body = {"model": "fake-model", "messages": MSG, **extra}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert gw.rec.hits == 0


def test_an_integer_temperature_is_still_a_number(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake-model", "messages": MSG, "temperature": 0})
    assert r.status_code == 200, r.text


def test_stream_false_as_a_bool_does_not_stream(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake-model", "messages": MSG, "stream": False})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")


@pytest.mark.parametrize("where", ["messages", "extension", "tools"])
def test_deep_nesting_is_a_400_not_a_500(gw, where):
    deep = _nested(300)
    body: dict[str, object] = {"model": "fake-model", "messages": MSG}
    if where == "messages":
        body["messages"] = [{"role": "user", "content": "x", "extra": deep}]
    elif where == "extension":
        body["guided_json"] = deep
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    raw = json.dumps(body).encode()  # orjson itself refuses to write 255+ levels
    r = httpx.post(gw.url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"
    assert gw.rec.hits == 0


def test_nesting_at_the_limit_is_accepted():
    body = {"model": "m", "messages": MSG, "guided_json": _nested(protocol.MAX_DEPTH - 2)}
    assert protocol.parse_body(orjson.dumps(body)) == body


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_garbage_compressed_bodies_get_an_openai_400(gw, encoding):
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        content=b"\x1f\x8b\x08\x00garbage-that-is-not-compressed" * 3,
        headers={"Content-Type": "application/json", "Content-Encoding": encoding},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert gw.rec.hits == 0
    ok = httpx.post(gw.url + "/v1/chat/completions", json={"model": "fake-model", "messages": MSG})
    assert ok.status_code == 200


def test_a_real_gzip_body_is_read(gw):
    import gzip

    raw = gzip.compress(orjson.dumps({"model": "fake-model", "messages": MSG}))
    r = httpx.post(gw.url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    raw = zlib.compress(orjson.dumps({"model": "fake-model", "messages": MSG}))
    r = httpx.post(gw.url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json", "Content-Encoding": "deflate"})
    assert r.status_code == 200, r.text
