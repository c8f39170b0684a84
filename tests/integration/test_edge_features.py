"""OpenAI features the edge lane implements: logprobs (chat and completions, JSON and SSE) and JSON mode."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.app import create_app
from gateway.settings import Settings
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH

pytestmark = pytest.mark.slow  # the edge engine or the embedder loads a real model

EDGE_ON = {**PASS_THROUGH, "edge": {"enabled": True, "n_ctx": 1024, "slots": 4, "n_threads": 1}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gw(bg, tmp_path_factory):
    """One gateway for the module: the engine's model loads once."""
    settings = Settings.load(env={}, overrides={**EDGE_ON, "state_dir": str(tmp_path_factory.mktemp("gw") / "state")})
    app = RunningApp(bg, create_app(settings))
    yield app
    app.stop()


@pytest.fixture
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)


def test_chat_logprobs_have_openais_shape_and_match_the_text(client):
    raw = client.chat.completions.with_raw_response.create(
        model="edge", messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    answer = ChatCompletion.model_validate(json.loads(raw.text))  # the SDK's own types, strictly parsed
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0.0
        assert bytes(entry.bytes or []).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)

    chunks = list(client.chat.completions.create(
        model="edge", messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)


def test_no_logprobs_unless_asked(client):
    answer = client.chat.completions.create(model="edge", messages=QUESTION, max_tokens=4, temperature=0)
    assert answer.choices[0].logprobs is None
    chosen_only = client.chat.completions.create(model="edge", messages=QUESTION, max_tokens=4, temperature=0, logprobs=True)
    assert chosen_only.choices[0].logprobs.content
    assert all(entry.top_logprobs == [] for entry in chosen_only.choices[0].logprobs.content)


def test_completions_logprobs_have_openais_shape(client):
    raw = client.completions.with_raw_response.create(
        model="edge", prompt="One, two, three,", max_tokens=6, temperature=0, logprobs=2)
    answer = Completion.model_validate(json.loads(raw.text))
    choice = answer.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and "".join(lp.tokens) == choice.text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 and max(top.values()) <= 0.0 for top in lp.top_logprobs)
    streamed = [t for c in client.completions.create(model="edge", prompt="One, two, three,", max_tokens=6,
                                                   temperature=0, logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_json_object_mode_answers_parse(client):
    for prompt in ("Describe a cat.", "List three fruits.", "Say hello in French"):
        answer = client.chat.completions.create(
            model="edge", messages=[{"role": "user", "content": prompt}], max_tokens=96, temperature=0,
            response_format={"type": "json_object"})
        choice = answer.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), (dict, list))
        else:  # cut by max_tokens: a prefix of JSON, never prose
            assert choice.message.content.lstrip().startswith(("{", "["))


def test_json_schema_mode_answers_follow_the_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    answer = client.chat.completions.create(
        model="edge", messages=[{"role": "user", "content": "Name a big city and its population as JSON."}],
        max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert answer.choices[0].finish_reason == "stop"
    value = json.loads(answer.choices[0].message.content)
    assert set(value) == {"city", "population"}
    assert isinstance(value["city"], str) and isinstance(value["population"], int)


def test_a_schema_the_grammar_cannot_express_is_a_400_naming_response_format(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/remote.json"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="edge", messages=QUESTION, max_tokens=4, response_format=bad)
    assert info.value.body["param"] == "response_format"
    assert info.value.body["code"] == "unsupported_on_edge"


def test_a_looping_greedy_answer_is_cut_short(client):
    # Greedy SmolLM2 answers this with a French verse it repeats until max_tokens when nothing
    # stops it (tests/unit/edge_engine/test_confidence.py shows both, with the stop on and off).
    answer = client.chat.completions.create(model="edge", messages=QUESTION, max_tokens=200, temperature=0)
    choice = answer.choices[0]
    # the engine stops the loop, reported to clients as "length" (the answer was cut short), long
    # before max_tokens, and the repeats it held back are not in the text
    assert choice.finish_reason == "length", choice
    assert answer.usage.completion_tokens < 200
    assert choice.message.content.count("la femme au martyre") == 1, choice.message.content
