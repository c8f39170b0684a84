"""Lossless rewrites of one text: whitespace and collapsed repetition in prose; code passes through.

NOTE: whitespace is meaning in code (Python, YAML, Makefiles, diffs) and in what agents read
(`cat -n` listings, aligned columns): a text that carries any of it is left byte for byte, not
only the code inside it, since an agent's next exact-string edit is built on what the model saw.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from policies.trim.messages import TextMemo

# Fenced code (closed or running to the end), <pre> blocks and inline code spans are kept byte for byte.
_PROTECTED = re.compile(
    r"^[ \t]{0,3}(?P<fence>`{3,}|~{3,})[^\n]*(?:\n.*?^[ \t]{0,3}(?P=fence)[ \t]*$|.*\Z)"
    r"|<pre\b.*?(?:</pre>|\Z)"
    r"|`[^`\n]+`",
    re.MULTILINE | re.DOTALL | re.IGNORECASE,
)
# An indented line may be an indented code block: its spacing means something.
_INDENTED = re.compile(r"^(?: {4}|\t)")
_LEADING = re.compile(r"^[ \t]*")
_RUN = re.compile(r"[ \t]{2,}")
_BLANK_LINES = re.compile(r"\n{3,}")
_LINE_MARKER = re.compile(r"^\[previous line repeated \d+ more times\]$")
PARAGRAPH_MARKER = "[repeated paragraph omitted]"
# What makes a text code (or a listing, a diff, a table) rather than prose: a tab; a fence or
# <pre>; an indented line; a line-numbered listing (`cat -n`, Claude Code's Read: "  12\t...",
# "  12→..."); a unified diff's headers or its lines of indented code; a comment set apart after
# code; and, on two lines or more, two or more spaces between words where no sentence ends
# (aligned columns). One such gap alone is a typing slip in prose.
_CODE = re.compile(
    r"\t|`{3}|~{3}|<pre\b"
    r"|^[ ]+\S"
    r"|^[ ]*\d+(?:→|\|)"
    r"|^(?:@@ |\+\+\+ |--- |diff --git )"
    r"|^[+\-][ ]{2,}\S"
    r"|\S {2,}(?:#|//)",
    re.MULTILINE | re.IGNORECASE,
)
_GAP = re.compile(r"^.*?[^\s.!?:;,] {2,}\S", re.MULTILINE)


_CHECKED = TextMemo()


def carries_code(text: str) -> bool:
    """Whether `text` holds code, a listing, a diff or a table: then no lossless pass rewrites it."""
    return bool(_CHECKED.get(text, _carries_code))


def _carries_code(text: str) -> bool:
    if _CODE.search(text) is not None:
        return True
    gaps = _GAP.finditer(text)
    return next(gaps, None) is not None and next(gaps, None) is not None


def segments(text: str) -> Iterator[tuple[int, int, bool]]:
    """(start, end, protected) spans covering the text in order."""
    pos = 0
    for m in _PROTECTED.finditer(text):
        if m.start() > pos:
            yield pos, m.start(), False
        yield m.start(), m.end(), True
        pos = m.end()
    if pos < len(text):
        yield pos, len(text), False


def _map_free(text: str, fn: Callable[[str, bool, bool, bool], str]) -> str:
    parts = []
    for start, end, protected in segments(text):
        seg = text[start:end]
        if protected:
            parts.append(seg)
        else:
            at_line_start = start == 0 or text[start - 1] == "\n"
            parts.append(fn(seg, at_line_start, start == 0, end == len(text)))
    return "".join(parts)


def _normalise_free(seg: str, at_line_start: bool, at_text_start: bool, at_text_end: bool) -> str:
    seg = seg.replace("\r\n", "\n")
    lines = seg.split("\n")
    out = []
    last = len(lines) - 1
    for i, line in enumerate(lines):
        line_start = i > 0 or at_line_start
        if not (line_start and _INDENTED.match(line)):
            lead = _LEADING.match(line).group() if line_start else ""  # type: ignore[union-attr]
            line = lead + _RUN.sub(" ", line[len(lead):])
        if i < last or at_text_end:
            line = line.rstrip(" \t\r")
        out.append(line)
    seg = _BLANK_LINES.sub("\n\n", "\n".join(out))
    if at_text_start:
        seg = seg.lstrip("\n")
    if at_text_end:
        seg = seg.rstrip()
    return seg


# The rewrites of texts seen before: an agent sends the same messages again every turn. A text
# that a rewrite leaves alone is kept as itself (no second copy); the boilerplate pass's memo is
# per (min_repeats, min_paragraph_chars), a few at most (one per trim policy in force).
_NORMALISED = TextMemo()
_COLLAPSED: dict[tuple[int, int], TextMemo] = {}
_MAX_COLLAPSE_MEMOS = 16


def _unchanged_as_itself(text: str, new: str) -> str:
    return text if new == text else new


def rewritten_before(text: str) -> bool:
    """Whether the lossless rewrites saw `text` on an earlier request (its rewrite is memoised, near free)."""
    return _NORMALISED.knows(text)


def normalise_whitespace(text: str) -> str:
    """Trailing spaces, runs of spaces and blank lines squeezed in prose; a text with code is left whole."""
    return str(_NORMALISED.get(text, _normalise))


def _normalise(text: str) -> str:
    if carries_code(text):
        return text
    return _unchanged_as_itself(text, _map_free(text, _normalise_free))


def collapse_repeats(text: str, min_repeats: int, min_paragraph_chars: int) -> str:
    """Runs of identical lines become one line and a count; repeated long paragraphs a marker (prose only)."""
    key = (min_repeats, min_paragraph_chars)
    memo = _COLLAPSED.get(key)
    if memo is None:
        if len(_COLLAPSED) >= _MAX_COLLAPSE_MEMOS:
            _COLLAPSED.clear()
        memo = _COLLAPSED.setdefault(key, TextMemo())
    return str(memo.get(text, lambda t: _collapse(t, min_repeats, min_paragraph_chars)))


def _collapse(text: str, min_repeats: int, min_paragraph_chars: int) -> str:
    if carries_code(text):
        return text
    seen: set[str] = set()

    def collapse(seg: str, at_line_start: bool, at_text_start: bool, at_text_end: bool) -> str:
        lines = seg.split("\n")
        out: list[str] = []
        i = 0
        while i < len(lines):
            line = lines[i]
            j = i + 1
            while j < len(lines) and lines[j] == line:
                j += 1
            n = j - i
            marker = f"[previous line repeated {n - 1} more times]"
            # The first and last line of a segment may continue into protected text: never merge them.
            interior = (i > 0 or at_line_start) and (j < len(lines) or at_text_end)
            if (
                n >= min_repeats
                and interior
                and line.strip()
                and not _LINE_MARKER.match(line)
                and len(line) * (n - 1) > len(marker) + 1
            ):
                out.extend((line, marker))
            else:
                out.extend(lines[i:j])
            i = j
        paragraphs = "\n".join(out).split("\n\n")
        for k, para in enumerate(paragraphs):
            if len(para) < min_paragraph_chars or para == PARAGRAPH_MARKER:
                continue
            # Only whole paragraphs: the first and last piece may run into protected text.
            whole = (k > 0 or at_line_start) and (k < len(paragraphs) - 1 or at_text_end)
            if not whole:
                continue
            if para in seen:
                paragraphs[k] = PARAGRAPH_MARKER
            else:
                seen.add(para)
        return "\n\n".join(paragraphs)

    return _unchanged_as_itself(text, _map_free(text, collapse))
