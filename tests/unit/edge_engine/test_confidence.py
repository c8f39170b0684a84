"""Token confidence from the step's own logits, and degeneration stops, on the real model."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from edge_engine import GenerationEvent, SamplingParams, TokenInfo
from edge_engine.confidence import token_info
from edge_engine.errors import InvalidInput

LOOPING = ["What is the capital of France?", "Tell a long story."]  # greedy SmolLM2 repeats to max_tokens
GROUNDED = (
    "Copy the following text exactly:\n\nThe city council approved the new cycling plan on Tuesday. The plan adds "
    "42 kilometres of protected bike lanes over the next three years, starting with the river road."
)


async def events(engine, prompt: str, **params) -> list[GenerationEvent]:
    out = []
    params = {"temperature": 0.0, "max_tokens": 32, **params}
    async for event in engine.generate(messages=[{"role": "user", "content": prompt}], params=SamplingParams(**params)):
        out.append(event)
    return out


def _infos(evs: list[GenerationEvent]) -> list[TokenInfo]:
    return [info for e in evs for info in e.tokens]


def _text(evs: list[GenerationEvent]) -> str:
    return "".join(e.text for e in evs)


# ---- pure ---------------------------------------------------------------------------


def test_token_info_is_the_log_softmax_of_the_raw_row() -> None:
    rng = np.random.default_rng(7)
    row = (rng.standard_normal(5000) * 4).astype(np.float32)
    info = token_info(row, 42, lambda t: str(t).encode(), top_k=3)
    x = row.astype(np.float64)
    logp = x - (x.max() + math.log(np.exp(x - x.max()).sum()))
    assert info.logprob == pytest.approx(logp[42], abs=1e-4)
    assert info.entropy == pytest.approx(-(np.exp(logp) * logp).sum(), abs=1e-3)
    best = np.argsort(-x)[:3]
    assert [p for p, _ in info.top] == [str(t).encode() for t in best]
    assert [lp for _, lp in info.top] == pytest.approx(logp[best], abs=1e-4)
    assert token_info(row, 42, lambda t: b"").top == ()  # top only when asked
    # the shortcut (tokens near the peak) and the full partition give the same top tokens
    for spread in (0.01, 4.0, 40.0):  # flat: thousands near the peak; peaked: fewer than k
        other = (rng.standard_normal(5000) * spread).astype(np.float32)
        got = [p for p, _ in token_info(other, 0, lambda t: str(t).encode(), top_k=7).top]
        assert got == [str(t).encode() for t in np.argsort(-other.astype(np.float64), kind="stable")[:7]]
    one_hot = np.full(100, -1e4, dtype=np.float32)
    one_hot[3] = 10.0
    sure = token_info(one_hot, 3, lambda t: b"x")
    assert sure.logprob == pytest.approx(0.0, abs=1e-6) and sure.entropy == pytest.approx(0.0, abs=1e-6)


# ---- the engine ---------------------------------------------------------------------


@pytest.mark.slow
def test_every_sampled_token_comes_once_with_its_text(runner) -> None:
    evs = runner.run(events(runner.engine, "Describe a cat.", max_tokens=40, top_logprobs=5))
    infos = _infos(evs)
    assert evs[-1].finish_reason == "length"
    assert len(infos) == evs[-1].completion_tokens == 40
    assert b"".join(i.piece for i in infos).decode() == _text(evs)
    for info in infos:
        assert info.logprob <= 0.0 and info.entropy >= 0.0
        assert len(info.top) == 5 and [lp for _, lp in info.top] == sorted((lp for _, lp in info.top), reverse=True)
        # greedy without penalties picks the most likely token of the raw distribution
        assert info.top[0] == (info.piece, pytest.approx(info.logprob))
        assert sum(math.exp(lp) for _, lp in info.top) <= 1.0 + 1e-6


@pytest.mark.slow
def test_top_logprobs_are_only_computed_when_asked(runner) -> None:
    infos = _infos(runner.run(events(runner.engine, "Say hello.", max_tokens=8)))
    assert infos and all(i.top == () for i in infos)
    with pytest.raises(InvalidInput) as err:
        runner.run(events(runner.engine, "Say hello.", top_logprobs=21))
    assert err.value.param == "top_logprobs"


@pytest.mark.slow
def test_end_of_generation_and_stop_string_tokens_are_left_out(runner) -> None:
    evs = runner.run(events(runner.engine, "Say hello.", max_tokens=64))
    assert evs[-1].finish_reason == "stop"
    assert len(_infos(evs)) == evs[-1].completion_tokens - 1  # the end-of-generation token
    full, pieces = _text(evs), [i.piece for i in _infos(evs)]
    k = len(pieces) // 2
    stop = (pieces[k] + pieces[k + 1]).decode()  # starts where token k starts
    assert full.index(stop) == len(b"".join(pieces[:k]).decode())
    cut = runner.run(events(runner.engine, "Say hello.", max_tokens=64, stop=[stop]))
    assert cut[-1].finish_reason == "stop" and _text(cut) == full[: full.index(stop)]
    assert cut[-1].completion_tokens == k + 2 and [i.piece for i in _infos(cut)] == pieces[:k]
    # a stop string that starts inside a token: that token's text before it is released, so is its record
    inner = (pieces[k][1:] + pieces[k + 1]).decode()
    assert full.index(inner) == full.index(stop) + 1
    cut = runner.run(events(runner.engine, "Say hello.", max_tokens=64, stop=[inner]))
    assert _text(cut) == full[: full.index(inner)] and [i.piece for i in _infos(cut)] == pieces[: k + 1]


@pytest.mark.slow
def test_confidence_of_draft_rows_equals_one_token_steps(spec_runner) -> None:
    scheduler = spec_runner.engine._scheduler
    scheduler.speculate = False  # read when a request is admitted
    try:
        plain = spec_runner.run(events(spec_runner.engine, GROUNDED, max_tokens=40, top_logprobs=2))
    finally:
        scheduler.speculate = True
    before = spec_runner.engine.stats()["spec_accepted_tokens_total"]
    drafted = spec_runner.run(events(spec_runner.engine, GROUNDED, max_tokens=40, top_logprobs=2))
    assert spec_runner.engine.stats()["spec_accepted_tokens_total"] > before
    assert _text(drafted) == _text(plain)
    # logits are bit-identical alone, batched and in draft rows (batch_invariant)
    assert _infos(drafted) == _infos(plain)


@pytest.mark.slow
def test_batched_sequences_get_their_own_rows(runner) -> None:
    prompts = ["Describe a cat.", "List three fruits.", "Say hello.", "Write a haiku about the sea."]
    solo = [runner.run(events(runner.engine, p, top_logprobs=1)) for p in prompts]

    async def together():
        return await asyncio.gather(*(events(runner.engine, p, top_logprobs=1) for p in prompts))

    batched = runner.run(together())
    assert [_infos(b) for b in batched] == [_infos(s) for s in solo]


@pytest.mark.slow
def test_looping_answers_stop_early_with_loop(runner) -> None:
    before = runner.engine.stats()["loop_stops_total"]

    async def both():
        return await asyncio.gather(*(events(runner.engine, p, max_tokens=256) for p in LOOPING))

    looped = runner.run(both())
    for evs in looped:
        last = evs[-1]
        assert last.finish_reason == "loop" and last.completion_tokens < 200
        assert len(_infos(evs)) < last.completion_tokens  # the held repeats were dropped
    assert runner.engine.stats()["loop_stops_total"] == before + len(LOOPING)
    french = _text(looped[0])
    assert french.count("la femme au martyre") == 1, french
    off = runner.run(events(runner.engine, LOOPING[0], max_tokens=120, stop_on_loop=False))
    assert off[-1].finish_reason == "length" and _text(off).count("la femme au martyre") > 5


@pytest.mark.slow
def test_a_run_of_low_confidence_tokens_ends_the_answer(runner) -> None:
    before = runner.engine.stats()["low_confidence_stops_total"]
    params = {"temperature": 3.0, "seed": 11, "max_tokens": 200, "low_confidence_run": 3, "low_confidence_logprob": -6.0}
    evs = runner.run(events(runner.engine, "Describe a cat.", **params))
    infos = _infos(evs)
    assert evs[-1].finish_reason == "low_confidence"
    assert len(infos) == evs[-1].completion_tokens
    assert all(i.logprob < -6.0 for i in infos[-3:])
    assert runner.engine.stats()["low_confidence_stops_total"] == before + 1
    calm = runner.run(events(runner.engine, "Describe a cat.", max_tokens=24, low_confidence_run=3))
    assert calm[-1].finish_reason == "length"
