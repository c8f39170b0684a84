"""Programmatic checkers: tolerant of harmless formatting, strict on content.

"The answer is 12." passes for 12 and "paris" for Paris, but a second candidate answer, a
distractor from the question's own text, or a different number fails. Every checker takes the
probe and the model's full answer text and returns whether the answer is correct.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

from policies.edge_quality.probes import Probe

_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?![\d])|(?<![\w.])-?\d+(?:\.\d+)?")
_NUMBER_WORDS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
    "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16,
    "seventeen": 17, "eighteen": 18, "nineteen": 19, "twenty": 20,
}
_WORDS_RE = re.compile(r"\b(" + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE)


def fold(text: str) -> str:
    """Lower case, accents removed, curly quotes straightened, whitespace collapsed."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = text.replace("\u2019", "'").replace("\u2018", "'").replace("\u201c", '"').replace("\u201d", '"')
    return " ".join(text.lower().split())


def numbers(text: str) -> list[float]:
    """Numbers in order of appearance: digits (with thousands commas) and the words zero to twenty."""
    found: list[tuple[int, float]] = []
    for m in _NUMBER.finditer(text):
        found.append((m.start(), float(m.group().replace(",", ""))))
    for m in _WORDS_RE.finditer(text):
        found.append((m.start(), float(_NUMBER_WORDS[m.group().lower()])))
    return [v for _, v in sorted(found)]


def _is_number(text: str) -> bool:
    return re.fullmatch(r"-?\d+(?:\.\d+)?", text.replace(",", "")) is not None


def _has_phrase(haystack: str, needle: str) -> bool:
    """Whole-word occurrence after folding; punctuation inside the needle is kept."""
    n = fold(needle)
    return re.search(r"(?<![\w])" + re.escape(n) + r"(?![\w])", fold(haystack)) is not None


def _mentions(text: str, value: str) -> bool:
    if _is_number(value):
        return float(value.replace(",", "")) in numbers(text)
    return _has_phrase(text, value)


def check_number_last(probe: Probe, text: str) -> bool:
    """The last number stated is the answer (the working before it may restate the question)."""
    values = numbers(text)
    return bool(values) and values[-1] == float(probe.answer)


def check_mention(probe: Probe, text: str) -> bool:
    """The answer (or an alias) appears as a whole word or number, and no distractor does."""
    if not any(_mentions(text, v) for v in (probe.answer, *probe.aliases)):
        return False
    return not any(_mentions(text, d) for d in probe.distractors)


def check_number_in_text(probe: Probe, text: str) -> bool:
    """Extraction of a number: it is stated, no distractor is, and no number is made up (computed
    numbers such as "6 x 3 = 18" fail; the text's own numbers and years are tolerated)."""
    if not check_mention(probe, text):
        return False
    allowed = set(numbers(probe.prompt)) | {float(probe.answer)}
    return all(v in allowed or (1000 <= v <= 2100 and v.is_integer()) for v in numbers(text))


def check_symbol(probe: Probe, text: str) -> bool:
    """A chemical symbol, case-sensitive (Co is not CO), as its own token."""
    tokens = re.findall(r"[A-Za-z]+", text)
    return probe.answer in tokens


def check_exact_case(probe: Probe, text: str) -> bool:
    """The exact string, case included, as its own token (uppercase tasks)."""
    return re.search(r"(?<![A-Za-z])" + re.escape(probe.answer) + r"(?![A-Za-z])", text) is not None


_LETTER_PATTERNS = (
    re.compile(r"['\"\u2018\u201c(*]([A-Za-z])['\"\u2019\u201d)*]"),
    # unquoted only as a capital: "is a letter" names no letter
    re.compile(r"\b(?:is|letter|with)\s+([A-Z])\b(?![a-z'])"),
    re.compile(r"^\s*([A-Za-z])\s*[.!]?\s*$"),
)


def _letters(text: str) -> set[str]:
    found: set[str] = set()
    for pattern in _LETTER_PATTERNS:
        found.update(m.group(1).lower() for m in pattern.finditer(text))
    return found


def check_letter(probe: Probe, text: str) -> bool:
    """One letter named (quoted, after "is"/"letter", or alone), and it is the right one."""
    return _letters(text) == {probe.answer.lower()}


def check_yesno(probe: Probe, text: str) -> bool:
    """The first yes/no word of the answer is the right one."""
    m = re.search(r"\b(yes|no|true|false|correct|incorrect)\b", fold(text))
    if m is None:
        return False
    said = "yes" if m.group(1) in ("yes", "true", "correct") else "no"
    return said == probe.answer


def _loose(text: str) -> str:
    text = fold(text)
    text = re.sub(r"[\"'`*]", "", text)
    return re.sub(r"\s*([.,!?;:])\s*", r"\1 ", text).strip(" .")


def check_repeat(probe: Probe, text: str) -> bool:
    """The sentence, word for word (case, quotes and spacing aside), with little else around it."""
    target, said = _loose(probe.answer), _loose(text)
    return target in said and len(said) <= len(target) + max(30, len(target) // 2)


def check_repeat_case(probe: Probe, text: str) -> bool:
    """As check_repeat, and the letters' case must match (lowercase tasks)."""
    if not check_repeat(probe, text):
        return False
    stripped = re.sub(r"[^\w\s]", "", probe.answer)
    return stripped.split()[0] in text and probe.answer.upper() not in text


_CHOICE_PATTERNS = (
    re.compile(r"(?:^|\n)\s*\(?([A-D])[).:](?:\s|$)"),  # "B." or "(B)" at a line start
    re.compile(r"\b(?:answer|option|choice)\s*(?:is|:)?\s*:?\s*\(?([A-D])\b(?![a-z'])"),
    re.compile(r"^\s*\(?([A-D])\)?\s*$"),
    re.compile(r"^\s*\**\(?([A-D])\)?\**(?:$|[.,:)])"),  # not "A thermometer ...": the article
)


def chosen_options(probe: Probe, text: str) -> set[str]:
    """The option letters an answer picks: by letter where it names any, else by option text."""
    picked: set[str] = set()
    for pattern in _CHOICE_PATTERNS:
        picked.update(m.group(1) for m in pattern.finditer(text))
    if picked:
        return picked
    labels = "ABCDEFGH"
    return {labels[i] for i, choice in enumerate(probe.choices) if choice and _has_phrase(text, choice)}


def check_choice(probe: Probe, text: str) -> bool:
    """Exactly one option picked, and it is the key."""
    return chosen_options(probe, text) == {probe.answer}


_MONTH_DAY = re.compile(r"\b([a-z]+)\s+(\d{1,2})(?:st|nd|rd|th)?\b")
_DAY_MONTH = re.compile(r"\b(\d{1,2})(?:st|nd|rd|th)?\s+(?:of\s+)?([a-z]+)\b")


def check_date(probe: Probe, text: str) -> bool:
    """The month and day, in either order ("March 3", "3rd of March"), and no other date."""
    month, day = probe.answer.split()
    folded = fold(text)
    found = {(m.group(1), int(m.group(2))) for m in _MONTH_DAY.finditer(folded)}
    found |= {(m.group(2), int(m.group(1))) for m in _DAY_MONTH.finditer(folded)}
    return {f for f in found if f[0] in _MONTHS_LOWER} == {(month.lower(), int(day))}


_MONTHS_LOWER = frozenset(
    "january february march april may june july august september october november december".split()
)

CHECKERS: dict[str, Callable[[Probe, str], bool]] = {
    "number_last": check_number_last,
    "mention": check_mention,
    "number_in_text": check_number_in_text,
    "symbol": check_symbol,
    "exact_case": check_exact_case,
    "letter": check_letter,
    "yesno": check_yesno,
    "repeat": check_repeat,
    "repeat_case": check_repeat_case,
    "choice": check_choice,
    "date": check_date,
}


def is_correct(probe: Probe, text: str, finish_reason: str = "stop") -> bool:
    """Whether the edge answer counts as right: finished on its own ("stop") and passing its checker.

    An answer cut by max_tokens, stopped as a loop or for low confidence is wrong whatever it holds.
    """
    if finish_reason != "stop":
        return False
    return CHECKERS[probe.check](probe, text)
