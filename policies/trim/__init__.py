"""Prompt trimming: lossless passes first, then budgeted ones, each accounting for the tokens it removed."""

from policies.trim.config import LOSSLESS_PASSES, PASSES, TrimPolicy, TrimPolicyError
from policies.trim.core import trim_request
from policies.trim.messages import estimate_tokens
from policies.trim.passes import Dropped
from policies.trim.report import TrimResult

__all__ = [
    "LOSSLESS_PASSES",
    "PASSES",
    "Dropped",
    "TrimPolicy",
    "TrimPolicyError",
    "TrimResult",
    "estimate_tokens",
    "trim_request",
]
