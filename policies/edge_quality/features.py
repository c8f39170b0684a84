"""Features of the two decisions: cheap prompt features (before generation) and token statistics
of the answer (after). Both are plain numpy, a few microseconds per call.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from policies.unicode_norm import nfkc_collapsed

# Bump whenever a feature is added, removed, reordered or computed differently: artifacts record
# it and refuse to load against another version.
FEATURE_VERSION = 1
SAMPLE_CHARS = 4000

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_OPERATOR = re.compile(r"\d\s*([-+*/×x÷^])\s*\d")
_OP_WORDS = {
    "plus": "+", "add": "+", "sum": "+", "minus": "-", "subtract": "-", "times": "*",
    "multiply": "*", "multiplied": "*", "product": "*", "divided": "/", "divide": "/",
}
_OP_PHRASES = {"take away": "-"}
# option labels ("A. ...", "(B) ...") after whitespace: the text is whitespace-collapsed first
_MC_OPTION = re.compile(r"(?:^|\s)\(?[A-E][).:]\s+\S")
_QUOTED = re.compile(r"['\"\u2018\u201c]([^'\"\u2019\u201d]{1,80})['\"\u2019\u201d]")
_CAPWORD = re.compile(r"(?<![.!?]\s)(?<!^)\b[A-Z][a-z]+")
_WORD = re.compile(r"[A-Za-z]+")
_LOWER_WORD = re.compile(r"[a-z]+")
# Cue vocabularies, matched as whole lower-case words or as phrases (set lookups: a regex
# alternation per cue cost ~20 us each)
_YES_NO_FIRST = frozenset("is are does do can was would".split())
_YES_NO_PHRASES = ("yes or no", "true or false")
_WORD_TASK_WORDS = frozenset("letter letters uppercase lowercase backwards reverse spell plural".split())
_WORD_TASK_PHRASES = ("upper case", "capital letters", "lower case", "past tense")
_COPY_WORDS = frozenset("repeat copy echo exactly".split())
_COPY_PHRASES = ("say this back", "word for word")
_CONTEXT_WORDS = frozenset("text sentence passage".split())
_CONTEXT_PHRASES = ("read this", "according to")
_OPEN_WORDS = frozenset("explain why describe essay story poem list summarise summarize compare discuss".split())
_OPEN_PHRASES = ("write a",)
_QWORDS: tuple[tuple[str, frozenset[str], tuple[str, ...]], ...] = (
    ("q_what", frozenset({"what", "which"}), ()),
    ("q_who", frozenset({"who", "whom"}), ()),
    ("q_how_many", frozenset(), ("how many", "how much", "how long")),
    ("q_when_where", frozenset({"when", "where"}), ()),
)


def _cue(words: set[str], spaced: str, vocabulary: frozenset[str], phrases: tuple[str, ...]) -> float:
    return float(not words.isdisjoint(vocabulary) or any(f" {p} " in spaced for p in phrases))


PROMPT_FEATURES: tuple[str, ...] = (
    "log_chars",
    "log_words",
    "question_marks",
    "log_numbers",
    "max_number_digits",
    "operand_digits",
    "op_add_sub",
    "op_multiply_divide",
    "mult_digit_load",
    "mc_options",
    "quoted_len",
    "capitalised_words",
    "yes_no_cue",
    "word_task_cue",
    "copy_cue",
    "context_cue",
    "open_ended_cue",
    "avg_word_len",
    *(name for name, _, _ in _QWORDS),
)

ANSWER_FEATURES: tuple[str, ...] = (
    "prior_logit",
    "p_min",
    "p_q10",
    "p_q25",
    "mean_logprob",
    "first_logprob",
    "mean_entropy",
    "max_entropy",
    "log_tokens",
)


class TokenStat(Protocol):
    """What the confidence model reads of a generated token (edge_engine.events.TokenInfo has it)."""

    @property
    def logprob(self) -> float: ...

    @property
    def entropy(self) -> float: ...


def normalise(text: str) -> str:
    """What the gateway embeds (policies.cache.scope.embedding_text): NFKC, whitespace runs collapsed,
    first SAMPLE_CHARS characters. Applied to every text, so raw and normalised input score alike."""
    return nfkc_collapsed(text[:2 * SAMPLE_CHARS])[:SAMPLE_CHARS]


def prompt_features(text: str) -> np.ndarray:
    """The cheap features of the last user turn (raw or as embedded: it is normalised here), float64."""
    text = normalise(text)
    lower = text.lower()
    lower_words = _LOWER_WORD.findall(lower)
    wordset = set(lower_words)
    spaced = " " + " ".join(lower_words) + " "
    words = _WORD.findall(text)
    numbers = _NUMBER.findall(text)
    digits = [len(re.sub(r"\D", "", n)) for n in numbers]
    ops = [m.group(1) for m in _OPERATOR.finditer(text)]
    ops += [op for w, op in _OP_WORDS.items() if w in wordset] + [op for p, op in _OP_PHRASES.items() if f" {p} " in spaced]
    add_sub = any(o in "+-" for o in ops)
    mul_div = any(o in "*/×x÷^" for o in ops)
    operand = sum(sorted(digits, reverse=True)[:2]) if ops else 0
    quoted = _QUOTED.findall(text)
    yes_no = bool(lower_words) and lower.lstrip().startswith(lower_words[0]) and lower_words[0] in _YES_NO_FIRST
    values = [
        math.log1p(len(text)),
        math.log1p(len(words)),
        min(text.count("?"), 3),
        math.log1p(len(numbers)),
        max(digits, default=0),
        operand,
        float(add_sub),
        float(mul_div),
        operand * float(mul_div),
        min(len(_MC_OPTION.findall(text)), 6),
        math.log1p(max((len(q) for q in quoted), default=0)),
        math.log1p(len(_CAPWORD.findall(text))),
        max(float(yes_no), _cue(wordset, spaced, frozenset(), _YES_NO_PHRASES)),
        _cue(wordset, spaced, _WORD_TASK_WORDS, _WORD_TASK_PHRASES),
        _cue(wordset, spaced, _COPY_WORDS, _COPY_PHRASES),
        _cue(wordset, spaced, _CONTEXT_WORDS, _CONTEXT_PHRASES),
        _cue(wordset, spaced, _OPEN_WORDS, _OPEN_PHRASES),
        (sum(len(w) for w in words) / len(words)) if words else 0.0,
        *(_cue(wordset, spaced, vocab, phrases) for _, vocab, phrases in _QWORDS),
    ]
    return np.asarray(values, dtype=np.float64)


def _quantile(ordered: Sequence[float], q: float) -> float:
    """numpy's default (linear) quantile of an ascending list, without numpy's per-call overhead."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def answer_features(prior: float, logprobs: Sequence[float], entropies: Sequence[float]) -> np.ndarray:
    """Token statistics of one answer (Chow-style low quantiles of token probability and more), float64.

    `logprobs`/`entropies`: one per generated token, in nats. An empty answer gets the values of
    one token the model was sure of not at all (the checkers fail empty answers anyway). Plain
    Python over at most a few hundred tokens: faster than numpy for one answer.
    """
    lp = [min(0.0, max(-20.0, float(v))) if v == v else -20.0 for v in logprobs] or [-20.0]
    ent = [float(v) for v in entropies] or [10.0]
    probs = sorted(math.exp(v) for v in lp)
    prior = min(max(prior, 1e-4), 1 - 1e-4)
    return np.asarray(
        [
            math.log(prior / (1 - prior)),
            probs[0],
            _quantile(probs, 0.10),
            _quantile(probs, 0.25),
            sum(lp) / len(lp),
            lp[0],
            sum(ent) / len(ent),
            max(ent),
            math.log1p(len(logprobs)),
        ],
        dtype=np.float64,
    )


def token_arrays(tokens: Sequence[TokenStat]) -> tuple[list[float], list[float]]:
    return [float(t.logprob) for t in tokens], [float(t.entropy) for t in tokens]
