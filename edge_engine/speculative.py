"""Prompt-lookup drafts for speculative decoding, and how long a draft should be.

A greedy sequence's last n-gram is looked up in its own prompt and output; the tokens that
followed it there are decoded as a draft in the same step as the sequence's next token, and
the scheduler keeps the longest prefix the model agrees with (see scheduler.py).

A draft row is not free: on CPU, ggml computes a matrix product row by row, so each extra row
costs a large share of a one-token step (SmolLM2-135M Q4_1, 2 threads: 1 row 9.7 ms, 2 rows
15.3 ms, 4 rows 24.2 ms, 8 rows 41.6 ms). The cost is timed once at start (`DraftCost`), and
each sequence drafts only as many tokens as pay for themselves at its own acceptance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from edge_engine.llama_model import BatchEntry, LlamaContext, LlamaModel

log = logging.getLogger(__name__)

PROBE_PROMPT = 64  # scratch prompt before the timed rows, so attention reads a realistic depth
PROBE_ROWS = 8  # the longer timed step: 1 token + PROBE_ROWS - 1 draft rows
MIN_GAIN = 1.03  # a draft must promise this many tokens per step-time of plain decoding
MAX_MATCH = 32  # how far back a match is followed
SHORT_MATCH_P, LONG_MATCH_P = 0.68, 0.92  # draft tokens kept after matches of <= 4 and >= 12 tokens
LONG_MATCH = 8  # matches this long are a verbatim copy in progress: a sequence's record is kept apart


def match_kind(match: int) -> int:
    """0: a short match (common phrasing), 1: a long one (copying); each has its own acceptance."""
    return int(match >= LONG_MATCH)


def lookup_draft(history: list[int], last: int, ngram_sizes: list[int], limit: int) -> tuple[list[int], int]:
    """Tokens that followed the latest earlier occurrence of the n-gram ending in `last`, and the match length.

    `history`: the sequence's tokens before `last` (prompt and output). Each n in `ngram_sizes`
    is tried in turn; the first that occurs earlier gives at most `limit` tokens. The match
    length (at most MAX_MATCH) counts how far back the text before that occurrence equals the
    sequence's own tail: a long match is a verbatim copy in progress.
    """
    size = len(history) + 1
    if limit <= 0:
        return [], 0
    for n in ngram_sizes:
        if n >= size:
            continue
        head = history[size - n :]  # the n-gram without `last`
        for i in range(size - n - 1, -1, -1):  # start of an earlier occurrence, latest first
            end = i + n - 1  # where `last` occurs there
            if history[end] == last and history[i:end] == head:
                m = n
                while m < MAX_MATCH and end - m >= 0 and history[end - m] == history[size - 1 - m]:
                    m += 1
                return history[end + 1 : end + 1 + limit], m
    return [], 0


def match_prior(match: int) -> float:
    """How often a draft token is kept after a match of this length (before the first miss).

    Measured on SmolLM2-135M over bench/edge_speculative.py's grounded prompts: matches of 2-3
    tokens kept ~0.68 of their draft tokens, matches of 12 or more ~0.92 (everyday answers'
    2-token matches ~0.37); linear in between.
    """
    return SHORT_MATCH_P + (LONG_MATCH_P - SHORT_MATCH_P) * min(1.0, max(0.0, (match - 4) / 8))


@dataclass(frozen=True, slots=True)
class DraftCost:
    """What draft rows add to a one-token decode step, as fractions of that step."""

    first: float = 0.58  # the first draft row (the step turns from one row into a matrix)
    row: float = 0.45  # each further draft row

    def gain(self, p: float, n: int) -> float:
        """Expected tokens per plain-step time of a draft of `n`, each kept with probability `p` after the last."""
        expected = sum(p**i for i in range(n + 1))
        return expected / (1.0 + (self.first + self.row * (n - 1) if n else 0.0))

    def length(self, p: float, max_draft: int) -> int:
        """The draft length that pays best at acceptance `p`; 0 when none pays MIN_GAIN."""
        best, best_gain = 0, MIN_GAIN
        for n in range(1, max_draft + 1):
            g = self.gain(p, n)
            if g > best_gain:
                best, best_gain = n, g
        return best

    @classmethod
    def calibrate(
        cls, ctx: LlamaContext, model: LlamaModel, scratch_seq_id: int, clock: Callable[[], float] = time.perf_counter
    ) -> DraftCost:
        """Times a one-token step, a two-row and a PROBE_ROWS-row step (all with logits), once, at start.

        `scratch_seq_id` must be free; it is empty again on return. Must run on the scheduler thread.
        """
        tokens = (model.tokenize("The quick brown fox jumps over the lazy dog. " * 8, add_special=False) * 8)[
            : PROBE_PROMPT + PROBE_ROWS
        ]
        prompt, rows = tokens[:PROBE_PROMPT], tokens[PROBE_PROMPT:]

        def timed(n: int) -> float:
            begin = clock()
            rc = ctx.decode([BatchEntry(t, len(prompt) + i, scratch_seq_id, True) for i, t in enumerate(rows[:n])])
            elapsed = clock() - begin
            ctx.seq_rm(scratch_seq_id, len(prompt), -1)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            return elapsed

        try:
            if ctx.decode([BatchEntry(t, i, scratch_seq_id, False) for i, t in enumerate(prompt)]) != 0:
                return cls()
            for n in (1, 2, PROBE_ROWS):
                timed(n)  # the first pass of each shape allocates its graph
            t = {n: min(timed(n) for _ in range(3)) for n in (1, 2, PROBE_ROWS)}
        except RuntimeError:
            return cls()
        finally:
            ctx.seq_rm(scratch_seq_id)
        one = max(t[1], 1e-6)
        fitted = cls(
            first=max(0.0, (t[2] - t[1]) / one), row=max(0.0, (t[PROBE_ROWS] - t[2]) / (PROBE_ROWS - 2) / one)
        )
        log.info(
            "edge drafts: a one-token step takes %.2f ms; the first draft row adds %.2f of it, each further one %.2f",
            one * 1000.0, fitted.first, fitted.row,
        )
        return fitted
