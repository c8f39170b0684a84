"""How many prompt tokens one step carries: a cost model timed once on the live context at start.

A prompt token at position p costs about `ms_token + ms_cell * p` (attention reads every
earlier cell). Each piece of a prompt is sized from where it starts to take about `step_ms`,
at most `max_tokens` tokens; sizes depend only on positions, never on load or on what shares
the step, so greedy text does not depend on other traffic.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from edge_engine.llama_model import BatchEntry, LlamaContext, LlamaModel

log = logging.getLogger(__name__)

PROBE_TOKENS = 32  # scratch prompt timed at start to size prompt steps
PROBE_DEPTH = 512  # ... once at position 0 and once after this many cells (a shallower probe misread the slope by 2x)
FALLBACK_TOKENS = 16  # prompt tokens per step when the probe itself could not be decoded


@dataclass(frozen=True, slots=True)
class StepCost:
    """The prompt step cost model; without a step time (or a fit) every piece is `max_tokens` long.

    `step_ms` None or `ms_token` 0: not modelled, and a step's budget is counted in tokens.
    """

    max_tokens: int  # most prompt tokens in one piece (prefill_chunk)
    step_ms: float | None = None  # modelled work one prompt step may carry (prefill_step_ms)
    ms_token: float = 0.0  # cost of a prompt token at position 0
    ms_cell: float = 0.0  # added cost of a prompt token per earlier cell it attends to

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("StepCost.max_tokens must be >= 1")
        if self.ms_token < 0.0 or self.ms_cell < 0.0:
            raise ValueError("StepCost costs must be >= 0")

    @property
    def modelled(self) -> bool:
        """Whether pieces are sized by time (else every piece is `max_tokens`)."""
        return self.step_ms is not None and self.ms_token > 0.0

    @property
    def chunk(self) -> int:
        """Prompt tokens of a step at position 0 (`prompt_tokens_per_step` in the stats)."""
        return self.piece(0)

    def budget(self) -> float:
        """What one prompt step may carry: milliseconds of modelled work, else tokens."""
        return float(self.step_ms) if self.modelled else float(self.max_tokens)  # type: ignore[arg-type]

    def piece(self, start: int) -> int:
        """Prompt tokens of one step starting at position `start`: about step_ms of work."""
        if not self.modelled:
            return self.max_tokens
        # n tokens from `start` cost n * (a + b * (start + n / 2)); the largest n within the step
        a, b, budget = self.ms_token + self.ms_cell * start, self.ms_cell, self.step_ms
        assert budget is not None
        n = budget / a if b == 0.0 else (math.sqrt(a * a + 2.0 * b * budget) - a) / b
        return max(1, min(self.max_tokens, int(n)))

    def cost(self, start: int, n: int) -> float:
        """What `n` prompt tokens from position `start` take out of a step's budget."""
        if not self.modelled:
            return float(n)
        return n * (self.ms_token + self.ms_cell * (start + n / 2))

    @classmethod
    def calibrate(
        cls,
        ctx: LlamaContext,
        model: LlamaModel,
        scratch_seq_id: int,
        *,
        step_ms: float | None,
        max_tokens: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> StepCost:
        """Times a scratch prompt at position 0 and after PROBE_DEPTH cells, once, at start.

        Prompt steps are then sized from that cost model to take about prefill_step_ms at
        any depth of a prompt (at most prefill_chunk tokens). The sizes depend only on where
        a piece starts, never on load or on what shares the step. `scratch_seq_id` must be a
        free sequence id; it is empty again on return. Must run on the scheduler thread.
        """
        if step_ms is None:
            return cls(max_tokens)
        probe = (model.tokenize("The quick brown fox jumps over the lazy dog. " * 8, add_special=False) * 4)[:PROBE_TOKENS]
        depth = max(0, min(PROBE_DEPTH, ctx.n_ctx - 2 * len(probe)))

        def timed(start: int) -> float | None:
            begin = clock()
            rc = ctx.decode([BatchEntry(t, start + i, scratch_seq_id, i == len(probe) - 1) for i, t in enumerate(probe)])
            elapsed = (clock() - begin) * 1000.0 / len(probe)
            ctx.seq_rm(scratch_seq_id, start, -1)
            return None if rc != 0 else elapsed

        try:
            near = [timed(0) for _ in range(3)][1:]  # the first pass pays for graph allocation
            far: list[float | None] = []
            if depth:
                fill = (probe * (depth // len(probe) + 1))[:depth]
                for lo in range(0, depth, ctx.n_batch):
                    part = fill[lo : lo + ctx.n_batch]
                    ctx.decode([BatchEntry(t, lo + i, scratch_seq_id, False) for i, t in enumerate(part)])
                far = [timed(depth) for _ in range(2)]
        finally:
            ctx.seq_rm(scratch_seq_id)
        near_ms = [t for t in near if t is not None]
        far_ms = [t for t in far if t is not None]
        if len(near_ms) < len(near) or len(far_ms) < len(far):
            return cls(min(max_tokens, FALLBACK_TOKENS))
        t0 = min(near_ms)
        ms_cell = max(0.0, (min(far_ms) - t0) / depth) if far_ms else 0.0
        ms_token = max(1e-3, t0 - ms_cell * len(probe) / 2)
        fitted = cls(max_tokens, step_ms, ms_token, ms_cell)
        log.info(
            "edge prompt steps: %d tokens at position 0, %d at %d (%.2f ms per prompt token + %.4f ms per earlier cell)",
            fitted.chunk, fitted.piece(ctx.n_ctx - 1), ctx.n_ctx - 1, fitted.ms_token, fitted.ms_cell,
        )
        return fitted
