"""Chat message shapes: validation, text access and token counting with the chat-format overhead."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from policies.errors import InvalidInput

VALID_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
SYSTEM_ROLES = frozenset({"system", "developer"})
TOOL_ROLES = frozenset({"tool", "function"})

# A rough BPE: a token per short word, punctuation mark, line break or run of spaces; long runs per 4 characters.
_ESTIMATE_RE = re.compile(r"\w+|[^\w\s]|\s{2,}|\n")


# The runs _ESTIMATE_RE takes whole that count for more than one token (5 characters or more).
_LONG_RUN_RE = re.compile(r"\w{5,}|\s{5,}")
class TextMemo:
    """A bounded memo of a value per long text, shared across requests and threads: an agent sends
    the same tool outputs and system prompt every turn, so their counts and checks are done once.
    Bounded by the characters it holds (a dict keeps each text alive), oldest out first."""

    # NOTE: 128, not only long texts: an agent turn re-sends hundreds of short messages (tool calls,
    # short results, the agent's notes), and counting each again cost more than the long ones
    # together (bench/trim_savings.py's agent sessions: trim with masking 3.7 -> 2.2 ms a request
    # median on a 101-call Claude Code session; a text under 128 characters counts in about a
    # microsecond, less than its memo entry)
    MIN_CHARS = 128

    # NOTE: 8M characters: the texts of a few dozen agent sessions at once, at most 32 MB of str
    # (4 bytes a character at worst); a text over an eighth of it is never kept
    def __init__(self, max_chars: int = 8_000_000) -> None:
        self.max_chars = max_chars
        self._values: OrderedDict[str, Any] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def knows(self, text: str) -> bool:
        """Whether `text`'s value is kept (a get would not compute it); a text too short to keep counts as known."""
        if len(text) < self.MIN_CHARS:
            return True
        with self._lock:
            return text in self._values

    def get(self, text: str, compute: Callable[[str], Any]) -> Any:
        if len(text) < self.MIN_CHARS or len(text) > self.max_chars // 8:
            return compute(text)
        with self._lock:
            if text in self._values:
                self._values.move_to_end(text)
                return self._values[text]
        value = compute(text)
        with self._lock:
            if text not in self._values:
                self._values[text] = value
                self._chars += len(text)
                while self._chars > self.max_chars:
                    old, _ = self._values.popitem(last=False)
                    self._chars -= len(old)
        return value


_COUNTS = TextMemo()


def _estimate(text: str) -> int:
    if len(text) >= RUNS_MIN_CHARS:
        n = estimate_by_runs(text)
        if n is not None:
            return n
    return estimate_by_regex(text)


def estimate_by_regex(text: str) -> int:
    """The estimate's definition: a token per _ESTIMATE_RE match, more for long runs."""
    # NOTE: one token per run, plus (length + 3) // 4 - 1 more for each long one: the same count as
    # a Python loop over every match, with the matching done in C (a 500 KB prompt: 140 ms -> ~10 ms)
    n = len(_ESTIMATE_RE.findall(text))
    for m in _LONG_RUN_RE.finditer(text):
        n += (m.end() - m.start() + 3) // 4 - 1
    return n


# From this length the estimate counts character runs with numpy: the regexes take ~70 ns a
# character (a 37 KB source file read by an agent: 2.8 ms), the array pass ~9 (0.33 ms); below it
# the fixed cost of the arrays is more than the regexes'.
RUNS_MIN_CHARS = 512
# A text with more distinct non-ASCII characters than this is counted by the regexes (each such
# character costs a pass over the text here).
_RUNS_MAX_NON_ASCII = 32
_NON_ASCII_RE = re.compile(r"[^\x00-\x7f]")
_WORD, _NEWLINE, _SPACE, _OTHER = 1, 2, 3, 0
# what each character class is replaced with before the array pass (an ASCII one of the same class)
_CLASS_STAND_IN = {_WORD: "a", _NEWLINE: "\n", _SPACE: "\t", _OTHER: "!"}


def _char_class(c: str) -> int:
    # what the `re` module's \w and \s match in a str pattern: str.isalnum() or "_", str.isspace()
    if c.isalnum() or c == "_":
        return _WORD
    if c == "\n":
        return _NEWLINE
    return _SPACE if c.isspace() else _OTHER


_BYTE_CLASS = np.array([_char_class(chr(i)) if i < 128 else _OTHER for i in range(256)], dtype=np.int8)


def _runs(mask: npt.NDArray[np.bool_]) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """(lengths, starts) of the runs of True in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).view(np.int8)))
    return edges[1::2] - edges[::2], edges[::2]


def estimate_by_runs(text: str) -> int | None:
    """`estimate_by_regex`'s count from the text's runs of word, space and other characters, or
    None for a text with many distinct non-ASCII characters.

    The regex takes each maximal word run (a token, plus (length - 1) // 4 for a long one), each
    other character, each maximal whitespace run of two or more (plus (length - 1) // 4 for a long
    one) and each lone line break; counted here from the runs' lengths.
    """
    if not text.isascii():
        chars = set(_NON_ASCII_RE.findall(text))
        if len(chars) > _RUNS_MAX_NON_ASCII:
            return None
        for c in chars:
            text = text.replace(c, _CLASS_STAND_IN[_char_class(c)])
    if not text:
        return 0
    classes = _BYTE_CLASS[np.frombuffer(text.encode("ascii"), dtype=np.uint8)]
    word = classes == _WORD
    space = classes >= _NEWLINE
    word_runs, _ = _runs(word)
    space_runs, space_starts = _runs(space)
    other = len(classes) - int(np.count_nonzero(word)) - int(np.count_nonzero(space))
    lone_breaks = int(np.count_nonzero(classes[space_starts[space_runs == 1]] == _NEWLINE))
    return (len(word_runs) + other + int(np.count_nonzero(space_runs >= 2)) + lone_breaks
            + int(((word_runs - 1) >> 2).sum()) + int(((space_runs - 1) >> 2).sum()))


def estimate_tokens(text: str) -> int:
    """A tokenizer-free count, close to BPE tokenizers on English prose and code."""
    return int(_COUNTS.get(text, _estimate))


def validate_messages(body: Any) -> list[dict[str, Any]]:
    """The request's messages, or an InvalidInput naming the bad field."""
    if not isinstance(body, Mapping):
        raise InvalidInput("the request body must be a JSON object", param=None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("`messages` must be a non-empty array of message objects", param="messages")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise InvalidInput(f"`{where}` must be an object", param=where)
        role = msg.get("role")
        if role not in VALID_ROLES:
            raise InvalidInput(
                f"`{where}.role` must be one of {sorted(VALID_ROLES)}, got {role!r}", param=f"{where}.role"
            )
        content = msg.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidInput(
                f"`{where}.content` must be a string, null or an array of content parts",
                param=f"{where}.content",
            )
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise InvalidInput(
                    f"`{where}.content[{j}]` must be an object with a `type`", param=f"{where}.content[{j}]"
                )
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise InvalidInput(
                    f"`{where}.content[{j}].text` must be a string", param=f"{where}.content[{j}].text"
                )
    return messages


def texts(msg: Mapping[str, Any]) -> list[str]:
    """Every text the message carries (string content or text parts), in order."""
    content = msg.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if p.get("type") == "text"]
    return []


def map_texts(msg: dict[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    """A copy of the message with `fn` applied to each text; other parts are shared untouched."""
    content = msg.get("content")
    if isinstance(content, str):
        new = fn(content)
        return msg if new == content else {**msg, "content": new}
    if isinstance(content, list):
        parts = []
        changed = False
        for part in content:
            if part.get("type") == "text":
                new = fn(part["text"])
                if new != part["text"]:
                    part = {**part, "text": new}
                    changed = True
            parts.append(part)
        return {**msg, "content": parts} if changed else msg
    return msg


@dataclass(slots=True)
class TokenCounter:
    """Counts prompt tokens per message, including the chat template's framing."""

    count_text: Callable[[str], int]
    estimated: bool
    message_overhead: int = 4
    image_part_tokens: int = 85
    _memo: dict[str, int] = field(default_factory=dict)
    # NOTE: per message object, holding the message (so its id is not reused while the counter
    # lives): the passes, the removal account and masking's plan count the same messages again
    # and again within one request, and no message is changed in place
    _by_message: dict[int, tuple[Mapping[str, Any], int]] = field(default_factory=dict)

    @classmethod
    def create(
        cls, count_tokens: Callable[[str], int] | None, message_overhead: int, image_part_tokens: int
    ) -> TokenCounter:
        if count_tokens is None:
            return cls(estimate_tokens, True, message_overhead, image_part_tokens)
        return cls(count_tokens, False, message_overhead, image_part_tokens)

    def text(self, text: str) -> int:
        if not text:
            return 0
        n = self._memo.get(text)
        if n is None:
            n = int(self.count_text(text))
            self._memo[text] = n
        return n

    def message(self, msg: Mapping[str, Any]) -> int:
        known = self._by_message.get(id(msg))
        if known is not None and known[0] is msg:
            return known[1]
        n = self._message(msg)
        self._by_message[id(msg)] = (msg, n)
        return n

    def _message(self, msg: Mapping[str, Any]) -> int:
        n = self.message_overhead + self.text(str(msg.get("role", "")))
        n += sum(self.text(t) for t in texts(msg))
        content = msg.get("content")
        if isinstance(content, list):
            n += self.image_part_tokens * sum(1 for p in content if p.get("type") != "text")
        if isinstance(msg.get("name"), str):
            n += self.text(msg["name"])
        for key in ("tool_calls", "function_call"):
            if msg.get(key):
                n += self.text(orjson.dumps(msg[key]).decode())
        return n

    def messages(self, msgs: list[dict[str, Any]]) -> int:
        return sum(self.message(m) for m in msgs)
