"""How sure the model was of each sampled token, read from the logits the step already computed.

Costs no extra decode: the row a token was sampled from is read in place (a numpy view of
llama.cpp's output buffer, valid until the next decode) and reduced once: log-softmax of the
raw logits, so before penalties, temperature and grammar.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from edge_engine.events import TokenInfo

TOP_GAP = 8.0  # logits this far below the peak hold the top tokens of a typical row
MAX_CANDIDATES = 1024  # more (a flat row): a partition is cheaper than sorting them


def token_info(
    row: npt.NDArray[np.float32], token: int, piece: Callable[[int], bytes], top_k: int = 0
) -> TokenInfo:
    """The token's log-probability, the distribution's entropy (nats) and, if `top_k`, the top tokens."""
    peak = float(row.max())
    weights = row - peak  # the one temporary: exponentiated in place
    np.exp(weights, out=weights)
    total = float(weights.sum())
    lse = peak + math.log(total)
    # entropy = -sum p log p = lse - sum p x, with p = weights / total
    entropy = max(0.0, lse - float(np.dot(weights, row)) / total)
    top: tuple[tuple[bytes, float], ...] = ()
    if top_k > 0:
        top = tuple((piece(int(t)), float(row[t]) - lse) for t in _top(row, peak, min(top_k, row.shape[0])))
    return TokenInfo(token=token, piece=piece(token), logprob=float(row[token]) - lse, entropy=entropy, top=top)


def _top(row: npt.NDArray[np.float32], peak: float, k: int) -> npt.NDArray[np.intp]:
    """The k largest logits' ids, largest first."""
    # NOTE: a partition of the whole vocabulary costs ~10x the rest of token_info; the tokens
    # within TOP_GAP of the peak are usually a few dozen and, if at least k, hold the top k.
    candidates = np.flatnonzero(row >= peak - TOP_GAP)
    if not k <= candidates.size <= MAX_CANDIDATES:
        candidates = np.argpartition(row, -k)[-k:]
    return candidates[np.argsort(-row[candidates], kind="stable")[:k]]
