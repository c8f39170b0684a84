"""JSON mode: response_format to GBNF, and grammar-constrained sequences in the batched sampler."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from edge_engine import SamplingParams
from edge_engine.errors import InvalidInput
from edge_engine.json_mode import grammar_for

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PLAIN = ["What is the capital of France?", "List three fruits.", "Describe a cat."]


async def answer(engine, prompt: str, max_tokens: int = 96, **params: Any) -> tuple[str, str | None, int]:
    text, last = [], None
    async for event in engine.generate(
        messages=[{"role": "user", "content": prompt}], params=SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, **params})
    ):
        text.append(event.text)
        last = event
    assert last is not None
    return "".join(text), last.finish_reason, last.completion_tokens


def _person(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age"}
        and isinstance(value["name"], str)
        and type(value["age"]) is int
    )


# ---- pure ---------------------------------------------------------------------------


def test_grammar_for_each_response_format() -> None:
    assert grammar_for({"type": "text"}) is None
    assert "root" in (grammar_for({"type": "json_object"}) or "")
    grammar = grammar_for(SCHEMA_FORMAT) or ""
    assert grammar.count("::=") > 3 and '\\"age\\"' in grammar


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": "not an object"}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}},
        {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/missing"}}},
        {"type": "json_schema", "json_schema": {"schema": {"properties": {"a": {"$ref": "https://example.com/s.json"}}}}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}},
    ],
)
def test_schemas_that_cannot_be_converted_are_invalid_input(response_format) -> None:
    with pytest.raises(InvalidInput) as err:
        grammar_for(response_format)
    assert err.value.param == "response_format"


# ---- the engine ---------------------------------------------------------------------


@pytest.mark.slow
def test_json_answers_parse_beside_unconstrained_ones_whose_text_is_unchanged(runner) -> None:
    engine = runner.engine
    solo = [runner.run(answer(engine, p, max_tokens=48)) for p in PLAIN]
    any_object = grammar_for({"type": "json_object"})
    person = grammar_for(SCHEMA_FORMAT)

    async def together():
        return await asyncio.gather(
            answer(engine, "Give me a JSON object for a book: title and year.", grammar=any_object),
            answer(engine, "Give me a person as JSON with a name and an age.", grammar=person),
            answer(engine, "Who wrote Hamlet? Answer in JSON.", grammar=person),
            *(answer(engine, p, max_tokens=48) for p in PLAIN),
        )

    book, first, second, *plain = runner.run(together())
    assert plain == solo
    assert book[1] == "stop" and isinstance(json.loads(book[0]), dict), book
    for text, reason, _ in (first, second):
        assert reason == "stop" and _person(json.loads(text)), text


@pytest.mark.slow
def test_a_json_answer_cut_by_max_tokens_ends_with_length(runner) -> None:
    any_object = grammar_for({"type": "json_object"})
    text, reason, n = runner.run(answer(runner.engine, "Describe a cat as a JSON object.", max_tokens=6, grammar=any_object))
    assert reason == "length" and n == 6 and text.startswith("{")


@pytest.mark.slow
def test_a_json_answer_that_loops_inside_a_string_ends_with_loop(runner) -> None:
    # greedy SmolLM2 repeats "a sleek exterior, " inside the description until max_tokens
    any_object = grammar_for({"type": "json_object"})
    text, reason, n = runner.run(answer(runner.engine, "Make a JSON record of a car.", max_tokens=128, grammar=any_object))
    assert reason == "loop" and n < 64 and text.count("sleek exterior") == 1, text


@pytest.mark.slow
def test_a_grammar_llama_cpp_cannot_parse_is_invalid_input_at_submit(runner) -> None:
    for bad in ["root ::= missing-rule", 'root ::= "unterminated', "root ::= root \"x\"", 'other ::= "x"', 'root ::= "a\x00"']:
        with pytest.raises(InvalidInput) as err:
            runner.run(answer(runner.engine, "Hi", grammar=bad))
        assert err.value.param == "response_format"
    # the engine goes on serving
    assert runner.run(answer(runner.engine, "Say hello.", max_tokens=4))[1] == "length"


@pytest.mark.slow
def test_grammar_answers_are_the_same_with_drafts(spec_runner) -> None:
    scheduler = spec_runner.engine._scheduler
    person = grammar_for(SCHEMA_FORMAT)
    prompts = [
        'Fill this JSON from the record: name: Maria Lopez; age: 41.\n{"name": "Maria Lopez", "age": 41}',
        "Give me a person as JSON with a name and an age.",
    ]
    scheduler.speculate = False
    try:
        off = [spec_runner.run(answer(spec_runner.engine, p, grammar=person)) for p in prompts]
    finally:
        scheduler.speculate = True
    before = spec_runner.engine.stats()["spec_drafted_tokens_total"]
    on = [spec_runner.run(answer(spec_runner.engine, p, grammar=person)) for p in prompts]
    assert spec_runner.engine.stats()["spec_drafted_tokens_total"] > before
    assert on == off
    assert all(_person(json.loads(text)) for text, _, _ in on)


@pytest.mark.slow
def test_sampled_json_answers_follow_the_schema(runner) -> None:
    person = grammar_for(SCHEMA_FORMAT)

    async def sampled():
        return await asyncio.gather(
            *(answer(runner.engine, "Give me a person as JSON with a name and an age.", grammar=person,
                     temperature=0.8, seed=seed, repeat_penalty=1.1) for seed in (1, 2, 3))
        )

    for text, reason, _ in runner.run(sampled()):
        assert reason == "stop" and _person(json.loads(text)), text


@pytest.mark.slow
def test_the_grammar_beside_the_chain_picks_what_a_grammar_inside_it_would() -> None:
    """Greedy: the chain's pick checked against the grammar == the pick among allowed tokens only."""
    import llama_cpp

    from edge_engine import bundled_model_path
    from edge_engine.chat_template import ChatTemplate
    from edge_engine.llama_model import BatchEntry, LlamaContext, LlamaModel
    from edge_engine.sampling import build_sampler, grammar_sampler

    model = LlamaModel(bundled_model_path())
    ctx = LlamaContext(model, n_ctx=256, n_batch=256, n_seq_max=1, n_threads=1, flash_attn=True, kv_cache_type="q8_0")
    grammar = grammar_for({"type": "json_object"}) or ""
    beside = build_sampler(SamplingParams(temperature=0.0, grammar=grammar), 0, model.n_vocab, model.vocab)
    inside = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(inside, grammar_sampler(model.vocab, grammar))
    llama_cpp.llama_sampler_chain_add(inside, llama_cpp.llama_sampler_init_greedy())
    try:
        prompt = model.tokenize(ChatTemplate(model).render([{"role": "user", "content": "Describe a dog in JSON."}]), add_special=False)
        assert ctx.decode([BatchEntry(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)]) == 0
        tokens, pos = [], len(prompt)
        for _ in range(40):
            token = ctx.sample(beside, -1)
            assert llama_cpp.llama_sampler_sample(inside, ctx.ptr, -1) == token
            if model.is_eog(token):
                break
            tokens.append(token)
            assert ctx.decode([BatchEntry(token, pos, 0, True)]) == 0
            pos += 1
        assert beside.rejected >= 1  # the model's own first pick is not JSON ("```" or prose)
        assert b"".join(model.piece(t) for t in tokens).startswith(b"{")
    finally:
        beside.close()
        llama_cpp.llama_sampler_free(inside)
        ctx.close()
        model.close()
