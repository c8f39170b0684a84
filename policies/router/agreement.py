"""Whether two answers to one request agree, judged on what can be checked without labels.

Two answers whose final results can be extracted agree when those results are equal: a number
(`\\boxed{}`, `#### 42`, "the answer is 3/4", or an answer that is only a number; compared as
values, so `0.75`, `3/4`, `\\frac{3}{4}` and `75%` of nothing else are one), a choice letter
("the answer is (B)", "Answer: B", or an answer that is only the letter), or a JSON document (an
answer that is only JSON, or one ```json block; compared parsed, key order aside). Anything else
is free text: `judge` says None and the caller decides by its own means (the shadow hook: answer
embeddings), never "agree" by default.

Embedding similarity alone cannot tell "The answer is 42." from "The answer is 43." (cosine 0.84
with the gateway's int8 MiniLM, 0.85 float32: above the shadow hook's 0.8 agreement line): for
checkable answers the extracted result decides.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

Kind = Literal["number", "choice", "json"]
Verdict = Literal["agree", "disagree"]

MAX_CHARS = 20_000  # longer answers are judged on their last MAX_CHARS characters (the final result is at the end)
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?%?"
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_HASHES = re.compile(r"^[ \t]*####[ \t]*(.+?)[ \t]*$", re.MULTILINE)
# a lowercase letter only in parentheses: "the answer is a matter of taste" states no choice.
# NOTE: no two adjacent unbounded repeats can match the same characters (each is one class):
# "answer is" and 3,000 spaces took 455 s to fail with `\s*:?\s*\**\s*` here.
_STATED = re.compile(r"(?:final answer|the answer|answer)[ \t]*(?:is|:|=)[\s:*]*(\([A-Ea-e]\)|(?-i:[A-E])(?![\w'])|" + _NUMBER
                     + r"|\\[dt]?frac\{-?\d+\}\{\d+\})",
                     re.IGNORECASE)
_ONLY_NUMBER = re.compile(r"^\s*\$?(" + _NUMBER + r")[\s.]*$")
_ONLY_CHOICE = re.compile(r"^\s*\(?([A-E])\)?[.)]?\s*$")
_FRAC = re.compile(r"^\\[dt]?frac\{(-?\d+)\}\{(\d+)\}$")
_JSON_BLOCK = re.compile(r"```(?:json)?\s*\n(.*?)\n```", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Final:
    """An answer's extracted final result."""

    kind: Kind
    value: Any


def _number(text: str) -> Fraction | float | None:
    raw = text.strip().strip("$").replace(",", "").replace(" ", "").rstrip(".")
    percent = raw.endswith("%")
    raw = raw.rstrip("%")
    frac = _FRAC.match(raw)
    value: Fraction | float
    try:
        if frac:
            value = Fraction(int(frac.group(1)), int(frac.group(2)))
        elif "/" in raw:
            num, den = raw.split("/", 1)
            value = Fraction(int(num), int(den))
        else:
            value = Fraction(raw)
    except (ValueError, ZeroDivisionError):
        try:
            value = float(raw)
        except ValueError:
            return None
    return value / 100 if percent else value


def _stated(text: str) -> Final | None:
    matches = list(_STATED.finditer(text))
    if not matches:
        return None
    match = matches[-1]  # the last statement wins
    token = match.group(1).strip()
    letter = token.strip("()")
    if len(letter) == 1 and letter.isalpha():
        return Final("choice", letter.upper())
    value = _number(token)
    return None if value is None else Final("number", value)


def final_answer(text: str) -> Final | None:
    """The answer's checkable final result, or None for free text."""
    if not isinstance(text, str) or not text.strip():
        return None
    text = text[-MAX_CHARS:]
    stripped = text.strip()
    if stripped[:1] in "{[":
        try:
            return Final("json", json.loads(stripped))
        except ValueError:
            pass
    blocks = _JSON_BLOCK.findall(text)
    if len(blocks) == 1:
        try:
            return Final("json", json.loads(blocks[0]))
        except ValueError:
            pass
    boxed = _BOXED.findall(text)
    if boxed:
        value = _number(boxed[-1])
        return Final("number", value) if value is not None else None
    hashes = _HASHES.findall(text)
    if hashes:
        value = _number(hashes[-1])
        if value is not None:
            return Final("number", value)
    if only := _ONLY_NUMBER.match(text):
        value = _number(only.group(1))
        return None if value is None else Final("number", value)
    if only := _ONLY_CHOICE.match(text):
        return Final("choice", only.group(1).upper())
    return _stated(text)


def _same_number(a: Fraction | float, b: Fraction | float) -> bool:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)


def judge(ours: str, theirs: str) -> Verdict | None:
    """`agree` or `disagree` where both answers have a final result of one kind; None otherwise."""
    a, b = final_answer(ours), final_answer(theirs)
    if a is None or b is None or a.kind != b.kind:
        return None
    if a.kind == "number":
        return "agree" if _same_number(a.value, b.value) else "disagree"
    return "agree" if a.value == b.value else "disagree"


def _call_key(call: Any) -> tuple[str, Any] | None:
    """(name, arguments parsed) of one chat tool call; None where it is not one."""
    if not isinstance(call, dict):
        return None
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    arguments: Any = function.get("arguments")
    if isinstance(arguments, str):
        text = arguments.strip()
        try:
            arguments = json.loads(text) if text else {}
        except ValueError:
            arguments = text  # not JSON (a freeform tool's input): compared as text
    return function["name"], json.dumps(_canonical(arguments), sort_keys=True, ensure_ascii=False, default=str)


def _canonical(value: Any) -> Any:
    """A JSON value with every number as a float (20 and 20.0 are one value), recursively."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def judge_calls(ours: Any, theirs: Any) -> Verdict | None:
    """Whether two answers that call tools agree: the same calls by tool name and arguments, the
    arguments compared as parsed JSON values (key order and spacing aside), the calls as a multiset
    (parallel calls may come in either order). None when neither answer calls a tool; `disagree`
    when one does and the other does not."""
    a = [c for c in ours if isinstance(c, dict)] if isinstance(ours, list) else []
    b = [c for c in theirs if isinstance(c, dict)] if isinstance(theirs, list) else []
    if not a and not b:
        return None
    keys_a, keys_b = [_call_key(c) for c in a], [_call_key(c) for c in b]
    if None in keys_a or None in keys_b:
        return "disagree"
    return "agree" if sorted(keys_a) == sorted(keys_b) else "disagree"  # type: ignore[type-var]
