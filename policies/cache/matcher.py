"""The serve-or-not decision for one semantic candidate: similarity threshold, then verification."""

from __future__ import annotations

from dataclasses import dataclass

from policies.cache.verify import VerifyConfig, verify


@dataclass(slots=True, frozen=True)
class Decision:
    """Whether a candidate may be served, and if not, which check refused it."""

    hit: bool
    similarity: float
    reason: str | None  # None on a hit; "threshold", "numbers", "negation", ...


def decide(similarity: float, query: str, candidate: str, *, threshold: float, checks: VerifyConfig) -> Decision:
    """Serve only when the vectors are close enough and the texts agree on what matters."""
    if similarity < threshold:
        return Decision(False, similarity, "threshold")
    reason = verify(query, candidate, checks)
    return Decision(reason is None, similarity, reason)
