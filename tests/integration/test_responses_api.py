"""The OpenAI Responses API through the gateway, with the official `openai` SDK.

Text answers come from the real llama.cpp upstream; stored conversations are checked against
what a recording upstream was sent; the tool round trip uses the tool upstream (see
tests/support/tool_upstream.py for why).
"""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from gateway.auth import hash_key
from gateway.keys import SERVICES
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app
from tests.support.llama_server import UPSTREAM_MODEL
from tests.support.tool_upstream import ARGUMENTS, TOOL, tool_app, weather

pytestmark = pytest.mark.slow

WEATHER_TOOL = {"type": "function", "name": TOOL, "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
KEY_A, KEY_B = "tl-responses-tenant-a", "tl-responses-tenant-b"


def client(gw, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture
def recorded(bg, make_gateway):
    """A gateway in keys mode (two tenants) before an upstream that records what it is sent."""
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text="Blue is a colour"))
    keys = [{"sha256": hash_key(KEY_A), "tenant": "a"}, {"sha256": hash_key(KEY_B), "tenant": "b"}]
    gw = make_gateway(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"])], auth={"mode": "keys", "keys": keys})
    gw.rec = rec  # type: ignore[attr-defined]
    return gw


def test_create_and_stream_give_the_same_response(llama_upstream, make_gateway):
    gw = make_gateway(upstreams=[upstream_cfg("llama", llama_upstream.base_url, models=[UPSTREAM_MODEL])])
    sdk = client(gw)
    kw = dict(model=UPSTREAM_MODEL, input="Name one colour of the rainbow.", instructions="Answer briefly.",
              max_output_tokens=12, temperature=0, store=False)
    whole = sdk.responses.create(**kw)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.output[0].type == "message"
    assert whole.usage is not None and whole.usage.output_tokens > 0
    with sdk.responses.stream(**kw) as stream:
        events = [event for event in stream]
    # the SDK's accumulator gives the final response of a completed stream; an incomplete one
    # (max_output_tokens reached) ends with response.incomplete, which carries it too
    final = stream.get_final_response() if whole.status == "completed" else events[-1].response
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert kind in kinds, kind
    assert final.output_text == whole.output_text
    assert final.status == whole.status
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens
    if whole.status == "incomplete":
        assert whole.incomplete_details is not None and whole.incomplete_details.reason == "max_output_tokens"


def test_two_turns_through_previous_response_id(recorded):
    sdk = client(recorded, KEY_A)
    first = sdk.responses.create(model="m", input="Name a colour.", instructions="Be brief.")
    assert first.store and first.output_text == "Blue is a colour"
    second = sdk.responses.create(model="m", input="And another?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    sent = recorded.rec.bodies[-1]["messages"]
    # the instructions of the first turn are not carried over (as the Responses API does)
    assert sent == [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue is a colour"},
        {"role": "user", "content": "And another?"},
    ]
    with sdk.responses.stream(model="m", input="A third?", previous_response_id=second.id) as stream:
        third = stream.get_final_response()
    assert len(recorded.rec.bodies[-1]["messages"]) == 5
    assert sdk.responses.retrieve(third.id).output_text == third.output_text


def test_retrieve_input_items_delete_and_tenant_scope(recorded):
    sdk = client(recorded, KEY_A)
    made = sdk.responses.create(model="m", input=[
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
    ])
    got = sdk.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text
    items = list(sdk.responses.input_items.list(made.id, order="asc", limit=2))
    assert [item.role for item in items] == ["user", "assistant", "user"]  # the SDK follows the pages
    assert items[2].content[0].text == "Name a colour."
    other = client(recorded, KEY_B)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="m", input="Go on.", previous_response_id=made.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(made.id)
    sdk.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(made.id)
    unstored = sdk.responses.create(model="m", input="Hi.", store=False)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_round_trip(bg, make_gateway, stream):
    rec = Recorder()
    up = RunningApp(bg, tool_app(rec))
    gw = make_gateway(upstreams=[upstream_cfg("tools", up.url + "/v1", models=["tool-model"])])
    sdk = client(gw)
    kw = dict(model="tool-model", tools=[WEATHER_TOOL], max_output_tokens=16)
    if stream:
        with sdk.responses.stream(input="Weather in Paris?", **kw) as s:
            kinds = [event.type for event in s]
            first = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    else:
        first = sdk.responses.create(input="Weather in Paris?", **kw)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == TOOL and call.arguments == ARGUMENTS
    second = sdk.responses.create(
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": weather(call.arguments)}], **kw)
    assert second.output_text == "It is sunny in Paris."
    sent = rec.bodies[-1]["messages"]
    assert sent[-2]["tool_calls"][0]["id"] == call.call_id
    assert sent[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny in Paris"}


def test_errors_are_openai_errors(recorded):
    with pytest.raises(openai.AuthenticationError):
        client(recorded, "wrong").responses.create(model="m", input="Hi.")
    sdk = client(recorded, KEY_A)
    searched = sdk.responses.with_raw_response.create(model="m", input="Search.", tools=[{"type": "web_search"}],
                                                      store=False)
    assert searched.headers["x-tierlane-dropped"] == "tools.web_search" and searched.parse().output_text
    with pytest.raises(openai.BadRequestError) as unsupported:
        sdk.responses.create(model="m", input="Hi.", extra_body={"conversation": "conv_1"})
    assert unsupported.value.body["param"] == "conversation"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.responses.create(model="m", input="Hi.", temperature=3)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model="nope", input="Hi.")
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model="m", input="Hi.", previous_response_id="resp_missing")
    wrong = httpx.put(recorded.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY_A}"})
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    dropped = sdk.responses.create(model="m", input="Hi.", reasoning={"effort": "low"}, truncation="auto",
                                   service_tier="auto", store=False)
    assert dropped.output_text


def test_stored_responses_are_shared_through_valkey(bg, valkey, make_gateway):
    """With state.backend redis two replicas serve one conversation; tenants stay apart there too."""
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text="Blue is a colour"))
    keys = [{"sha256": hash_key(KEY_A), "tenant": "a"}, {"sha256": hash_key(KEY_B), "tenant": "b"}]
    settings = dict(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"])], auth={"mode": "keys", "keys": keys},
                    state={"backend": "redis", "url": valkey.url, "op_timeout_ms": 1000})
    one, two = make_gateway(**settings), make_gateway(**settings)
    first = client(one, KEY_A).responses.create(model="m", input="Name a colour.")
    second = client(two, KEY_A).responses.create(model="m", input="Another?", previous_response_id=first.id)
    assert [m["content"] for m in rec.bodies[-1]["messages"]] == ["Name a colour.", "Blue is a colour", "Another?"]
    assert client(one, KEY_A).responses.retrieve(second.id).output_text == "Blue is a colour"
    with pytest.raises(openai.NotFoundError):
        client(two, KEY_B).responses.retrieve(first.id)
    client(two, KEY_A).responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client(one, KEY_A).responses.retrieve(first.id)


def test_a_chain_is_bounded_like_one_request(bg, make_gateway):
    """previous_response_id assembles the conversation: the body limit applies to what is assembled."""
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text="Noted."))
    gw = make_gateway(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"])], server={"max_body_bytes": 4096})
    sdk = client(gw)
    first = sdk.responses.create(model="m", input="a" * 2500)
    second = sdk.responses.create(model="m", input="b" * 1000, previous_response_id=first.id)
    with pytest.raises(openai.APIStatusError) as too_big:
        sdk.responses.create(model="m", input="c" * 1000, previous_response_id=second.id)
    assert too_big.value.status_code == 413 and too_big.value.body["param"] == "previous_response_id"
    assert len(rec.bodies) == 2  # the oversized conversation never went upstream


@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_stored_responses_are_held_to_a_per_tenant_quota_and_chains_are_links(bg, make_gateway, request, backend):
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text="Noted."))
    keys = [{"sha256": hash_key(KEY_A), "tenant": "a"}, {"sha256": hash_key(KEY_B), "tenant": "b"}]
    state = {"backend": "redis", "url": request.getfixturevalue("valkey").url, "op_timeout_ms": 1000} if backend == "redis" else {}
    gw = make_gateway(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"])], auth={"mode": "keys", "keys": keys},
                      responses={"max_records_per_tenant": 3}, state=state)
    sdk = client(gw, KEY_A)
    first = sdk.responses.create(model="m", input="x" * 3000)
    second = sdk.responses.create(model="m", input="Go on.", previous_response_id=first.id)
    third = sdk.responses.create(model="m", input="And?", previous_response_id=second.id)
    # the chain is read back through its links: the whole conversation reached the upstream
    assert [m["content"] for m in rec.bodies[-1]["messages"]] == ["x" * 3000, "Noted.", "Go on.", "Noted.", "And?"]
    with pytest.raises(openai.RateLimitError) as full:  # a fourth stored response: past the quota, before any work
        sdk.responses.create(model="m", input="More.", previous_response_id=third.id)
    assert full.value.body["code"] == "insufficient_quota" and full.value.body["type"] == "insufficient_quota"
    assert len(rec.bodies) == 3
    assert sdk.responses.create(model="m", input="More.", previous_response_id=third.id, store=False).output_text
    assert client(gw, KEY_B).responses.create(model="m", input="Hi.").output_text  # another tenant's quota
    sdk.responses.delete(second.id)  # room again; the chain now starts after the deleted turn
    sdk.responses.create(model="m", input="Last.", previous_response_id=third.id)
    assert [m["content"] for m in rec.bodies[-1]["messages"]] == ["And?", "Noted.", "Last."]
    store = gw.app[SERVICES].responses
    record = bg.call(store.get("a", third.id))
    assert record["previous"] == second.id and "context" not in record  # a link, not a copy
    assert len(orjson.dumps(record)) < 3000  # the first turn's 3,000 characters are stored once, in its own record
