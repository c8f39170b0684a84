"""CSV for spreadsheets: cells a spreadsheet would run as a formula are neutralised (OWASP's rule).

Tenant, app and model names are chosen by clients (any model name an upstream serving "*"
accepts): a cell such as `=HYPERLINK(...)` or `+cmd|' /C calc'!A0` in an export would run when an
admin opens it. Such a cell is written with a leading `'`, which spreadsheets show as text.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable
from typing import IO, Any

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def neutralise(cell: str) -> str:
    """`cell` as a spreadsheet reads it as text: prefixed with `'` when it starts like a formula.

    A plain number (`-0.25`, `+3e-5`) is left alone: it is read as a number, never run.
    """
    if cell.startswith(FORMULA_START) and not _NUMBER.fullmatch(cell):
        return "'" + cell
    return cell


class SafeWriter:
    """csv.writer whose rows have every text cell neutralised."""

    def __init__(self, out: IO[str]) -> None:
        self._writer = csv.writer(out, lineterminator="\n")

    def writerow(self, cells: Iterable[Any]) -> None:
        self._writer.writerow([neutralise(c) if isinstance(c, str) else c for c in cells])
