"""Spotting degenerate output while decoding: repetition loops and runs of low-confidence tokens.

A loop is a stretch of output with a short period: the last `span` tokens equal the tokens
`period` places before them, for some period up to MAX_PERIOD. Greedy decoding with a small
model falls into such loops and stays there until max_tokens (SmolLM2-135M: "He was a pirate
who had a penchant for getting into trouble." 13 tokens, repeated to the limit).

Thresholds, from greedy SmolLM2-135M chat answers (28 prompts, 256 tokens; 8 of them looped
to the limit):
- a loop must cover MIN_COPIES copies of its period: two copies occur in sound text ("You're
  going up, and you're going to keep going." said twice, then the answer ends well), three in
  a row were a loop every time;
- and at least MIN_SPAN tokens: a short line may repeat a few times on purpose (a poem's
  refrain, 8 tokens, 3 times in a row, then the next stanza); with 32, "la femme au martyre,"
  (7 tokens) stops after 47 tokens instead of running to max_tokens;
- periods up to MAX_PERIOD = 32 tokens: looping sentences and table rows were 7-22 tokens
  long ("They are also very intelligent and can be trained ...": 22), a looping stanza 31.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_PERIOD = 32
MIN_SPAN = 32
MIN_COPIES = 3


@dataclass(slots=True)
class LoopDetector:
    """Fed every generated token; says when the output ends in a loop.

    `runs[p - 1]`: how many of the latest tokens equal the token p places before each, so the
    last `runs[p - 1] + p` tokens have period p. O(max_period) per token.
    """

    max_period: int = MAX_PERIOD
    min_span: int = MIN_SPAN
    min_copies: int = MIN_COPIES
    runs: list[int] = field(default_factory=list)
    _recent: deque[int] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.runs = [0] * self.max_period

    def push(self, token: int) -> int:
        """Adds a token; returns the loop's period if the output now ends in one, else 0."""
        recent = self._recent
        n = len(recent)
        found = 0
        for p in range(1, self.max_period + 1):
            run = self.runs[p - 1] + 1 if p <= n and recent[n - p] == token else 0
            self.runs[p - 1] = run
            span = run + p
            if not found and run and span >= self.min_span and span >= self.min_copies * p:
                found = p  # the shortest period is the loop's own (multiples of it run too)
        recent.append(token)
        if n + 1 > self.max_period:
            recent.popleft()
        return found

    @property
    def repeating(self) -> int:
        """How many of the latest tokens repeat an earlier stretch (for some period): loop candidates."""
        return max(self.runs, default=0)

    def repeats(self, period: int) -> int:
        """The latest tokens that repeat the loop of `period` beyond its first occurrence."""
        return self.runs[period - 1]


@dataclass(slots=True)
class LowConfidenceRun:
    """Counts consecutive tokens the model gave less than `threshold` log-probability; `length` 0 is off."""

    length: int
    threshold: float
    run: int = 0

    def push(self, logprob: float) -> bool:
        """Adds a token's log-probability; True once `length` low ones came in a row."""
        self.run = self.run + 1 if logprob < self.threshold else 0
        return self.length > 0 and self.run >= self.length
