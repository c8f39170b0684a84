"""The learning component: what a matched answer becomes, and the counters /metrics reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from policies.learn.config import LearnPolicy
from policies.learn.pairs import FILENAME, PairReader, PairStore
from policies.learn.service import Answered, Learning
from policies.policy import Policy

PREFIX = "Extract the order number from this email:"


def learning(tmp_path: Path, **section: Any) -> Learning:
    rule = {"match": {"tenant": "acme", "app": "shop"}, "set": {"templates": {"order": {"prefix": PREFIX}}}}
    policy = LearnPolicy(Policy.load(extra={"learn": {**section, "overrides": [rule]}}))
    return Learning(policy, PairStore(tmp_path / FILENAME))


def answered(text: str, answer: str = "A-1234", **body: Any) -> tuple[list[dict[str, Any]], Answered]:
    messages = [{"role": "user", "content": f"{PREFIX} {text}"}]
    response = {"model": "up-1", "choices": [{"message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]}
    done = Answered(pair_id=f"id-{text[:8]}", tenant="acme", app="shop", body={"messages": messages, "stream": True, **body},
                    messages=messages, response=response, finish_reasons=["stop"], model="up-1", input_tokens=30,
                    output_tokens=4)  # fmt: skip
    return messages, done


async def test_a_kept_pair_holds_the_request_the_answer_and_the_shaping_params(tmp_path: Path) -> None:
    learn = learning(tmp_path)
    templates = learn.policy.for_app("acme", "shop").templates
    messages, done = answered("Hi, my order A-1234 is late.", temperature=0, response_format={"type": "text"})
    match = templates.match(messages)
    assert match is not None
    assert learn.keep(match, done) is None
    await learn.close()
    with PairReader(tmp_path / FILENAME) as reader:
        (pair,) = reader.pairs("acme", "shop", "order")
    assert (pair.variable, pair.answer, pair.model) == ("Hi, my order A-1234 is late.", "A-1234", "up-1")
    assert pair.params == {"temperature": 0, "response_format": {"type": "text"}}  # stream and messages are not params
    assert pair.template_version == match.template.version


async def test_skips_are_counted_by_reason_and_large_pairs_are_refused(tmp_path: Path) -> None:
    learn = learning(tmp_path, max_pair_bytes=2048)
    templates = learn.policy.for_app("acme", "shop").templates
    messages, done = answered("x" * 4000)
    match = templates.match(messages)
    assert match is not None
    assert learn.keep(match, done) == "too_large"
    messages, done = answered("ok", answer='{"order": 1}', response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"order": {"type": "string"}}}}})  # fmt: skip
    match = templates.match(messages)
    assert match is not None
    assert learn.keep(match, done) == "schema"
    learn.skip(match, "acme", "shop", "lane")
    (stats,) = learn.stats()
    assert (stats.template, stats.collected, stats.skipped, stats.stored) == (
        "order", 0, {"too_large": 1, "schema": 1, "lane": 1}, 0)
    await learn.close()
    assert await _summary(tmp_path) == []


async def _summary(tmp_path: Path) -> list[Any]:
    store = PairStore(tmp_path / FILENAME)
    try:
        return [t.pairs for t in await store.summary()]
    finally:
        await store.close()
