"""The serve-or-not decision for one semantic candidate: similarity threshold, rule vetoes, learned verifier."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies.cache.verifier import PairText, load_verifier, pair_vector
from policies.cache.verify import VerifyConfig, mismatch


@dataclass(slots=True, frozen=True)
class Decision:
    """Whether a candidate may be served, and if not, which check refused it."""

    hit: bool
    similarity: float
    reason: str | None  # None on a hit; "threshold", "numbers", "negation", ..., "verifier", "no_vector"
    probability: float | None = None  # the verifier's calibrated probability, when it ran


def decide(
    similarity: float,
    query: str | PairText,
    candidate: str,
    *,
    threshold: float,
    checks: VerifyConfig,
    query_vector: np.ndarray | None = None,
    candidate_vector: np.ndarray | None = None,
) -> Decision:
    """Serve only when the vectors are close enough, no rule check fails and the verifier agrees.

    `query` may be given as a `PairText` (extracted once per lookup, reused for every candidate).
    With a verifier configured, both vectors are needed: without them the candidate is a miss.
    """
    if similarity < threshold:
        return Decision(False, similarity, "threshold")
    a = query if isinstance(query, PairText) else PairText(query, checks)
    b = PairText(candidate, checks)
    reason = mismatch(a.features, b.features, checks)
    if reason is not None:
        return Decision(False, similarity, reason)
    if checks.verifier is None:
        return Decision(True, similarity, None)
    if query_vector is None or candidate_vector is None:
        return Decision(False, similarity, "no_vector")
    probability = load_verifier(checks.verifier).probability(pair_vector(query_vector, candidate_vector, a, b, checks))
    hit = probability >= checks.min_probability
    return Decision(hit, similarity, None if hit else "verifier", probability)
