"""Prompt-step sizing from the start-up cost model (no model: the model's two numbers are set)."""

from __future__ import annotations

import pytest

from edge_engine import EdgeSettings
from edge_engine.scheduler import Scheduler
from edge_engine.stats import EngineStats

# What the probe measured with flash attention over q8_0 on 2 CPU threads.
MS_TOKEN, MS_CELL = 3.7, 0.0042


def scheduler(**settings) -> Scheduler:
    s = Scheduler(EdgeSettings(**settings), EngineStats(), model=None)  # type: ignore[arg-type]  # the cost model needs none
    s._ms_token, s._ms_cell = MS_TOKEN, MS_CELL
    s.chunk = s._piece(0)
    return s


@pytest.mark.parametrize("start", [0, 500, 1500, 4000])
def test_a_piece_is_the_most_tokens_that_fit_the_step_where_it_starts(start: int) -> None:
    s = scheduler(prefill_step_ms=150.0)
    n = s._piece(start)
    assert s._piece_cost(start, n) <= 150.0 < s._piece_cost(start, n + 1)


def test_pieces_shrink_with_depth_and_stay_within_the_cap() -> None:
    s = scheduler(prefill_step_ms=150.0)
    sizes = [s._piece(p) for p in (0, 500, 1500, 4000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1] >= 1
    assert scheduler(prefill_step_ms=10_000.0, prefill_chunk=64)._piece(0) == 64


def test_without_a_step_time_every_piece_is_the_chunk_cap() -> None:
    s = scheduler(prefill_step_ms=None, prefill_chunk=96)
    assert {s._piece(p) for p in (0, 1000, 3000)} == {96}
    assert s._piece_cost(1000, 10) == 10.0  # the budget is counted in tokens then


def test_the_tail_of_a_long_prompt_costs_more_than_a_fresh_short_one() -> None:
    # what orders the queue: 18 tokens left 1,497 cells deep vs a new 20-token prompt
    s = scheduler(prefill_step_ms=150.0)
    assert s._piece_cost(1497, 18) > s._piece_cost(26, 20)
