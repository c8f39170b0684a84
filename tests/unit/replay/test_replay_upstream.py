"""The replay upstream answers each labelled question as the recorded model did, and the grader agrees."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from bench.replay_upstream import ALPACA_COMPLETION_TOKENS, HITS, grade, mmlu_answer, mmlu_key, replay_app, tables

MMLU = SimpleNamespace(prompts=["Q1? A. x B. y C. z D. w", "Q2? A. 1 B. 2 C. 3 D. 4"],
                       weak=np.array([1, 0]), strong=np.array([1, 1]))
ALPACA = SimpleNamespace(prompts=["Write a poem."], weak=np.array([0.12]), strong=np.array([0.5]))


def test_right_answers_grade_one_and_wrong_ones_zero() -> None:
    for prompt in MMLU.prompts:
        assert mmlu_key(prompt) in "ABCD"
        assert grade("mmlu", prompt, mmlu_answer(prompt, True)) == 1.0
        assert grade("mmlu", prompt, mmlu_answer(prompt, False)) == 0.0
    assert grade("alpaca", "x", "quality=0.1200") == 0.12


async def test_the_two_tables_answer_as_the_recorded_models(aiohttp_client: Any) -> None:
    weak, strong = tables(MMLU, ALPACA)
    cost = await aiohttp_client(replay_app(weak, "cost-model"))
    dear = await aiohttp_client(replay_app(strong, "strong-model"))

    async def ask(client: Any, prompt: str, stream: bool = False) -> tuple[str, dict[str, Any]]:
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": stream,
                "stream_options": {"include_usage": True}}
        resp = await client.post("/v1/chat/completions", json=body)
        if not stream:
            payload = await resp.json()
            return payload["choices"][0]["message"]["content"], payload["usage"]
        text = await resp.text()
        assert text.rstrip().endswith("data: [DONE]") and '"usage"' in text
        return text, {}

    q2 = MMLU.prompts[1]
    assert grade("mmlu", q2, (await ask(cost, q2))[0]) == 0.0  # the weak model got it wrong
    assert grade("mmlu", q2, (await ask(dear, q2))[0]) == 1.0
    text, usage = await ask(cost, "Write a poem.")
    assert grade("alpaca", "Write a poem.", text) == 0.12 and usage["completion_tokens"] == ALPACA_COMPLETION_TOKENS
    streamed, _ = await ask(dear, "Write a poem.", stream=True)
    assert "quality=0.5000" in streamed
    assert (await ask(cost, "never recorded"))[0] == "unknown"
    assert cost.app[HITS] == 3
