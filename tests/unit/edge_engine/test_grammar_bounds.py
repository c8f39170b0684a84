"""Grammar bounds: no schema reaches llama.cpp that could crash it, stall the engine or be refused there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from edge_engine.errors import GrammarTooComplex, InvalidInput
from edge_engine.grammar import GrammarCompiler, check_grammar_text, check_pattern, convert
from edge_engine.settings import GrammarSettings

LIMITS = GrammarSettings()


def fmt(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


HOSTILE = [
    {"type": "string", "maxLength": 30000},  # crashed llama.cpp's parser (recursion on 30,000 nested groups)
    {"type": "string", "maxLength": 10000},  # refused by llama.cpp's parse, after the capability check let it through
    {"type": "string", "minLength": 10**9},  # the converter would build a billion-character rule
    {"type": "array", "items": {"type": "integer"}, "maxItems": 20000},
    {"type": "array", "items": {"type": "string"}, "minItems": 5000},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 25000}}},
    {"type": "string", "pattern": "^a{0,30000}$"},
    {"type": "string", "pattern": "^(a{0,200}){0,200}$"},  # nested bounds multiply
    {"type": "string", "pattern": "^((ab){10}c{0,20}){0,60}$"},
    {"enum": [f"v{i}" for i in range(50_000)]},
    {"anyOf": [{"const": i} for i in range(2000)]},
]


@pytest.mark.parametrize("schema", HOSTILE, ids=lambda s: json.dumps(s)[:50])
def test_hostile_schemas_are_refused_before_llama_cpp(schema: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_cpp import llama_grammar

    converted: list[str] = []
    real = llama_grammar.json_schema_to_gbnf

    def spy(schema_text: str, *args: Any, **kwargs: Any) -> Any:
        converted.append(schema_text)
        return real(schema_text, *args, **kwargs)

    monkeypatch.setattr(llama_grammar, "json_schema_to_gbnf", spy)
    with pytest.raises(GrammarTooComplex) as err:
        convert(fmt(schema), LIMITS)
    assert err.value.code == "grammar_too_complex" and err.value.param == "response_format"
    assert converted == []  # refused before the work (llama.cpp's converter), not after it


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 500},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 100},
        {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        {"enum": ["red", "green", "blue"]},
        {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}},
        {"type": "object", "properties": {"next": {"$ref": "#/definitions/n"}}, "definitions": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/definitions/n"}}}}},
    ],
    ids=lambda s: json.dumps(s)[:50],
)
def test_ordinary_schemas_pass(schema: Any) -> None:
    grammar = convert(fmt(schema), LIMITS)
    assert grammar and "root" in grammar


def test_pattern_bounds_multiply_along_nesting_only() -> None:
    check_pattern("^a{0,900}b{0,900}$", LIMITS)  # side by side: each within the bound
    check_pattern(r"^\{[0-9]{3}\}(x){0,10}$", LIMITS)  # escaped braces are no quantifier
    with pytest.raises(GrammarTooComplex):
        check_pattern("^(a{0,40}){0,40}$", LIMITS)


def test_grammar_text_bounds() -> None:
    limits = GrammarSettings(max_rules=3, max_alternatives=2, max_depth=8, max_grammar_bytes=1024)
    check_grammar_text('root ::= "a" | "b"\nx ::= ("(" [)(] ")")', limits)  # brackets inside literals and classes
    with pytest.raises(GrammarTooComplex, match="rules"):
        check_grammar_text("a ::= b\nb ::= c\nc ::= d\nd ::= \"x\"", limits)
    with pytest.raises(GrammarTooComplex, match="alternatives"):
        check_grammar_text('root ::= "a" | "b" | "c" | "d"', limits)
    with pytest.raises(GrammarTooComplex, match="deep"):
        check_grammar_text("root ::= " + "(" * 9 + '"a"' + ")" * 9, limits)
    with pytest.raises(GrammarTooComplex, match="bytes"):
        check_grammar_text('root ::= "' + "a" * 2000 + '"', limits)
    with pytest.raises(GrammarTooComplex, match="repeats"):
        check_grammar_text('root ::= "a"{0,5000}', GrammarSettings())


async def test_the_compiler_caches_results_and_refusals_and_shares_work() -> None:
    parsed: list[str] = []
    compiler = GrammarCompiler(LIMITS, parse=parsed.append)
    try:
        person = fmt({"type": "object", "properties": {"name": {"type": "string"}}})
        first, second = await asyncio.gather(compiler.compile(person), compiler.compile(dict(reversed(list(person.items())))))
        assert first == second and len(parsed) == 1 and compiler.known(first or "")
        hostile = fmt({"type": "string", "maxLength": 30000})
        for _ in range(3):
            with pytest.raises(GrammarTooComplex):
                await compiler.compile(hostile)
        assert compiler.refused_total == 1  # the refusal is cached too
        assert await compiler.compile({"type": "text"}) is None
        with pytest.raises(InvalidInput):
            await compiler.compile({"type": "xml"})
    finally:
        compiler.close()


async def test_a_slow_compile_is_refused_at_its_deadline() -> None:
    release = threading.Event()

    def slow_parse(grammar: str) -> None:  # done only once the test is: never within the deadline
        release.wait(60)

    compiler = GrammarCompiler(GrammarSettings(compile_timeout_s=0.05), parse=slow_parse)
    try:
        with pytest.raises(GrammarTooComplex, match="longer than"):
            await compiler.compile({"type": "json_object"})
    finally:
        release.set()
        compiler.close()


async def test_a_compile_nobody_waits_for_any_more_is_cancelled_before_it_runs() -> None:
    """Ordered by events, not sleeps: the first compile holds the compiler's one thread until the
    second's client has left; a third, queued after both, ends only once the second had its turn."""
    parsed: list[str] = []
    busy, release = threading.Event(), threading.Event()

    def slow_parse(grammar: str) -> None:
        parsed.append(grammar)
        if len(parsed) == 1:
            busy.set()
            release.wait(60)

    compiler = GrammarCompiler(LIMITS, parse=slow_parse)
    try:
        first = asyncio.ensure_future(compiler.compile({"type": "json_object"}))
        assert await asyncio.to_thread(busy.wait, 60)  # the compiler's one thread is busy with the first
        gone = asyncio.ensure_future(compiler.compile(fmt({"type": "string", "maxLength": 5})))
        await asyncio.sleep(0)
        gone.cancel()  # its client left before its compile started
        with contextlib.suppress(asyncio.CancelledError):
            await gone  # ended: its queued compile is cancelled on the way out
        release.set()
        await first
        third = fmt({"type": "integer"})
        assert await compiler.compile(third) is not None  # run after the second's turn (one thread, in order)
        assert parsed == [parsed[0], convert(third, LIMITS)]  # the second was never parsed
    finally:
        release.set()
        compiler.close()


@pytest.mark.slow
def test_the_schema_that_crashed_the_process_is_refused_by_the_engine_path() -> None:
    """In a child process: before the bounds, llama.cpp's parser died with SIGSEGV on this schema."""
    code = textwrap.dedent(
        """
        import asyncio, json
        from edge_engine import EdgeEngine, EdgeSettings
        from edge_engine.errors import InvalidInput

        async def main():
            engine = EdgeEngine(EdgeSettings(n_threads=1, n_ctx=256, slots=1, prefix_slots=0))
            await engine.start()
            try:
                for n in (30000, 10000):
                    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "maxLength": n}}}
                    try:
                        await engine.compile_grammar(fmt)
                        print(n, "compiled")
                    except InvalidInput as exc:
                        print(n, exc.code)
            finally:
                await engine.close()

        asyncio.run(main())
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["30000 grammar_too_complex", "10000 grammar_too_complex"], proc.stdout
