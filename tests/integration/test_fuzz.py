"""Fuzz: hostile bodies and parameters against the real app (edge engine, embedder, cache, router,
budgets, a real llama.cpp upstream). No answer may be a 5xx other than 502/503/504 with an OpenAI
error body, and the process and both lanes still answer afterwards.

Bounded: a fixed number of generated cases per endpoint and lane, derandomized so CI is repeatable.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import protocol
from gateway.keys import SERVICES
from tests.support.config import PASS_THROUGH
from tests.support.llama_server import UPSTREAM_MODEL

pytestmark = pytest.mark.slow

EXAMPLES = 100
FAST = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
ALLOWED_5XX = {502, 503, 504}


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"a": [value]}
    return value


HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 5e-324, 2**31, 2**63, 2**64, -1, 0]),
    st.text(max_size=12),
    st.sampled_from(["nan", "inf", "-1", "12", "true", "false", "\x00", "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), "é" * 3]),
    st.lists(st.one_of(st.integers(), st.text(max_size=4), st.none()), max_size=4),
    st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=4), st.none()), max_size=3),
    st.just(_nested(40)),
    st.just(_nested(140)),
    st.just("x" * 50_000),
)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]), "content": HOSTILE}),
    st.fixed_dictionaries({"role": HOSTILE, "content": st.text(max_size=20)}),
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": HOSTILE}), max_size=3)}
    ),
    HOSTILE,
)
CHAT_FIELDS = [
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "n", "stop", "seed", "presence_penalty", "frequency_penalty", "repeat_penalty", "top_k", "min_p", "logit_bias",
    "user", "tools", "tool_choice", "response_format", "logprobs", "top_logprobs", "guided_json",
]
MESSAGES_FIELDS = [
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "metadata", "stream",
    "tools", "tool_choice", "thinking", "output_config", "service_tier", "cache_control", "container",
]
RESPONSES_FIELDS = [
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "stream", "store",
    "previous_response_id", "tools", "tool_choice", "metadata", "reasoning", "truncation", "parallel_tool_calls",
    "background", "include",
]
BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "document", "input_text",
                              "function_call", "function_call_output", "message", "web_search_call"])},
    optional={"text": HOSTILE, "source": HOSTILE, "id": HOSTILE, "name": HOSTILE, "input": HOSTILE,
              "tool_use_id": HOSTILE, "content": HOSTILE, "call_id": HOSTILE, "arguments": HOSTILE, "output": HOSTILE,
              "role": st.sampled_from(["user", "assistant", "developer", "x"])},
)
FRONT_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": st.lists(BLOCK, max_size=3)}),
    BLOCK,
    MESSAGE,
)
COMPLETION_FIELDS = [f for f in CHAT_FIELDS if f not in ("messages", "tools", "tool_choice", "response_format")] + ["prompt", "echo", "best_of"]
EMBEDDING_FIELDS = ["model", "input", "encoding_format", "dimensions", "user"]


def _bodies(base: dict[str, Any], fields: list[str], messages: Any = MESSAGE) -> st.SearchStrategy[dict[str, Any]]:
    changes = st.dictionaries(st.sampled_from(fields), HOSTILE, min_size=1, max_size=3)
    for key in ("messages", "input"):
        if key in base:
            changes = st.one_of(changes, st.builds(lambda m, k=key: {k: m}, st.lists(messages, max_size=3)))
    return changes.map(lambda c: {**base, **c})


ENCODINGS = st.sampled_from(["utf-8", "json-nan", "utf-16", "latin-1", "bom"])


def _encode(body: dict[str, Any], encoding: str) -> bytes:
    text = json.dumps(body, allow_nan=True)  # NaN and Infinity written as JS literals, not JSON
    if encoding == "utf-16":
        return text.encode("utf-16")
    if encoding == "latin-1":
        return text.encode("latin-1", "replace")
    if encoding == "bom":
        return b"\xef\xbb\xbf" + text.encode("utf-8", "surrogatepass")
    return text.encode("utf-8", "surrogatepass")


def _bounded(operation: str, body: dict[str, Any]) -> dict[str, Any]:
    """A body that would be valid is kept short: hostile input is the point, long generations are not."""
    try:
        wire = protocol.validate(operation, body, max_n=8)
    except Exception:  # noqa: BLE001 - invalid (any reason): sent as is
        return body
    limit = getattr(wire, "output_limit", 0)
    if operation != "embeddings" and (limit is None or limit > 6):
        body = {**body, "max_tokens": 4}
        body.pop("max_completion_tokens", None)
    return body


def _bounded_front(body: dict[str, Any]) -> dict[str, Any]:
    """Front-door bodies asking for more than a few tokens (or none) ask for 4."""
    for key in ("max_tokens", "max_output_tokens"):
        value = body.get(key)
        if key in body and isinstance(value, int) and not isinstance(value, bool) and value > 6:
            body = {**body, key: 4}
    if "input" in body and "max_output_tokens" not in body:
        body = {**body, "max_output_tokens": 4}
    return body


def _check(r: httpx.Response, anthropic_shape: bool = False) -> None:
    assert r.status_code < 500 or r.status_code in ALLOWED_5XX, (r.status_code, r.text[:400])
    if r.status_code >= 400 and anthropic_shape:
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"], body
    elif r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    elif r.headers.get("Content-Type", "").startswith("text/event-stream"):
        assert "internal error in the gateway" not in r.text, r.text[:400]


@pytest.fixture(scope="module")
def gateway(bg, llama_upstream, tmp_path_factory):
    from gateway.app import create_app
    from gateway.settings import Settings
    from policies.policy import _deep_merge
    from tests.support.background import RunningApp

    data = _deep_merge(
        PASS_THROUGH,
        {
            "state_dir": str(tmp_path_factory.mktemp("fuzz") / "state"),
            "edge": {"enabled": True, "n_ctx": 512, "slots": 4, "n_threads": 1},
            "embedder": {"enabled": True},
            "upstreams": [{"name": "llama", "base_url": llama_upstream.base_url, "models": [UPSTREAM_MODEL], "retries": 0}],
            "policy": {
                "cache": {"enabled": True},
                "router": {"enabled": True},
                "cascade": {"enabled": True},
                "trim": {"enabled": True},
                "budgets": {"enabled": True, "tenant": {"daily_spend_usd": 1000.0}},
            },
        },
    )
    app = RunningApp(bg, create_app(Settings.load(env={}, overrides=data)))
    yield app
    app.stop()


def _post(gw: Any, path: str, body: dict[str, Any], encoding: str) -> httpx.Response:
    return httpx.post(gw.url + path, content=_encode(body, encoding), headers={"Content-Type": "application/json"}, timeout=120)


def _still_serving(gw: Any) -> None:
    for model in ("edge", UPSTREAM_MODEL, "auto"):
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3},
            timeout=60,
        )
        assert r.status_code == 200, (model, r.text)
    assert gw.app[SERVICES].engine.available


def _fuzz(gateway: Any, operation: str, base: dict[str, Any], fields: list[str]) -> None:
    """EXAMPLES hostile variants of `base` on one endpoint, then every lane must still answer."""
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}[operation]

    @FAST
    @given(body=_bodies(base, fields), encoding=ENCODINGS)
    def run(body: dict[str, Any], encoding: str) -> None:
        _check(_post(gateway, path, _bounded(operation, body), encoding))

    run()
    _still_serving(gateway)


@pytest.mark.parametrize("model", ["edge", UPSTREAM_MODEL, "auto"])
def test_chat_survives_hostile_bodies(gateway, model):
    base = {"model": model, "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 4}
    _fuzz(gateway, "chat", base, CHAT_FIELDS)


@pytest.mark.parametrize("model", ["edge", UPSTREAM_MODEL])
def test_completions_survive_hostile_bodies(gateway, model):
    _fuzz(gateway, "completions", {"model": model, "prompt": "One, two,", "max_tokens": 4}, COMPLETION_FIELDS)


def test_embeddings_survive_hostile_bodies(gateway):
    _fuzz(gateway, "embeddings", {"model": UPSTREAM_MODEL, "input": "hello"}, EMBEDDING_FIELDS)


@pytest.mark.parametrize("model", ["edge", UPSTREAM_MODEL, "auto"])
def test_messages_survive_hostile_bodies(gateway, model):
    base = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "What is 2 + 2?"}]}

    @settings(FAST, max_examples=EXAMPLES // 3)
    @given(body=_bodies(base, MESSAGES_FIELDS, FRONT_MESSAGE), encoding=ENCODINGS)
    def run(body: dict[str, Any], encoding: str) -> None:
        _check(_post(gateway, "/v1/messages", _bounded_front(body), encoding), anthropic_shape=True)

    run()
    _still_serving(gateway)


@pytest.mark.parametrize("model", ["edge", "auto"])
def test_responses_survive_hostile_bodies(gateway, model):
    base = {"model": model, "max_output_tokens": 4, "input": "What is 2 + 2?"}

    @settings(FAST, max_examples=EXAMPLES // 3)
    @given(body=_bodies(base, RESPONSES_FIELDS, FRONT_MESSAGE), encoding=ENCODINGS,
           path=st.sampled_from(["/v1/responses", "/v1/messages/count_tokens"]))
    def run(body: dict[str, Any], encoding: str, path: str) -> None:
        _check(_post(gateway, path, _bounded_front(body), encoding), anthropic_shape=path.startswith("/v1/messages"))

    run()
    _still_serving(gateway)


def test_stored_response_routes_survive_hostile_ids_and_parameters(gateway):
    made = httpx.post(gateway.url + "/v1/responses", json={"model": "edge", "input": "Hi.", "max_output_tokens": 2}, timeout=60)
    assert made.status_code == 200, made.text
    ids = st.one_of(st.just(made.json()["id"]), st.text(min_size=1, max_size=40).filter(lambda x: "/" not in x and x not in ".."))
    params = st.dictionaries(st.sampled_from(["limit", "order", "after", "include", "stream"]),
                             st.one_of(st.text(max_size=8), st.sampled_from(["0", "101", "-1", "1e9", "asc", "desc", "nan"])),
                             max_size=3)

    @settings(FAST, max_examples=EXAMPLES // 2)
    @given(response_id=ids, params=params, route=st.sampled_from(["get", "items", "delete"]))
    def run(response_id: str, params: dict[str, str], route: str) -> None:
        url = f"{gateway.url}/v1/responses/{quote(response_id, safe='')}"
        if route == "items":
            r = httpx.get(url + "/input_items", params=params, timeout=30)
        elif route == "get":
            r = httpx.get(url, params=params, timeout=30)
        else:
            r = httpx.delete(url, timeout=30)
        _check(r)

    run()


QUERY = st.dictionaries(
    st.sampled_from(["from", "to", "since", "group_by", "tenant", "app", "model", "lane", "limit", "tz", "bucket", "format"]),
    st.one_of(st.text(max_size=12), st.sampled_from(["nan", "inf", "-inf", "1e300", "-1e300", "9999-12-31", "0000-01-01", "1e-300"])),
    max_size=3,
)


def test_admin_reports_survive_hostile_parameters(gateway):
    @FAST
    @given(params=QUERY, path=st.sampled_from(["/v1/usage", "/v1/shadow", "/v1/dashboard"]))
    def run(params: dict[str, str], path: str) -> None:
        _check(httpx.get(gateway.url + path, params=params, timeout=30))

    run()
    _still_serving(gateway)
