"""NFKC with whitespace runs collapsed, in time linear in the text and bounded per call.

CPython's normalisation reorders each run of combining marks (non-starters) with an insertion
sort: N marks of one class followed by N of another cost O(N^2), seconds for a 20 KB request
body and hours at the 4 MiB body limit. Unicode's Stream-Safe Text Format (UAX #15, section 13)
bounds every run: after 30 non-starters a COMBINING GRAPHEME JOINER (U+034F, a starter) is
inserted, so no reordering spans more than 30 marks. Text no real language writes; any text
with shorter runs is normalised exactly as before. ASCII text is its own NFKC and skips it all.
"""

from __future__ import annotations

import functools
import re
import unicodedata

# UAX #15: at most 30 non-starters in a row in stream-safe text.
MAX_NON_STARTERS = 30
CGJ = "\u034f"


@functools.cache
def _runs() -> re.Pattern[str]:
    """Runs of more than MAX_NON_STARTERS characters that decompose (NFKD) into non-starters only."""
    points: list[int] = []
    for cp in range(0x110000):
        char = chr(cp)
        if unicodedata.combining(char):
            points.append(cp)
        elif unicodedata.decomposition(char):
            decomposed = unicodedata.normalize("NFKD", char)
            if decomposed and all(unicodedata.combining(c) for c in decomposed):
                points.append(cp)
    ranges: list[list[int]] = []
    for cp in points:
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    cls = "".join(re.escape(chr(lo)) if lo == hi else f"{re.escape(chr(lo))}-{re.escape(chr(hi))}" for lo, hi in ranges)
    return re.compile(f"[{cls}]{{{MAX_NON_STARTERS + 1},}}")


def warm() -> None:
    """Build the non-starter table now (~0.4 s once), not on the first non-ASCII request."""
    _runs()


def _split(match: re.Match[str]) -> str:
    run = match.group(0)
    return CGJ.join(run[i:i + MAX_NON_STARTERS] for i in range(0, len(run), MAX_NON_STARTERS))


def stream_safe(text: str) -> str:
    """`text` with a CGJ after every MAX_NON_STARTERS non-starters in a row (unchanged if none runs longer)."""
    if text.isascii():
        return text
    return _runs().sub(_split, text)


def nfkc_collapsed(text: str) -> str:
    """Unicode NFKC of the stream-safe text, runs of whitespace collapsed to one space, ends stripped."""
    if not text.isascii():
        text = unicodedata.normalize("NFKC", stream_safe(text))
    return " ".join(text.split())
