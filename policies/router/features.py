"""Cheap text features of a request, computed without any model call."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Bump whenever a feature is added, removed, reordered or computed differently:
# shipped artifacts record it and refuse to load against another version.
FEATURE_VERSION = 1
SAMPLE_CHARS = 2000

Messages = Sequence[Mapping[str, Any]]
Prompt = str | Messages

_TOKEN = re.compile(r"\w+|[^\w\s]")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_CODE_LINE = re.compile(
    r"^\s*(?:def |class |import |from \S+ import|#include|function\b|public |private |return\b|for\s*\(|if\s*\(|SELECT\b|</?\w+>)"
    r"|[;{}]\s*$",
    re.MULTILINE,
)
_LATEX = re.compile(r"\\[a-zA-Z]+")
_MATH_CHARS = "$=<>^√∑∫π≤≥±×÷"
_MATH_WORDS = frozenset("sin cos tan log ln lim sqrt mod".split())
_STEP_WORDS = frozenset(
    "first firstly then next finally afterwards prove proof derive justify calculate compute solve determine"
    " evaluate simplify compare analyze analyse implement design optimize optimise".split()
)
_STEP_PHRASES = ("step by step", "step-by-step", "show that", "explain why", "how many", "how much")
_STOPWORDS = frozenset(
    "the a an of to in and or is are was were be it that this for on with as by at from what which who"
    " how why when where not can do does i you we they he she".split()
)
_QUESTION_TYPES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("q_what", re.compile(r"^\s*what\b", re.IGNORECASE)),
    ("q_why", re.compile(r"^\s*why\b", re.IGNORECASE)),
    ("q_how", re.compile(r"^\s*how\b", re.IGNORECASE)),
    ("q_which_who", re.compile(r"^\s*(?:which|who|whom|whose|when|where)\b", re.IGNORECASE)),
    ("q_yes_no", re.compile(r"^\s*(?:is|are|was|were|do|does|did|can|could|should|would|will|has|have)\b", re.IGNORECASE)),
    ("q_imperative", re.compile(r"^\s*(?:write|list|give|explain|describe|summari[sz]e|tell|create|make|generate|translate)\b", re.IGNORECASE)),
    ("q_solve", re.compile(r"^\s*(?:calculate|compute|solve|find|evaluate|prove|determine|simplify)\b", re.IGNORECASE)),
)

FEATURE_NAMES: tuple[str, ...] = (
    "log_tokens",
    "log_chars",
    "log_lines",
    "turns",
    "has_system",
    "code_fences",
    "code_lines",
    "math_density",
    "log_numbers",
    "number_density",
    "multi_step_cues",
    "question_marks",
    "avg_word_len",
    "stopword_ratio",
    "non_ascii_ratio",
    *(name for name, _ in _QUESTION_TYPES),
)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
        return "\n".join(str(p) for p in parts)
    return ""


def last_user_text(prompt: Prompt) -> str:
    """The text the router and the cache embed: the last user turn (or the prompt itself)."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt):
        if message.get("role") == "user":
            return _content_text(message.get("content"))
    return _content_text(prompt[-1].get("content")) if prompt else ""


def _conversation_shape(prompt: Prompt) -> tuple[int, bool]:
    if isinstance(prompt, str):
        return 1, False
    turns = sum(1 for m in prompt if m.get("role") == "user")
    has_system = any(m.get("role") in ("system", "developer") for m in prompt)
    return max(turns, 1), has_system


def text_features(prompt: Prompt) -> np.ndarray:
    """The FEATURE_NAMES vector (float64) for one prompt string or chat message list."""
    text = last_user_text(prompt)
    turns, has_system = _conversation_shape(prompt)
    # Regexes read at most SAMPLE_CHARS (head and tail) and counts are scaled up, so a huge
    # pasted document costs the same as a page; len(), count() and encode() still see everything.
    sample = text if len(text) <= SAMPLE_CHARS else text[: SAMPLE_CHARS // 2] + "\n" + text[-SAMPLE_CHARS // 2 :]
    scale = len(text) / max(len(sample), 1)
    tokens = _TOKEN.findall(sample)
    n_tokens = len(tokens) * scale
    words = [w.lower() for w in filter(str.isalpha, tokens)]
    n_words = len(words)
    lowered = sample.lower()
    n_numbers = len(_NUMBER.findall(sample)) * scale
    n_math = len(_LATEX.findall(sample)) + sum(map(sample.count, _MATH_CHARS)) + sum(map(_MATH_WORDS.__contains__, words))
    n_steps = sum(map(_STEP_WORDS.__contains__, words)) + sum(map(lowered.count, _STEP_PHRASES))
    code_lines = len(_CODE_LINE.findall(sample)) if ("\n" in sample or ";" in sample or "{" in sample) else 0
    non_ascii = len(text) - len(text.encode("ascii", "ignore"))
    first_line = text.lstrip()[:200]
    values = [
        math.log1p(n_tokens),
        math.log1p(len(text)),
        math.log1p(text.count("\n")),
        math.log1p(turns - 1),
        float(has_system),
        float(text.count("```") // 2),
        math.log1p(code_lines * scale),
        n_math * scale / (n_tokens + 1),
        math.log1p(n_numbers),
        n_numbers / (n_tokens + 1),
        math.log1p(n_steps * scale),
        math.log1p(text.count("?")),
        (sum(map(len, words)) / n_words) if n_words else 0.0,
        (sum(map(_STOPWORDS.__contains__, words)) / n_words) if n_words else 0.0,
        non_ascii / (len(text) + 1),
        *(1.0 if pattern.match(first_line) else 0.0 for _, pattern in _QUESTION_TYPES),
    ]
    return np.asarray(values, dtype=np.float64)


def text_feature_matrix(prompts: Sequence[Prompt]) -> np.ndarray:
    """One FEATURE_NAMES row per prompt."""
    if not prompts:
        return np.zeros((0, len(FEATURE_NAMES)), dtype=np.float64)
    return np.vstack([text_features(p) for p in prompts])
