"""Speculative decoding (prompt lookup): exact greedy output, drafts kept, stops and limits, when it is off."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from edge_engine import EdgeSettings, GenerationEvent, SamplingParams
from edge_engine.settings import SpeculativeSettings
from edge_engine.speculative import DraftCost, lookup_draft, match_kind, match_prior
from tests.unit.edge_engine.conftest import EngineRunner

pytestmark = pytest.mark.slow

EVERYDAY = ["What is the capital of France?", "Write a haiku about the sea.", "List three fruits.", "Describe a cat."]

TEXT = (
    "The city council approved the new cycling plan on Tuesday. The plan adds 42 kilometres of protected "
    "bike lanes over the next three years, starting with the river road and the university district."
)
GROUNDED = [
    f"Copy the following text exactly:\n\n{TEXT}",
    f"Rewrite this text, keeping its wording:\n\n{TEXT}",
    "Repeat this notice: the water supply in Block C will be switched off on Friday from 9:00 to 15:00 "
    "for maintenance of the main pipe. Please store enough water for the day.",
    'Fill this JSON from the record and output only the JSON: name: Maria Lopez; team: Platform; office: Lisbon.\n'
    '{"name": "", "team": "", "office": ""}',
]


async def collect(engine, prompt: str, max_tokens: int = 24, **params) -> tuple[str, GenerationEvent]:
    text, last = [], None
    params = {"temperature": 0.0, **params}
    async for event in engine.generate(
        messages=[{"role": "user", "content": prompt}], params=SamplingParams(max_tokens=max_tokens, **params)
    ):
        text.append(event.text)
        last = event
    assert last is not None
    return "".join(text), last


def _settings(**speculative: object) -> EdgeSettings:
    return EdgeSettings(
        n_threads=1, prefix_reuse=False, max_queue=16, n_ctx=1024, slots=8, speculative=SpeculativeSettings(**speculative)  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def off_runner() -> Iterator[EngineRunner]:
    r = EngineRunner(_settings(enabled=False))
    yield r
    r.close()


def _drafted(runner: EngineRunner) -> tuple[int, int]:
    stats = runner.engine.stats()
    return stats["spec_drafted_tokens_total"], stats["spec_accepted_tokens_total"]


# ---- pure parts ---------------------------------------------------------------------


def test_lookup_drafts_what_followed_the_latest_earlier_ngram() -> None:
    history = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 2]
    assert lookup_draft(history, 3, [3, 2], 3) == ([4, 6, 7], 2)  # latest "2 3" is followed by 4 6 7
    assert lookup_draft(history, 3, [3, 2], 1) == ([4], 2)
    assert lookup_draft([5, 6, 7, 8, 5, 6], 7, [3, 2], 4) == ([8, 5, 6], 3)  # the 3-gram first
    assert lookup_draft([1, 2, 3], 9, [3, 2], 4) == ([], 0)
    assert lookup_draft([1, 2, 3], 2, [2], 0) == ([], 0)
    copy = list(range(20))
    draft, match = lookup_draft(copy + copy[:10], 10, [3, 2], 5)  # a copy in progress
    assert draft == [11, 12, 13, 14, 15] and match == 11 and match_kind(match) == 1


def test_draft_length_follows_acceptance_and_row_cost() -> None:
    cpu = DraftCost(first=0.8, row=0.45)
    assert cpu.length(match_prior(2), 10) == 0  # short matches do not pay on CPU
    assert cpu.length(match_prior(16), 10) >= 4  # a copy in progress does
    assert cpu.length(0.99, 3) == 3
    free = DraftCost(first=0.0, row=0.0)
    assert free.length(0.3, 6) == 6
    assert match_prior(2) < match_prior(8) < match_prior(12) == match_prior(30)


def test_speculative_settings_validate_and_nest_in_the_edge_section() -> None:
    assert EdgeSettings(speculative={"max_draft": 4}).speculative.max_draft == 4  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="max_drafts"):
        SpeculativeSettings(max_drafts=4)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="ngram_sizes"):
        SpeculativeSettings(ngram_sizes=[0])


# ---- the engine -----------------------------------------------------------------------


def test_greedy_output_is_the_same_with_and_without_drafts_alone_and_batched(off_runner, spec_runner) -> None:
    prompts = GROUNDED + EVERYDAY
    before = _drafted(spec_runner)
    off = [off_runner.run(collect(off_runner.engine, p, max_tokens=48)) for p in prompts]
    alone = [spec_runner.run(collect(spec_runner.engine, p, max_tokens=48)) for p in prompts]
    assert [t for t, _ in alone] == [t for t, _ in off]
    assert [e.completion_tokens for _, e in alone] == [e.completion_tokens for _, e in off]

    async def together(group):
        return await asyncio.gather(*(collect(spec_runner.engine, p, max_tokens=48) for p in group))

    for start in (0, 4):
        batched = spec_runner.run(together(prompts[start : start + 4]))
        assert [t for t, _ in batched] == [t for t, _ in off[start : start + 4]]
    drafted, accepted = _drafted(spec_runner)
    assert drafted > before[0] and accepted > before[1]
    assert off_runner.engine.stats()["spec_drafted_tokens_total"] == 0


def test_an_input_grounded_prompt_keeps_draft_tokens(spec_runner) -> None:
    before = _drafted(spec_runner)
    spec_runner.run(collect(spec_runner.engine, GROUNDED[0], max_tokens=48))
    drafted, accepted = _drafted(spec_runner)
    assert accepted - before[1] > 0
    stats = spec_runner.engine.stats()
    assert 0.0 < stats["spec_acceptance_rate"] <= 1.0


@pytest.mark.parametrize("max_tokens", [3, 11, 29])
def test_max_tokens_is_honoured_exactly_mid_draft(off_runner, spec_runner, max_tokens) -> None:
    off = off_runner.run(collect(off_runner.engine, GROUNDED[0], max_tokens=max_tokens))
    on = spec_runner.run(collect(spec_runner.engine, GROUNDED[0], max_tokens=max_tokens))
    assert on[0] == off[0] and on[1].completion_tokens == off[1].completion_tokens == max_tokens
    assert on[1].finish_reason == off[1].finish_reason == "length"


def test_stop_strings_are_honoured_exactly_mid_draft(off_runner, spec_runner) -> None:
    full, _ = off_runner.run(collect(off_runner.engine, GROUNDED[0], max_tokens=48))
    for stop in ("kilometres", full[len(full) // 2 : len(full) // 2 + 3]):
        off = off_runner.run(collect(off_runner.engine, GROUNDED[0], max_tokens=48, stop=[stop]))
        on = spec_runner.run(collect(spec_runner.engine, GROUNDED[0], max_tokens=48, stop=[stop]))
        assert on[0] == off[0] == full[: full.index(stop)]
        assert on[1].finish_reason == off[1].finish_reason == "stop"
        assert on[1].completion_tokens == off[1].completion_tokens


def test_no_drafts_for_sampling_or_penalties(spec_runner) -> None:
    before = _drafted(spec_runner)
    spec_runner.run(collect(spec_runner.engine, GROUNDED[0], max_tokens=24, temperature=0.8, seed=3))
    spec_runner.run(collect(spec_runner.engine, GROUNDED[0], max_tokens=24, repeat_penalty=1.3))
    assert _drafted(spec_runner) == before


def test_no_drafts_at_or_above_the_batch_crossover(off_runner, spec_runner) -> None:
    scheduler = spec_runner.engine._scheduler
    settings = spec_runner.engine.settings.speculative
    calls: list[tuple[int, int]] = []  # decoding sequences, sequences given a draft
    plain = scheduler._drafts

    def recorded(decoding):
        drafts = plain(decoding)
        calls.append((len(decoding), len(drafts)))
        return drafts

    async def together(runner, n):
        return await asyncio.gather(*(collect(runner.engine, GROUNDED[i % 2], max_tokens=32) for i in range(n)))

    skipped = spec_runner.engine.stats()["spec_skipped_steps_total"]
    settings.max_batch, scheduler._drafts = 2, recorded
    try:
        texts = [t for t, _ in spec_runner.run(together(spec_runner, 4))]
    finally:
        settings.max_batch = 64
        del scheduler._drafts
    assert any(n >= 2 for n, _ in calls) and all(d == 0 for n, d in calls if n >= 2)
    assert any(d for n, d in calls if n == 1)  # alone, the same sequences drafted
    assert spec_runner.engine.stats()["spec_skipped_steps_total"] > skipped
    assert texts == [t for t, _ in off_runner.run(together(off_runner, 4))]


def test_stats_report_drafts_and_kv_cells_per_sequence(spec_runner) -> None:
    async def scenario():
        gen = await spec_runner.engine.submit(
            messages=[{"role": "user", "content": GROUNDED[1]}], params=SamplingParams(temperature=0, max_tokens=40)
        )
        await gen.__anext__()
        during = spec_runner.engine.stats()
        async for _ in gen:
            pass
        return during, spec_runner.engine.stats()

    during, after = spec_runner.run(scenario())
    for key in ("spec_drafted_tokens_total", "spec_accepted_tokens_total", "spec_acceptance_rate", "spec_drafts_total",
                "spec_skipped_steps_total", "spec_draft_row_cost_first", "spec_draft_row_cost"):
        assert key in after
    assert during["kv_cells_per_sequence_max"] > 0 and during["kv_cells_per_sequence_mean"] > 0
    assert after["kv_cells_per_sequence_max"] == 0 and after["kv_cells_per_sequence_mean"] == 0.0


def test_no_drafts_where_they_would_not_be_exact() -> None:
    from edge_engine.scheduler import Scheduler
    from edge_engine.stats import EngineStats

    def speculates(**kw: object) -> bool:
        return Scheduler(EdgeSettings(n_threads=1, **kw), EngineStats(), model=None).speculate  # type: ignore[arg-type]

    assert speculates()
    assert not speculates(flash_attn=False)  # f16 attention matmuls round differently for a multi-row step
    assert not speculates(batch_invariant=False, kv_cache_type="f16")
    assert not speculates(n_gpu_layers=-1)
    assert not speculates(speculative={"enabled": False})

