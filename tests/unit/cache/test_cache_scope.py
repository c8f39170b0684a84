"""An answer is never served across tenants, system prompts, models, routes, history or parameters."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import Flow, chat

from gateway.errors import InvalidRequest as WireError
from policies.cache.service import SemanticCache

pytestmark = pytest.mark.slow

Q = "What is the capital of Australia?"


async def test_other_tenant_never_hits_even_on_the_exact_text(flow: Flow) -> None:
    await flow.answer(chat(Q), "Canberra.", tenant="acme")
    ctx, answer = await flow.ask(chat(Q), tenant="globex")
    assert answer is None and ctx.cache_status == "miss"
    _, answer = await flow.ask(chat(Q), tenant="acme")
    assert answer is not None


@pytest.mark.parametrize(
    "stored, asked",
    [
        (chat(Q, system="You are terse."), chat(Q, system="You are a pirate.")),
        (chat(Q), chat(Q, system="You are terse.")),
        (chat(Q, model="auto"), chat(Q, model="gpt-4o")),
        (chat(Q, seed=1), chat(Q, seed=2)),
        (chat(Q), chat(Q, response_format={"type": "json_object"})),
        (chat(Q), chat(Q, n=2)),
        (chat(Q), chat(Q, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])),
        (chat(Q, history=[{"role": "user", "content": "Talk about Austria."},
                          {"role": "assistant", "content": "Sure."}]), chat(Q)),
        # sampling extensions and fields the gateway does not know are keyed, not ignored
        (chat(Q), chat(Q, guided_json={"type": "object", "properties": {"city": {"type": "string"}}})),
        (chat(Q), chat(Q, guided_regex="[A-Z]+")),
        (chat(Q), chat(Q, top_k=1)),
        (chat(Q), chat(Q, min_p=0.3)),
        (chat(Q, temperature=0), chat(Q, temperature=0.6)),
        (chat(Q), chat(Q, stop=["."])),
        (chat(Q), chat(Q, some_future_param=True)),
    ],
)
async def test_scope_separates(flow: Flow, stored: dict[str, Any], asked: dict[str, Any]) -> None:
    await flow.answer(stored, "Canberra.")
    ctx, answer = await flow.ask(asked)
    assert answer is None and ctx.cache_status == "miss"
    _, again = await flow.ask(stored)
    assert again is not None


async def test_route_header_is_part_of_the_scope(flow: Flow) -> None:
    await flow.answer(chat(Q), "Canberra.", headers={"x-tierlane-route": "edge"})
    _, answer = await flow.ask(chat(Q), headers={"x-tierlane-route": "upstream"})
    assert answer is None
    _, answer = await flow.ask(chat(Q), headers={"x-tierlane-route": "edge"})
    assert answer is not None


async def test_high_temperature_bypasses(flow: Flow) -> None:
    ctx, answer = await flow.ask(chat(Q, temperature=1.2))
    assert answer is None and ctx.cache_status == "bypass" and ctx.cache_key is None


async def test_shared_scope_is_an_explicit_opt_in(open_cache, embedder) -> None:
    cache: SemanticCache = await open_cache(share_across_tenants=True)
    shared = Flow(cache, embedder)
    await shared.answer(chat(Q), "Canberra.", tenant="acme")
    _, answer = await shared.ask(chat(Q), tenant="globex")
    assert answer is not None


async def test_bad_input_is_an_openai_error(flow: Flow) -> None:
    # the wire model refuses these before any stage reads them
    with pytest.raises(WireError) as err:
        await flow.ask(chat(Q, temperature="hot"))
    assert err.value.param == "temperature" and err.value.status == 400
    with pytest.raises(WireError) as err:
        await flow.ask(chat(Q, max_tokens=0))
    assert err.value.param == "max_tokens"


def test_only_neutral_fields_share_a_key() -> None:
    """The key ignores transport and bookkeeping fields, and keys everything else (fast: no embedder)."""
    from policies.cache.scope import ScopeRules, build_key

    rules = ScopeRules(
        max_temperature=0.7,
        neutral_params=frozenset({"model", "stream", "stream_options", "user", "max_tokens"}),
        share_across_tenants=False,
    )

    def key(**extra: Any) -> str:
        body = {"model": "m", "messages": [{"role": "user", "content": Q}], **extra}
        built, why = build_key(body, tenant="acme", model="m", route=None, rules=rules)
        assert built is not None, why
        return built.exact

    base = key()
    assert key(stream=True, stream_options={"include_usage": True}, user="u1", max_tokens=50) == base
    for extra in ({"guided_json": {"type": "object"}}, {"top_k": 5}, {"x_vendor_mode": "strict"}, {"temperature": 0.2}):
        assert key(**extra) != base, extra


def test_the_name_of_the_last_turn_is_part_of_the_key() -> None:
    from policies.cache.scope import ScopeRules, build_key

    rules = ScopeRules(max_temperature=0.7, neutral_params=frozenset({"model"}), share_across_tenants=False)

    def key(name: str | None) -> str:
        turn: dict[str, Any] = {"role": "user", "content": Q}
        if name is not None:
            turn["name"] = name
        built, _ = build_key({"model": "m", "messages": [turn]}, tenant="acme", model="m", route=None, rules=rules)
        assert built is not None
        return built.exact

    assert key("alice") != key("bob") != key(None)
    assert key("alice") == key("alice")
