"""The serve-or-not decision for a lookup's semantic candidates: cosine gate, rule vetoes, cross-encoder.

Every caller (both cache backends, `tierlane cache match`, bench/cache_quality.py) decides through
`decide_many`, so the gateway, the CLI and the figures share one verifier and one threshold.
The cross-encoder (policies/cache/cross_encoder.py) is called once per lookup, on the candidates
that cleared the gate and the vetoes, batched; a lookup with none left makes no call. Callers on
the event loop run this on a worker thread: the cross-encoder is CPU work.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from policies.cache.cross_encoder import load_cross_encoder
from policies.cache.verify import Features, VerifyConfig, features, mismatch

# (similarity, stored text, stored vector or None): what a lookup knows of one candidate.
Candidate = tuple[float, str, "np.ndarray | None"]

# NOTE: a stored entry is a candidate of many lookups, and a query's text is the text of the
# entry its answer is stored as; the rule vetoes' features are a pure function of the text and
# the checks, so those of recent short texts are kept. Extracting them was a third of the
# cache thread's CPU on the miss path (about 18 us a text on one core, five texts a lookup).
# Bounded: at most _MEMO_SIZE texts of at most _MEMO_CHARS (22 KB each at worst).
_MEMO_SIZE = 1024
_MEMO_CHARS = 1000


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _memo_features(text: str, checks: VerifyConfig) -> Features:
    return features(text, checks)


def text_features(text: str, checks: VerifyConfig) -> Features:
    """`verify.features`, kept for recent short texts. The result is shared: read it, never change it."""
    return _memo_features(text, checks) if len(text) <= _MEMO_CHARS else features(text, checks)


def is_cross_encoder(path: str) -> bool:
    """An .onnx artifact is a cross-encoder; an .npz one the previous embedding-feature verifier."""
    return path.endswith(".onnx")


@dataclass(slots=True, frozen=True)
class Decision:
    """Whether a candidate may be served, and if not, which check refused it."""

    hit: bool
    similarity: float
    reason: str | None  # None on a hit; "threshold", "numbers", "negation", ..., "verifier"
    probability: float | None = None  # the cross-encoder's probability, when it ran


def decide_many(
    query: str,
    candidates: Sequence[Candidate],
    *,
    threshold: float,
    checks: VerifyConfig,
    query_vector: np.ndarray | None = None,
    query_features: Features | None = None,
    space: str | None = None,
) -> list[Decision]:
    """One decision per (similarity, candidate text, candidate vector), in order.

    `space` names the embedding the similarities and vectors come from (policies.embedding.embedder.vector_space):
    the cross-encoder's blend fitted for it reads them.

    A candidate below `threshold` (the cosine gate) or failing a rule veto is a miss without the
    verifier; the rest are scored together in one call and served when the probability is
    >= `checks.min_probability`. With `verifier: off` the vetoes alone decide. The previous
    verifier (an .npz artifact) reads both vectors: a candidate without them is a miss.
    """
    decisions: list[Decision | None] = [None] * len(candidates)
    survivors: list[int] = []
    qf: Features | None = query_features
    for i, (similarity, text, _) in enumerate(candidates):
        if similarity < threshold:
            decisions[i] = Decision(False, similarity, "threshold")
            continue
        if qf is None:
            qf = text_features(query, checks)
        reason = mismatch(qf, text_features(text, checks), checks)
        if reason is not None:
            decisions[i] = Decision(False, similarity, reason)
        elif checks.verifier is None:
            decisions[i] = Decision(True, similarity, None)
        else:
            survivors.append(i)
    if survivors:
        assert checks.verifier is not None
        if is_cross_encoder(checks.verifier):
            scored = _cross_encoder(query, [candidates[i] for i in survivors], checks, query_vector, space)
        else:
            scored = _previous_verifier(query, [candidates[i] for i in survivors], checks, query_vector)
        for i, probability in zip(survivors, scored):
            if probability is None:
                decisions[i] = Decision(False, candidates[i][0], "no_vector")
                continue
            hit = probability >= checks.min_probability
            decisions[i] = Decision(hit, candidates[i][0], None if hit else "verifier", probability)
    return [d for d in decisions if d is not None]


def _cross_encoder(
    query: str, candidates: Sequence[Candidate], checks: VerifyConfig, query_vector: np.ndarray | None,
    space: str | None = None,
) -> list[float | None]:
    """One batched cross-encoder call; a blend that reads the previous verifier scores the same
    candidates with it first (a candidate without vectors is then a miss, as there)."""
    assert checks.verifier is not None
    encoder = load_cross_encoder(checks.verifier)
    keep = list(range(len(candidates)))
    previous: list[float] | None = None
    previous_path = encoder.previous_verifier_for(space)
    if previous_path is not None:
        scored = _previous_verifier(query, candidates, checks, query_vector, str(previous_path))
        keep = [i for i, p in enumerate(scored) if p is not None]
        previous = [float(scored[i]) for i in keep]  # type: ignore[arg-type]
    out: list[float | None] = [None] * len(candidates)
    if keep:
        probabilities = encoder.probabilities([(query, candidates[i][1]) for i in keep], [candidates[i][0] for i in keep],
                                              previous, space)  # fmt: skip
        for i, probability in zip(keep, probabilities.tolist()):
            out[i] = probability
    return out


def _previous_verifier(
    query: str, candidates: Sequence[Candidate], checks: VerifyConfig, query_vector: np.ndarray | None, path: str | None = None
) -> list[float | None]:
    from policies.cache.verifier import PairText, load_verifier, pair_vector

    assert checks.verifier is not None
    model = load_verifier(path or checks.verifier)
    a = PairText(query, checks)
    out: list[float | None] = []
    for _, text, vector in candidates:
        if query_vector is None or vector is None:
            out.append(None)
        else:
            out.append(model.probability(pair_vector(query_vector, vector, a, PairText(text, checks), checks)))
    return out


def load(checks: VerifyConfig) -> None:
    """Read (and check) the configured verifier now, not on the first lookup."""
    if checks.verifier is None:
        return
    if is_cross_encoder(checks.verifier):
        encoder = load_cross_encoder(checks.verifier)
        from policies.cache.verifier import load_verifier

        for path in encoder.previous_verifiers():
            load_verifier(str(path))
    else:
        from policies.cache.verifier import load_verifier

        load_verifier(checks.verifier)


def decide(
    similarity: float,
    query: str,
    candidate: str,
    *,
    threshold: float,
    checks: VerifyConfig,
    query_vector: np.ndarray | None = None,
    candidate_vector: np.ndarray | None = None,
    space: str | None = None,
) -> Decision:
    """The decision for one candidate (`decide_many` with one)."""
    return decide_many(query, [(similarity, candidate, candidate_vector)], threshold=threshold, checks=checks,
                       query_vector=query_vector, space=space)[0]  # fmt: skip
