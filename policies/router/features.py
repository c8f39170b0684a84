"""Cheap text features of a request, computed without any model call."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Bump whenever a feature is added, removed, reordered or computed differently:
# shipped artifacts record it and refuse to load against another version.
FEATURE_VERSION = 2
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

# Cues that carry difficulty across task families (math word problems, code, open chat): single
# words are looked up in sets over the token list, phrases counted with str.count, so every cue
# together costs about one pass over the text (no per-cue regex scan).
_OPERATOR_CHARS = "+*/×÷^=<>%"
_QUANTITY_WORDS = frozenset(
    "total altogether each per every remaining twice half thrice double triple percent percentage average ratio rate"
    " sum difference product profit cost costs price spend spent earn earns earned sell sells sold buy buys bought".split()
)
_QUANTITY_PHRASES = ("how many", "how much", "how long", "how far", "how old", "in all", "more than", "less than",
                     "fewer than", "times as", "left over")
_UNIT_CHARS = "$€£¥%"
_UNIT_WORDS = frozenset(
    "km kg mi miles hour hours minute minutes second seconds day days week weeks month months year years dollar dollars"
    " cent cents euro euros pound pounds liter liters litre litres ml meter meters metre metres feet foot inches inch mph"
    " gallons gallon ounces grams kilograms".split()
)
_CODE_WORDS = frozenset(
    "python java javascript typescript rust golang sql html css bash regex json api function functions method class"
    " variable variables algorithm code program programming script compile debug bug array arrays string strings"
    " integer recursion recursive complexity implement implementation snippet library database query loop".split()
)
_CODE_PHRASES = ("c++", "c#", "()", "==", "->", "=>")
_CONSTRAINT_WORDS = frozenset(
    "must should exactly without only avoid ensure include including format formatted table bullet bullets json"
    " rhyme limit maximum minimum strictly".split()
)
_CONSTRAINT_PHRASES = ("at least", "at most", "no more than", "no less than", "do not", "don't", "make sure",
                       "list of", "in the style", "each line", "start with", "end with", "words or less", "or fewer")
_LONG_WORDS = frozenset("essay article report detailed comprehensive thorough elaborate outline plan proposal paragraphs"
                        " several multiple".split())
_LONG_PHRASES = ("blog post", "in detail", "step by step", "step-by-step", "pros and cons", "all the")
_SHORT_WORDS = frozenset("brief briefly short concise tldr".split())
_SHORT_PHRASES = ("one sentence", "one word", "single word", "in a word", "yes or no", "true or false", "tl;dr")
_REASONING_WORDS = frozenset(
    "why explain reason because therefore suppose assume assuming imagine if then compare difference differences"
    " versus vs analyze analyse evaluate critique argue justify prove derive estimate probability logic riddle puzzle"
    " implications consequences tradeoffs".split()
)
_NEGATION_WORDS = frozenset("not except false incorrect least never neither nor none cannot".split())
_NEGATION_PHRASES = ("can't", "isn't", "doesn't", "n't ")
_CREATIVE_WORDS = frozenset(
    "poem story haiku joke song lyrics limerick slogan tweet email letter caption title name names rap dialogue"
    " tagline recipe greeting birthday funny".split()
)
_ROLEPLAY_WORDS = frozenset("pretend roleplay".split())
_ROLEPLAY_PHRASES = ("act as", "acting as", "you are a", "you are an", "imagine you", "role play", "role-play",
                     "in character", "as if you were")
_SENTENCE_END = re.compile(r"[.!?](?:\s|$)")
# A closed question: lettered options on their own lines ("A. ...", "(b) ..."), as in multiple choice.
_OPTION_LINE = re.compile(r"^\s*\(?[A-Ea-e][.):]\s+\S", re.MULTILINE)


def _hits(counts: Counter[str], vocabulary: frozenset[str], lowered: str = "", phrases: tuple[str, ...] = ()) -> int:
    """Occurrences of the vocabulary's words (from a word count) plus of the phrases (in the text)."""
    return sum(map(counts.__getitem__, vocabulary.intersection(counts))) + sum(map(lowered.count, phrases))


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
    "log_prior_chars",
    "log_sentences",
    "log_operators",
    "log_quantity_cues",
    "log_money_units",
    "log_max_number",
    "log_code_words",
    "log_constraints",
    "long_answer_cues",
    "short_answer_cues",
    "log_reasoning_cues",
    "negation_ratio",
    "creative_cues",
    "roleplay_cues",
    "closed_question",
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


def _conversation_shape(prompt: Prompt) -> tuple[int, bool, int]:
    """User turns, whether a system/developer message is there, and characters before the last user turn."""
    if isinstance(prompt, str):
        return 1, False, 0
    turns = sum(1 for m in prompt if m.get("role") == "user")
    has_system = any(m.get("role") in ("system", "developer") for m in prompt)
    last = max((i for i, m in enumerate(prompt) if m.get("role") == "user"), default=len(prompt) - 1)
    prior = sum(len(_content_text(m.get("content"))) for m in prompt[:last])
    return max(turns, 1), has_system, prior


def _max_number(numbers: list[str]) -> float:
    """The largest of the first 64 numerals, compared by integer digits (no float parsing per numeral)."""
    if not numbers:
        return 0.0

    def key(n: str) -> tuple[int, str]:
        whole = n.split(".", 1)[0].replace(",", "")
        return len(whole), whole

    best = max(numbers[:64], key=key).replace(",", "")
    try:
        return abs(float(best))
    except ValueError:  # "1.2.3"
        return float(key(best)[1] or 0)


def _user_turns_text(prompt: Prompt) -> str:
    """Every user turn, oldest first: what the conversation asks for as a whole."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(_content_text(m.get("content")) for m in prompt if m.get("role") == "user")


def _sample(text: str) -> tuple[str, float]:
    """At most SAMPLE_CHARS of `text` (head and tail) and the factor that scales counts back up."""
    if len(text) <= SAMPLE_CHARS:
        return text, 1.0
    sample = text[: SAMPLE_CHARS // 2] + "\n" + text[-SAMPLE_CHARS // 2 :]
    return sample, len(text) / len(sample)


def text_features(prompt: Prompt) -> np.ndarray:
    """The FEATURE_NAMES vector (float64) for one prompt string or chat message list.

    Shape features (length, question type, wording) read the last user turn, the text that is
    embedded; task cues (numbers, operators, code, steps, constraints, reasoning) read every user
    turn, so a short follow-up ("now do it for n = 5") keeps the cues of the task it continues.
    """
    text = last_user_text(prompt)
    turns, has_system, prior_chars = _conversation_shape(prompt)
    # Regexes read at most SAMPLE_CHARS (head and tail) and counts are scaled up, so a huge
    # pasted document costs the same as a page; len(), count() and encode() still see everything.
    sample, scale = _sample(text)
    task_text = text if turns == 1 else _user_turns_text(prompt)
    task, task_scale = (sample, scale) if task_text is text else _sample(task_text)
    lowered = sample.lower()
    tokens = _TOKEN.findall(lowered)
    n_tokens = len(tokens) * scale
    words = list(filter(str.isalpha, tokens))
    n_words = len(words)
    counts = Counter(words)
    if task is sample:
        task_lowered, task_tokens, task_words, task_counts = lowered, tokens, words, counts
    else:
        task_lowered = task.lower()
        task_tokens = _TOKEN.findall(task_lowered)
        task_words = list(filter(str.isalpha, task_tokens))
        task_counts = Counter(task_words)
    n_task_tokens = len(task_tokens) * task_scale
    numbers = _NUMBER.findall(task)
    n_numbers = len(numbers) * task_scale
    n_math = len(_LATEX.findall(task)) + sum(map(task.count, _MATH_CHARS)) + _hits(task_counts, _MATH_WORDS)
    n_steps = _hits(task_counts, _STEP_WORDS, task_lowered, _STEP_PHRASES)
    code_lines = len(_CODE_LINE.findall(task)) if ("\n" in task or ";" in task or "{" in task) else 0
    non_ascii = len(text) - len(text.encode("ascii", "ignore"))
    first_line = text.lstrip()[:200]

    values = [
        math.log1p(n_tokens),
        math.log1p(len(text)),
        math.log1p(text.count("\n")),
        math.log1p(turns - 1),
        float(has_system),
        float(task_text.count("```") // 2),
        math.log1p(code_lines * task_scale),
        n_math * task_scale / (n_task_tokens + 1),
        math.log1p(n_numbers),
        n_numbers / (n_task_tokens + 1),
        math.log1p(n_steps * task_scale),
        math.log1p(text.count("?")),
        (sum(map(len, words)) / n_words) if n_words else 0.0,
        (_hits(counts, _STOPWORDS) / n_words) if n_words else 0.0,
        non_ascii / (len(text) + 1),
        *(1.0 if pattern.match(first_line) else 0.0 for _, pattern in _QUESTION_TYPES),
        math.log1p(prior_chars),
        math.log1p(len(_SENTENCE_END.findall(sample)) * scale),
        math.log1p(sum(map(task.count, _OPERATOR_CHARS)) * task_scale),
        math.log1p(_hits(task_counts, _QUANTITY_WORDS, task_lowered, _QUANTITY_PHRASES) * task_scale),
        math.log1p((sum(map(task.count, _UNIT_CHARS)) + _hits(task_counts, _UNIT_WORDS)) * task_scale),
        math.log1p(min(_max_number(numbers), 1e12)),
        math.log1p(_hits(task_counts, _CODE_WORDS, task_lowered, _CODE_PHRASES) * task_scale),
        math.log1p(_hits(task_counts, _CONSTRAINT_WORDS, task_lowered, _CONSTRAINT_PHRASES) * task_scale),
        min(_hits(counts, _LONG_WORDS, lowered, _LONG_PHRASES), 3) / 3.0,
        min(_hits(counts, _SHORT_WORDS, lowered, _SHORT_PHRASES), 3) / 3.0,
        math.log1p(_hits(task_counts, _REASONING_WORDS) * task_scale),
        _hits(counts, _NEGATION_WORDS, lowered, _NEGATION_PHRASES) / (n_words + 1),
        min(_hits(counts, _CREATIVE_WORDS), 3) / 3.0,
        min(_hits(counts, _ROLEPLAY_WORDS, lowered, _ROLEPLAY_PHRASES), 2) / 2.0,
        1.0 if "\n" in sample and len(_OPTION_LINE.findall(sample)) >= 3 else 0.0,
    ]
    return np.asarray(values, dtype=np.float64)


def text_feature_matrix(prompts: Sequence[Prompt]) -> np.ndarray:
    """One FEATURE_NAMES row per prompt."""
    if not prompts:
        return np.zeros((0, len(FEATURE_NAMES)), dtype=np.float64)
    return np.vstack([text_features(p) for p in prompts])
