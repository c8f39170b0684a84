"""JSON-mode grammars, compiled within bounds: the one path from a `response_format` to llama.cpp.

A schema is turned into GBNF by llama-cpp-python's converter and parsed by llama.cpp; neither
bounds its work. The converter writes a `maxLength: 30000` out as 30,000 nested optional groups,
which llama.cpp's recursive parser cannot take (the process dies); a `minItems: 10**9` makes the
converter build a billion-item string; an enum of 50,000 values becomes 50,000 alternatives that
every sampled token is checked against. So, in order, each step bounded by `GrammarSettings`:

1. the schema, before conversion: its size, its enum and const values, and every length, count
   and `{m,n}` bound in it (nested pattern bounds multiply);
2. the grammar, after conversion: its size, rules, nesting of groups and alternatives;
3. llama.cpp's own parse of it.

All three run on the compiler's own thread (never the event loop, never the scheduler thread)
under a deadline, and the result, a grammar or the refusal, is cached by the schema's canonical
JSON. The route stage's capability check and the engine call the same `GrammarCompiler`, so a
request the check let through is never refused by the engine later, and a hostile schema sent
again costs a dictionary lookup.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from edge_engine.errors import GrammarTooComplex, InvalidInput
from edge_engine.settings import GrammarSettings

PARAM = "response_format"
_BOUND_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains", "maxContains")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def check_schema(schema: Any, limits: GrammarSettings) -> None:
    """Raises GrammarTooComplex for a schema whose conversion would be unbounded (before converting it)."""
    enum_values = 0
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, Mapping):
            continue
        for key in _BOUND_KEYS:
            value = node.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > limits.max_bound:
                raise GrammarTooComplex(
                    f"response_format json_schema: {key} {value:g} is past the edge's bound of {limits.max_bound}",
                    param=PARAM,
                )
        enum = node.get("enum")
        if isinstance(enum, list):
            enum_values += len(enum)
        if "const" in node:
            enum_values += 1
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            check_pattern(pattern, limits)
        stack.extend(v for k, v in node.items() if k not in ("enum", "const"))
    if enum_values > limits.max_enum_values:
        raise GrammarTooComplex(
            f"response_format json_schema has {enum_values} enum/const values; the edge takes at most {limits.max_enum_values}",
            param=PARAM,
        )


def check_pattern(pattern: str, limits: GrammarSettings) -> None:
    """A pattern's `{m,n}` bounds, multiplied along their nesting, must stay within max_bound.

    The converter writes each bounded repetition out, so `(a{100}){100}` costs 10,000 copies:
    each open group keeps the largest product of bounds inside it, and a group closed with a
    quantifier hands its parent that product times its own bound.
    """
    inner = [1]  # per open group (the whole pattern first): the largest product of bounds inside it
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a class: no groups or quantifiers inside
            i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
            continue
        if c == "(":
            inner.append(1)
            i += 1
            continue
        if c == ")":
            group = inner.pop() if len(inner) > 1 else 1
            match = _QUANTIFIER.match(pattern, i + 1)
            times = _upper(match) if match else 1
            inner[-1] = max(inner[-1], group * times)
            i = match.end() if match else i + 1
        elif c == "{" and (match := _QUANTIFIER.match(pattern, i)):
            times = _upper(match)
            inner[-1] = max(inner[-1], times)
            i = match.end()
        else:
            i += 1
        if max(inner) > limits.max_bound:
            raise GrammarTooComplex(
                f"response_format json_schema: a pattern repeats more than the edge's bound of {limits.max_bound}",
                param=PARAM,
            )


def _upper(match: re.Match[str]) -> int:
    low, high = match.group(1), match.group(2)
    if high is None or high == "":
        return max(1, int(low))
    return max(1, int(high), int(low))


def check_grammar_text(grammar: str, limits: GrammarSettings) -> None:
    """Raises GrammarTooComplex for a GBNF grammar past the bounds (size, rules, nesting, alternatives, {m,n})."""
    if len(grammar) > limits.max_grammar_bytes:
        raise GrammarTooComplex(
            f"the grammar for this response_format would be {len(grammar)} bytes; the edge takes at most "
            f"{limits.max_grammar_bytes}",
            param=PARAM,
        )
    rules = alternatives = depth = deepest = 0
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == '"':  # a literal: skip it (escapes included)
            i += 1
            while i < n and grammar[i] != '"':
                i += 2 if grammar[i] == "\\" else 1
        elif c == "[":  # a character class
            i += 1
            while i < n and grammar[i] != "]":
                i += 2 if grammar[i] == "\\" else 1
        elif c == "#":  # a comment, to the end of the line
            while i < n and grammar[i] != "\n":
                i += 1
            continue
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        elif c == "|":
            alternatives += 1
        elif c == "{":
            match = _QUANTIFIER.match(grammar, i)
            if match and _upper(match) > limits.max_bound:
                raise GrammarTooComplex(
                    f"the grammar for this response_format repeats an item {_upper(match)} times; the edge takes at most "
                    f"{limits.max_bound}",
                    param=PARAM,
                )
        elif c == ":" and grammar.startswith("::=", i):
            rules += 1
            i += 3
            continue
        i += 1
    if deepest > limits.max_depth:
        raise GrammarTooComplex(
            f"the grammar for this response_format nests {deepest} groups deep; the edge takes at most {limits.max_depth} "
            "(a long maxLength or maxItems does this)",
            param=PARAM,
        )
    if rules > limits.max_rules:
        raise GrammarTooComplex(
            f"the grammar for this response_format has {rules} rules; the edge takes at most {limits.max_rules}", param=PARAM
        )
    if alternatives > limits.max_alternatives:
        raise GrammarTooComplex(
            f"the grammar for this response_format has {alternatives} alternatives; the edge takes at most "
            f"{limits.max_alternatives}",
            param=PARAM,
        )


def convert(response_format: Mapping[str, Any], limits: GrammarSettings) -> str | None:
    """GBNF (root rule "root") for a response format, within the bounds; None for plain text.

    Raises InvalidInput for a format it cannot express, GrammarTooComplex past a bound.
    """
    from llama_cpp import llama_grammar

    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return str(llama_grammar.JSON_GBNF)
    if kind != "json_schema":
        raise InvalidInput(f"response_format type {kind!r} is not supported: use text, json_object or json_schema", param=PARAM)
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if not isinstance(schema, Mapping):
        raise InvalidInput("response_format json_schema needs a `schema` object", param=PARAM)
    if _remote_ref(schema):
        # NOTE: the converter refuses remote $refs with an assert only, which `python -O` drops
        raise InvalidInput("response_format json_schema may only use local $refs (#/...)", param=PARAM)
    check_schema(schema, limits)
    try:
        # NOTE: the converter reports what it cannot handle (remote or broken $ref, unknown
        # types, bad patterns) with assert, ValueError, KeyError and friends.
        grammar = str(llama_grammar.json_schema_to_gbnf(json.dumps(schema)))
    except (AssertionError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        raise InvalidInput(f"response_format json_schema cannot be turned into a grammar: {exc}", param=PARAM) from exc
    check_grammar_text(grammar, limits)
    return grammar


def _remote_ref(node: Any) -> bool:
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            ref = item.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


Parse = Callable[[str], None]  # llama.cpp's parse of a grammar: raises InvalidInput when it refuses it


class GrammarCompiler:
    """Compiles response formats to grammars on one thread of its own, bounded, cached by schema.

    NOTE: the cache is an LRU guarded by `_lock` (filled from the compiler thread, read on the
    event loop); a schema being compiled is shared by every request that asks for it meanwhile.
    """

    def __init__(self, limits: GrammarSettings, parse: Parse | None = None) -> None:
        self.limits = limits
        self._parse = parse
        self._cache: OrderedDict[bytes, str | InvalidInput | None] = OrderedDict()
        self._verified: set[str] = set()  # grammar texts that passed every check (for the engine's submit)
        self._lock = threading.Lock()
        self._pending: dict[bytes, asyncio.Future[str | InvalidInput | None]] = {}
        self._waiters: dict[bytes, int] = {}  # requests awaiting each pending compile (event loop only)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge-grammar")
        self.compiled_total = 0
        self.refused_total = 0
        self.timeouts_total = 0

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def compile(self, response_format: Mapping[str, Any] | None) -> str | None:
        """The grammar of `response_format` (None: unconstrained text); raises InvalidInput / GrammarTooComplex."""
        if not response_format or response_format.get("type") in (None, "text"):
            return None
        try:
            raw = orjson.dumps(response_format, option=orjson.OPT_SORT_KEYS)
        except (TypeError, orjson.JSONEncodeError):
            raise InvalidInput("response_format must be JSON", param=PARAM) from None
        if len(raw) > self.limits.max_schema_bytes:
            raise GrammarTooComplex(
                f"response_format is {len(raw)} bytes; the edge takes at most {self.limits.max_schema_bytes}", param=PARAM
            )
        key = hashlib.sha256(raw).digest()
        with self._lock:
            found = self._cache.get(key, _MISSING)
            if found is not _MISSING:
                self._cache.move_to_end(key)
        if found is _MISSING:
            found = await self._compile_shared(key, response_format)
        if isinstance(found, InvalidInput):
            raise found
        return found if isinstance(found, str) else None

    async def verify(self, grammar: str) -> None:
        """Checks a grammar given as text (not compiled here) the same way; cached by its text."""
        with self._lock:
            if grammar in self._verified:
                return
        loop = asyncio.get_running_loop()
        result = await self._bounded(loop.run_in_executor(self._executor, self._check_text, grammar))
        if isinstance(result, InvalidInput):
            raise result

    def known(self, grammar: str) -> bool:
        with self._lock:
            return grammar in self._verified

    async def _compile_shared(self, key: bytes, response_format: Mapping[str, Any]) -> str | InvalidInput | None:
        pending = self._pending.get(key)
        if pending is None:
            loop = asyncio.get_running_loop()
            pending = asyncio.ensure_future(loop.run_in_executor(self._executor, self._compile_now, key, dict(response_format)))
            self._pending[key] = pending
            self._waiters[key] = 0
            pending.add_done_callback(lambda _: (self._pending.pop(key, None), self._waiters.pop(key, None)))
        # NOTE: shielded, so a client that leaves does not cancel the compile other requests await;
        # when the last one waiting leaves, a compile that has not started yet is cancelled (one that
        # runs is bounded and its result cached for the next ask).
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            return await self._bounded(asyncio.shield(pending))
        finally:
            left = self._waiters.get(key, 1) - 1
            self._waiters[key] = left
            if left <= 0 and not pending.done():
                pending.cancel()

    async def _bounded(self, work: Any) -> str | InvalidInput | None:
        try:
            async with asyncio.timeout(self.limits.compile_timeout_s):
                result: str | InvalidInput | None = await work
                return result
        except TimeoutError:
            self.timeouts_total += 1
            return GrammarTooComplex(
                f"the grammar for this response_format took longer than {self.limits.compile_timeout_s:g} s to build",
                param=PARAM,
            )

    def _compile_now(self, key: bytes, response_format: dict[str, Any]) -> str | InvalidInput | None:
        """On the compiler thread: convert, check, parse; the result is cached either way."""
        try:
            grammar = convert(response_format, self.limits)
            if grammar is not None and self._parse is not None:
                self._parse(grammar)
            result: str | InvalidInput | None = grammar
        except InvalidInput as exc:
            result = exc
        except (MemoryError, RecursionError) as exc:
            result = GrammarTooComplex(f"the grammar for this response_format is too large to build ({type(exc).__name__})", param=PARAM)
        self._store(key, result)
        return result

    def _check_text(self, grammar: str) -> str | InvalidInput | None:
        try:
            check_grammar_text(grammar, self.limits)
            if self._parse is not None:
                self._parse(grammar)
        except InvalidInput as exc:
            return exc
        with self._lock:
            self._verified.add(grammar)
        return grammar

    def _store(self, key: bytes, result: str | InvalidInput | None) -> None:
        with self._lock:
            if isinstance(result, InvalidInput):
                self.refused_total += 1
            else:
                self.compiled_total += 1
                if result is not None:
                    self._verified.add(result)
            if self.limits.cache_entries <= 0:
                return
            self._cache[key] = result
            self._cache.move_to_end(key)
            while len(self._cache) > self.limits.cache_entries:
                _, old = self._cache.popitem(last=False)
                if isinstance(old, str):
                    self._verified.discard(old)


_MISSING: Any = object()
