"""How far an adapter's confidence can be trusted: the held-out answers scored, and the threshold above which
they agree with the upstream often enough.

Two kinds of confidence, by template:

- a **label set** (the answers form a few labels): the probability of the chosen label, a softmax over
  the labels' sequence log-probabilities (each label's tokens and the end of the turn), the way a
  decoder constrained to the set would choose;
- **free text**: the mean log-probability of the tokens of the greedy answer, as the edge engine reports it.

The threshold is the lowest confidence at which the held-out answers at or above it agree with the
upstream's at least `1 - max_disagreement` of the time: the most answers served at that precision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Scored:
    """One held-out pair: the adapter's answer, how sure it was, and whether the upstream said the same."""

    pair_id: str
    answer: str
    confidence: float
    agrees: bool


@dataclass(frozen=True, slots=True)
class Threshold:
    """The confidence threshold and what it keeps of the held-out pairs (threshold None: no confidence reaches
    the target, so none of this adapter's answers should be served)."""

    threshold: float | None
    target_agreement: float
    coverage: float  # share of held-out pairs at or above the threshold
    agreement: float | None  # their agreement


def label_probabilities(logprobs: Sequence[float]) -> list[float]:
    """Softmax over the labels' sequence log-probabilities."""
    peak = max(logprobs)
    weights = [math.exp(x - peak) for x in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def threshold(scored: Sequence[Scored], max_disagreement: float) -> Threshold:
    """The lowest confidence whose answers at or above it agree at least `1 - max_disagreement` of the time."""
    target = 1.0 - max_disagreement
    ranked = sorted(scored, key=lambda s: -s.confidence)
    best: Threshold = Threshold(threshold=None, target_agreement=target, coverage=0.0, agreement=None)
    agree = 0
    for i, s in enumerate(ranked):
        agree += s.agrees
        if i + 1 < len(ranked) and ranked[i + 1].confidence == s.confidence:
            continue  # a threshold keeps every pair of its confidence: judge ties together
        kept = i + 1
        if agree / kept >= target - 1e-12:
            best = Threshold(threshold=s.confidence, target_agreement=target, coverage=kept / len(ranked),
                             agreement=agree / kept)  # fmt: skip
    return best
