"""Prompt-step sizing from the start-up cost model (no model: the model's two numbers are given).

The probe's timing on a real context is covered in test_engine.py; here a fake context with a
fake clock checks what the fit makes of the times it measures.
"""

from __future__ import annotations

from typing import Any

import pytest

from edge_engine import EdgeSettings
from edge_engine.llama_model import BatchEntry
from edge_engine.scheduler import Scheduler
from edge_engine.stats import EngineStats
from edge_engine.step_cost import FALLBACK_TOKENS, PROBE_DEPTH, PROBE_TOKENS, StepCost

# What the probe measured with flash attention over q8_0 on 2 CPU threads.
MS_TOKEN, MS_CELL = 3.7, 0.0042


def model(step_ms: float | None = 150.0, max_tokens: int = 256) -> StepCost:
    return StepCost(max_tokens, step_ms=step_ms, ms_token=MS_TOKEN, ms_cell=MS_CELL)


@pytest.mark.parametrize("start", [0, 500, 1500, 4000])
def test_a_piece_is_the_most_tokens_that_fit_the_step_where_it_starts(start: int) -> None:
    cost = model(150.0)
    n = cost.piece(start)
    assert cost.cost(start, n) <= 150.0 < cost.cost(start, n + 1)


def test_pieces_shrink_with_depth_and_stay_within_the_cap() -> None:
    cost = model(150.0)
    sizes = [cost.piece(p) for p in (0, 500, 1500, 4000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1] >= 1
    assert cost.chunk == sizes[0]
    assert model(10_000.0, max_tokens=64).piece(0) == 64
    assert model(0.001).piece(4000) == 1  # a piece always makes progress


def test_a_modelled_step_is_budgeted_in_milliseconds() -> None:
    assert model(150.0).modelled and model(150.0).budget() == 150.0


def test_without_a_step_time_every_piece_is_the_chunk_cap() -> None:
    cost = model(None, max_tokens=96)
    assert not cost.modelled
    assert {cost.piece(p) for p in (0, 1000, 3000)} == {96} and cost.chunk == 96
    assert cost.cost(1000, 10) == 10.0  # the budget is counted in tokens then
    assert cost.budget() == 96.0


def test_without_a_fit_every_piece_is_the_chunk_cap() -> None:
    cost = StepCost(96, step_ms=150.0)  # nothing measured yet: the state before calibration
    assert not cost.modelled and cost.piece(2000) == 96 and cost.budget() == 96.0


def test_the_tail_of_a_long_prompt_costs_more_than_a_fresh_short_one() -> None:
    # what orders the queue: 18 tokens left 1,497 cells deep vs a new 20-token prompt
    cost = model(150.0)
    assert cost.cost(1497, 18) > cost.cost(26, 20)


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError):
        StepCost(0)
    with pytest.raises(ValueError):
        StepCost(16, step_ms=150.0, ms_token=1.0, ms_cell=-0.1)


# ---- calibration, against a fake context whose decode advances a fake clock ----------


class FakeModel:
    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return list(range(10, 30))


class FakeContext:
    """Each decoded token at position p takes `ms_token + ms_cell * p` of fake time; rc as told."""

    def __init__(self, ms_token: float, ms_cell: float, n_ctx: int = 4096, rc: int = 0) -> None:
        self.ms_token, self.ms_cell, self.n_ctx, self.rc = ms_token, ms_cell, n_ctx, rc
        self.n_batch = 264
        self.now = 0.0
        self.decoded: list[list[BatchEntry]] = []
        self.removed: list[tuple[int, int, int]] = []

    def clock(self) -> float:
        return self.now

    def decode(self, entries: list[BatchEntry]) -> int:
        self.decoded.append(entries)
        self.now += sum(self.ms_token + self.ms_cell * e.pos for e in entries) / 1000.0
        return self.rc

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        self.removed.append((seq_id, p0, p1))


def calibrate(ctx: FakeContext, step_ms: float | None = 150.0, max_tokens: int = 256) -> StepCost:
    fake: Any = ctx  # the calibration calls only decode, seq_rm, n_ctx and n_batch
    return StepCost.calibrate(fake, FakeModel(), 3, step_ms=step_ms, max_tokens=max_tokens, clock=ctx.clock)  # type: ignore[arg-type]


def test_calibration_recovers_the_slope_and_the_cost_at_position_0() -> None:
    ctx = FakeContext(MS_TOKEN, MS_CELL)
    cost = calibrate(ctx)
    assert cost.modelled and cost.step_ms == 150.0 and cost.max_tokens == 256
    assert cost.ms_cell == pytest.approx(MS_CELL)
    # the probe's mean position is half its length in: the fit reads the cost there
    assert cost.ms_token == pytest.approx(MS_TOKEN - MS_CELL / 2)
    assert cost.piece(0) < cost.max_tokens


def test_calibration_uses_only_the_scratch_sequence_and_leaves_it_empty() -> None:
    ctx = FakeContext(MS_TOKEN, MS_CELL)
    calibrate(ctx)
    assert {e.seq_id for step in ctx.decoded for e in step} == {3}
    timed = [step for step in ctx.decoded if len(step) == PROBE_TOKENS]
    assert [step[0].pos for step in timed] == [0, 0, 0, PROBE_DEPTH, PROBE_DEPTH]
    assert all(len(step) <= ctx.n_batch for step in ctx.decoded)
    assert ctx.removed[-1] == (3, -1, -1)


def test_calibration_probes_shallower_in_a_short_context() -> None:
    ctx = FakeContext(MS_TOKEN, MS_CELL, n_ctx=256)
    cost = calibrate(ctx)
    assert {step[0].pos for step in ctx.decoded if len(step) == PROBE_TOKENS} == {0, 256 - 2 * PROBE_TOKENS}
    assert cost.ms_cell == pytest.approx(MS_CELL)


def test_a_probe_that_cannot_be_decoded_falls_back_to_small_fixed_steps() -> None:
    ctx = FakeContext(MS_TOKEN, MS_CELL, rc=1)
    cost = calibrate(ctx)
    assert not cost.modelled and cost.piece(0) == FALLBACK_TOKENS and cost.budget() == FALLBACK_TOKENS
    assert calibrate(FakeContext(MS_TOKEN, MS_CELL, rc=1), max_tokens=8).piece(0) == 8
    assert ctx.removed[-1] == (3, -1, -1)


def test_without_a_step_time_nothing_is_probed() -> None:
    ctx = FakeContext(MS_TOKEN, MS_CELL)
    cost = calibrate(ctx, step_ms=None, max_tokens=96)
    assert cost == StepCost(96) and ctx.decoded == [] and ctx.removed == []


def test_a_scheduler_reports_the_chunk_cap_before_it_starts() -> None:
    s = Scheduler(EdgeSettings(prefill_chunk=96, slots=2), EngineStats(), model=None)  # type: ignore[arg-type]
    load = s.load()
    assert load["prompt_tokens_per_step"] == load["prompt_tokens_per_step_at_n_ctx"] == 96
    assert load["prefix_entries"] == load["kv_cells_reserved"] == load["kv_cells_used"] == 0
